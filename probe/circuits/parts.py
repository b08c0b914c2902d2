"""The modules and weights of a model that its component graph reads and writes, from its anatomy.

Per layer: the norm before the attention and before the MLP (whose inputs are the receivers'
residual stream), the query/key/value projection(s) with the columns each receiver's head owns,
the attention output projection (whose input, split per head, makes each head's write) and the
MLP (whose output is its write); then the final norm (the logits' receiver) and the first block
(whose input is the `input` node's write). `parts_of` refuses, by name, what the graph cannot
describe: a post-norm model, a family without anatomy (naming the `model.anatomy.*` keys), a
projection of an unknown kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from probe.circuits.component_graph import ComponentGraph
from probe.errors import ConfigError
from probe.hooks.module_select import block_names
from probe.models.anatomy import QKV_LAYOUTS, Anatomy, anatomy

KEYS = (
    "model.anatomy.attn_norm=SUFFIX, mlp_norm=SUFFIX (the norms before the attention and the MLP), "
    "qkv=SUFFIX or [Q,K,V] with qkv_layout=split|fused|per_head, attn_out=SUFFIX (the attention "
    "output projection), mlp_out=SUFFIX (the MLP), final_norm=NAME, heads=N, kv_heads=N, "
    "parallel=true|false"
)


@dataclass
class Projection:
    """One module making queries, keys or values: its weight as (out, in), its bias, and the
    receivers it serves (indices within the layer's attention receivers) with each one's first
    output column."""

    module: nn.Module
    name: str
    receivers: torch.Tensor  # (r,) indices among the layer's attention receivers
    columns: torch.Tensor  # (r, head_dim) output columns of each

    def weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return as_linear(self.module, self.name)


@dataclass
class Layer:
    attn_norm: nn.Module
    mlp_norm: nn.Module
    projections: list[Projection]
    attn_out: nn.Module
    attn_out_name: str
    mlp: nn.Module


@dataclass
class Parts:
    """A model's graph and the modules behind it."""

    model: nn.Module
    graph: ComponentGraph
    layers: list[Layer]
    first_block: nn.Module
    final_norm: nn.Module
    head_dim: int
    width: int
    family: str
    checked: bool = False  # the residual-sum identity held on a batch

    def head_weights(self, layer: int, dtype=None) -> torch.Tensor:
        """(heads, head_dim, width): each head's slice of the output projection, as (in, out)."""
        w, _ = as_linear(self.layers[layer].attn_out, self.layers[layer].attn_out_name)
        w = w.T.reshape(self.graph.heads, self.head_dim, self.width)
        return w if dtype is None else w.to(dtype)


def as_linear(module: nn.Module, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A projection's weight as (out, in) and its bias: nn.Linear, or HF's Conv1D (stored as
    (in, out)); another kind is refused by name."""
    kind = type(module).__name__
    if isinstance(module, nn.Linear):
        return module.weight, module.bias
    if kind == "Conv1D":  # (parameters, which Module.__getattr__ types as Tensor | Module)
        return cast(torch.Tensor, module.weight).T, cast("torch.Tensor | None", module.bias)
    raise ConfigError(
        f"circuits: {name!r} is a {kind}; the graph reads projections that are nn.Linear or "
        "transformers' Conv1D. Point model.anatomy.qkv / attn_out at such modules"
    )


def parts_of(model: nn.Module, overrides: dict | None = None) -> Parts:
    """The parts of `model` (its anatomy, with `model.anatomy` overrides), or a ConfigError
    naming what is missing and the keys that set it."""
    body = anatomy(model, block_names(model), overrides)
    if body.post_norm:
        raise ConfigError(
            f"circuits: {body.family!r} is a post-norm model (each block normalises its residual "
            "stream), so the residual is not a sum of the components' writes and no edge can be "
            "scored or patched; use a pre-norm model (GPT-2, Llama, Mistral, Qwen, GPT-NeoX)"
        )
    if body.sandwich:
        raise ConfigError(
            f"circuits: {body.family!r} norms each attention's and MLP's output again before the "
            "residual stream (post_attn_norm, post_mlp_norm: Gemma-2, Gemma-3), so the residual "
            "is not a sum of the projections' writes; use a family without them"
        )
    _require(body)
    modules = dict(model.named_modules())
    n = len(body.blocks)
    heads = body.heads
    assert heads  # _require refuses an anatomy without heads
    kv = body.kv_heads or heads
    graph = ComponentGraph(n, heads, kv, body.parallel)
    first_out, _ = as_linear(modules[body.attn_out[0]], body.attn_out[0])
    width, inner = first_out.shape
    head_dim = body.head_dim or inner // heads
    if head_dim * heads != inner:
        raise ConfigError(
            f"circuits: {body.attn_out[0]!r} takes {inner} inputs, not {heads} heads of "
            f"{head_dim}; set model.anatomy.heads and head_dim to the model's"
        )
    layers = [
        Layer(
            modules[body.attn_norm[i]],
            modules[body.mlp_norm[i]],
            _projections(body, graph, modules, i, head_dim),
            modules[body.attn_out[i]],
            body.attn_out[i],
            modules[body.mlp_out[i]],
        )
        for i in range(n)
    ]
    return Parts(
        model, graph, layers, modules[body.blocks[0]], modules[body.final_norm], head_dim,
        width, body.family,
    )  # fmt: skip


def _require(body: Anatomy) -> None:
    n = len(body.blocks)
    missing = [
        key
        for key, got in (
            ("attn_norm", len(body.attn_norm) == n),
            ("mlp_norm", len(body.mlp_norm) == n),
            ("qkv", len(body.qkv) == n and body.qkv_layout in QKV_LAYOUTS),
            ("attn_out", len(body.attn_out) == n),
            ("mlp_out", len(body.mlp_out) == n),
            ("final_norm", body.final_norm is not None),
            ("heads", bool(body.heads)),
        )
        if not got
    ]
    if n == 0:
        missing.insert(0, "blocks (no stack of layers found)")
    if missing:
        raise ConfigError(
            f"circuits: the graph of a {body.family!r} model cannot be built: probe does not know "
            f"its {', '.join(missing)}. Set them by hand: {KEYS}"
        )


def _projections(body: Anatomy, graph: ComponentGraph, modules: dict, layer: int, dim: int):
    """The layer's query/key/value projections and the columns of each attention receiver:
    receivers in graph order (q per head, k per key/value head, v per key/value head)."""
    h, kv = graph.heads, graph.kv_heads
    kinds = [(0, i) for i in range(h)] + [(1, j) for j in range(kv)] + [(2, j) for j in range(kv)]
    names = body.qkv[layer]
    layout = body.qkv_layout
    if layout == "split" and len(names) != 3:
        raise ConfigError(
            f"circuits: model.anatomy.qkv_layout=split needs three projections (q, k, v); got {list(names)}"
        )
    if layout in ("fused", "per_head") and len(names) != 1:
        raise ConfigError(
            f"circuits: model.anatomy.qkv_layout={layout} needs one fused projection; got {list(names)}"
        )
    if layout == "per_head" and kv != h:
        raise ConfigError(
            "circuits: qkv_layout=per_head (GPT-NeoX) has one key/value head per query head; "
            f"got heads={h}, kv_heads={kv}"
        )
    starts: dict[int, list[tuple[int, int]]] = {}
    for r, (kind, head) in enumerate(kinds):
        if layout == "split":
            module, start = kind, head * dim
        elif layout == "fused":  # [all q | all k | all v]
            module, start = 0, (0, h * dim, (h + kv) * dim)[kind] + head * dim
        else:  # per_head: [head 0: q k v | head 1: q k v | ...]
            module, start = 0, head * 3 * dim + kind * dim
        starts.setdefault(module, []).append((r, start))
    out = []
    for m, pairs in sorted(starts.items()):
        receivers = torch.tensor([r for r, _ in pairs])
        columns = torch.tensor([s for _, s in pairs])[:, None] + torch.arange(dim)
        module = modules[names[m]]
        w, _ = as_linear(module, names[m])
        if int(columns.max()) >= w.shape[0]:
            raise ConfigError(
                f"circuits: {names[m]!r} has {w.shape[0]} outputs, fewer than the {layout} layout "
                f"of {h} heads and {kv} key/value heads of {dim} needs; check model.anatomy.qkv, "
                "qkv_layout, heads, kv_heads and head_dim"
            )
        out.append(Projection(module, names[m], receivers, columns))
    return out


def graph_of(model: nn.Module, overrides: dict | None = None) -> ComponentGraph:
    """The component graph of `model` (see probe.circuits.component_graph)."""
    return parts_of(model, overrides).graph
