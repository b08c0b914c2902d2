"""Where attention comes from: the pre-softmax attention score of a (layer, head, query position,
key position) pair decomposed over the query-side and key-side parts of the local replacement
model's residual stream (the QK attribution of a graph; docs/graphs.md, "Where attention comes
from").

A graph freezes every attention pattern, so an edge through a head says nothing about why the
head attended there. The score is bilinear in the residual stream once the norms are frozen:
the residual at layer l's attention input at a position is the sum of its parts (the token's
embedding, the rest of the input embedding such as GPT-2's position embedding, and per earlier
layer its attention's write, each transcoder feature's write (a cross-layer transcoder's
features' writes into every layer up to l-1 summed per feature), the error node and the MLP
write's rest: b_dec and the skip path, and at the graph's zeroed positions (position 0 under
zero_bos) the whole write). Each
part goes through the attention norm with its scale frozen at the prompt's (centring and gain
kept), the query or key projection, a q/k norm with its scale frozen likewise (Qwen3, Gemma-3:
exact on the prompt, linear around it, as the graph freezes every norm) and the rotary
embedding at its position; the norm's bias and the projections' biases make one `bias` part per
side. Then

    score(q, k) = scaling * sum_i sum_j  q_i . k_j        (before a softcap and the mask)

with `scaling` the family's (1/sqrt(d_head), Gemma's query_pre_attn_scalar, GPT-2's layer
scaling). The parts are computed by the attention module itself (its own projections, rotary and
q/k norms run on the parts, the attention function replaced by one that reads the query and
key), and two checks make the table exact or refused: the query and key of the captured input
give the pattern the model produced (softcap, mask and softmax applied), and every pair's cells
sum to its score.

    table = qk_table(model, graph, transcoders, keys=2)     # a DataFrame of QK_COLUMNS

With sources="nodes" the attention writes are not kept whole: each side's residual is split over
the graph's nodes at every earlier position and layer, and named constant parts, through the
earlier layers' frozen patterns (probe.graphs.qk_sources: by forward or backward passes,
whichever costs less; "nodes_forward" or "nodes_backward" asks for one); the rest is the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pandas as pd
import torch
from torch import nn

from probe.errors import ConfigError, ModelError
from probe.graphs.attribution import _lean, check_qk_options, zeroed_positions
from probe.graphs.graph_data import QK_COLUMNS, GraphData
from probe.graphs.qk_cells import PairCells, largest
from probe.graphs.replacement import LocalReplacement, _additive, check_interface
from probe.hooks.hookset import HookSet
from probe.models.cross_layer_transcoder import AnyTranscoders, CrossLayerTranscoder
from probe.models.norms import apply_gain, centred_and_scale, mismatch, prove

ALL = "*"  # a marginal row's other side: every part of it
REST = "rest"  # the cells (or marginal parts) beyond the `rows` largest, summed
CAPTURE_NAME = "probe_qk_capture"
PARTS_PER_PASS = 256  # parts run through an attention module at once (bounds its activations)


@dataclass
class _Part:
    """One part of the residual stream at a position: its name, its graph node (-1: none)."""

    name: str
    node: int
    vector: torch.Tensor


@dataclass
class _Residual:
    """The parts of the residual stream at each position, in order of appearance."""

    n_pos: int
    parts: list[dict[str, _Part]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.parts = [{} for _ in range(self.n_pos)]

    def add(self, pos: int, name: str, node: int, vector: torch.Tensor) -> None:
        here = self.parts[pos]
        if name in here:
            here[name].vector = here[name].vector + vector
        else:
            here[name] = _Part(name, node, vector)

    def tensor(self, width: int, dtype, device) -> torch.Tensor:
        """(max parts, n_pos, width): part i of each position, zeros where a position has fewer."""
        most = max(len(p) for p in self.parts)
        out = torch.zeros(most, self.n_pos, width, dtype=dtype, device=device)
        for pos, here in enumerate(self.parts):
            for i, part in enumerate(here.values()):
                out[i, pos] = part.vector.to(dtype)
        return out

    def names(self, pos: int) -> list[_Part]:
        return list(self.parts[pos].values())


def query_positions(graph: GraphData) -> list[int]:
    """The positions of the graph's kept feature and error nodes and of its logits (every node's
    when the graph is not pruned)."""
    nodes = graph.nodes()
    kept = nodes[nodes["kept"] & nodes["kind"].isin(["feature", "error"])]
    return sorted({int(p) for p in kept["pos"]} | {graph.n_pos - 1})


def qk_table(
    model: nn.Module,
    graph: GraphData,
    transcoders: AnyTranscoders,
    *,
    keys: int = 2,
    rows: int | None = 20,
    overrides: dict | None = None,
    zero_bos: bool = True,
    positions: list[int] | None = None,
    sources: str = "position",
    batch: int | None = None,
) -> pd.DataFrame:
    """The QK attribution of `graph` (see the module docstring) as a table of QK_COLUMNS: for
    every layer, head and query position (`positions`, default query_positions(graph)), the
    `keys` key positions it attends to most, each pair's score decomposed into cells (a
    query-side part times a key-side part) and marginals (a part times the other side whole:
    `*`), the `rows` largest |contribution| of each kept and the rest summed in a `rest` row.
    `zero_bos` must be the graph's (position 0's features and error are no nodes, an
    instruction-tuned Gemma-3's first four: probe.graphs.attribution.zeroed_positions).
    `sources`: "position" splits each side into the parts at its own position (an earlier
    attention's write one part, `attn l'@p`); "nodes" traces those writes through their frozen
    patterns to the nodes at every earlier position and layer (probe.graphs.qk_sources, with
    `batch` prompt copies per pass; None: the memory plan's), by forward or backward passes,
    whichever its cost estimate finds cheaper; "nodes_forward" and "nodes_backward" ask for
    one (the same table to float rounding)."""
    check_qk_options(keys, rows, sources)
    if batch is not None and (not isinstance(batch, int) or batch < 1):
        raise ConfigError(
            f"qk_table(batch={batch!r}): the prompt copies per pass of the traced table, an "
            "integer >= 1, or None for the memory plan's"
        )
    if keys == 0:
        return pd.DataFrame(columns=list(QK_COLUMNS))
    positions = query_positions(graph) if positions is None else positions
    ids = graph.tokens
    device = next(model.parameters()).device
    transcoders.to(device=device)
    seen = _Forward(model, transcoders, overrides)
    with seen:
        with torch.no_grad():
            model(ids[None].to(device), **_lean(model))
        check_interface(seen.rep)
        writes = _mlp_writes(seen.rep, transcoders, zeroed_positions(model, ids, zero_bos))
    out = []
    if sources == "position":
        for layer, residual in enumerate(_residual_parts(seen, writes, graph)):
            out.extend(_layer_rows(seen, layer, residual, positions, keys, rows))
        return pd.DataFrame(out, columns=list(QK_COLUMNS))
    from probe.graphs.qk_sources import NodeSources, needed_positions

    needed = {}
    for layer in range(seen.parts.n_layers):
        pattern = seen.rep.saved["patterns"][layer][0].double()
        needed[layer] = needed_positions(pattern, positions, keys)
    direction = {"nodes": None, "nodes_forward": "forward", "nodes_backward": "backward"}[sources]
    traced = NodeSources(seen, writes, graph, transcoders, overrides, batch, direction, needed)
    for layer in range(seen.parts.n_layers):
        residual = traced.residual(layer, needed[layer], _Residual)
        x = seen.norm_io["attn_norm", layer][0][0]
        _check_sum(residual, x, seen.parts.name(seen.parts.attns[layer]), traced.direction)
        out.extend(_layer_rows(seen, layer, residual, positions, keys, rows))
    return pd.DataFrame(out, columns=list(QK_COLUMNS))


class _Forward:
    """One forward of the prompt under the replacement model's record mode (its patterns, the
    nodes' values), keeping what the QK table needs: each attention's call (its arguments), its
    norm's input and output, each layer's attention and MLP writes to the residual stream and,
    for a set that writes before a norm after the MLP, that norm's input and output."""

    def __init__(self, model, transcoders, overrides) -> None:
        self.model = model
        self.rep = LocalReplacement(model, transcoders, overrides, mode="record")
        self.parts = self.rep.parts
        self.hooks = HookSet("qk attribution")
        self.calls: dict[int, tuple[tuple, dict]] = {}
        self.norm_io: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.attn_writes: dict[int, torch.Tensor] = {}
        self.mlp_writes: dict[int, torch.Tensor] = {}

    def __enter__(self) -> _Forward:
        self.rep.__enter__()
        try:
            self.hooks.enter(self._register)
        except BaseException:
            self.rep.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.hooks.__exit__(*exc)
        finally:
            self.rep.__exit__(*exc)

    def _register(self) -> None:
        p = self.parts
        for layer, attn in enumerate(p.attns):
            self.hooks.forward_pre(attn, self._call(layer), with_kwargs=True, name=f"attn {layer}")
            self.hooks.forward(p.attn_norms[layer], self._norm("attn_norm", layer))
            write = (p.post_attn_norms or p.attns)[layer]
            self.hooks.forward(write, self._write(self.attn_writes, layer))
            self.hooks.forward(p.mlp_writes[layer], self._write(self.mlp_writes, layer))
        for layer, norm in enumerate(self.rep.frozen_post_mlp):
            self.hooks.forward(norm, self._norm("post_mlp_norm", layer))
        for layer, norm in enumerate(p.post_attn_norms):
            self.hooks.forward(norm, self._norm("post_attn_norm", layer))

    def _call(self, layer: int):
        def hook(module, args, kwargs):
            self.calls[layer] = (args, dict(kwargs))

        return hook

    def _norm(self, kind: str, layer: int):
        def hook(module, args, out):
            self.norm_io[kind, layer] = (args[0].detach(), out.detach())

        return hook

    def _write(self, into: dict, layer: int):
        def hook(module, args, out):
            into[layer] = (out[0] if isinstance(out, tuple) else out).detach()

        return hook

    def rerun_attention(self, layer: int, x: torch.Tensor, name: str, attend):
        """Layer `layer`'s attention module run on `x` with its recorded call's other arguments,
        its attention function replaced by `attend` (registered with transformers as `name`)
        for the call; the module's output."""
        from transformers.modeling_utils import AttentionInterface

        AttentionInterface.register(name, attend)
        attn, (args, kwargs) = self.parts.attns[layer], self.calls[layer]
        config = self.model.config
        original = config._attn_implementation
        try:
            config._attn_implementation = name
            if args:
                return attn(x, *args[1:], **kwargs)
            return attn(**{**kwargs, "hidden_states": x})
        finally:
            config._attn_implementation = original

    def norm_bias(self, kind: str, layer: int, module: nn.Module) -> torch.Tensor:
        """The norm's bias (zeros where it has none), in its input's dtype."""
        x = self.norm_io[kind, layer][0]
        bias = getattr(module, "bias", None)
        if isinstance(bias, torch.Tensor):
            return bias.detach().to(x.dtype)
        return torch.zeros(x.shape[-1], dtype=x.dtype, device=x.device)

    def frozen_norm(self, kind: str, layer: int, module: nn.Module):
        """The norm `module` as the graph freezes it, a linear map: v -> centre(v) x the scale
        it had on the prompt x its gain (the bias left to the `bias` part)."""
        x, out = self.norm_io[kind, layer]
        formula, eps = prove(module, self.parts.name(module), x, out)
        _, scale = centred_and_scale(formula, eps, x)
        bias = getattr(module, "bias", None)

        def linear(v: torch.Tensor) -> torch.Tensor:
            vc, _ = centred_and_scale(formula, eps, v, scale)
            y = apply_gain(formula, module, vc * scale)
            return y - bias.to(y.dtype) if isinstance(bias, torch.Tensor) else y

        return linear


@dataclass
class _LayerWrites:
    """What one layer's MLP output holds, in the transcoders' output space and the model's
    dtype: each active feature's write into it ((layer, pos, feature) of the feature, and
    activation x decoder row: a cross-layer transcoder's earlier layers' features too) and the
    error (the MLP's output minus the transcoders', zero at the graph's zeroed positions)."""

    features: list[tuple[int, int, int]]
    vectors: torch.Tensor  # (k, d)
    error: torch.Tensor  # (n_pos, d)


@torch.no_grad()
def _mlp_writes(rep: LocalReplacement, transcoders: AnyTranscoders, zeroed: int):
    """Each layer's _LayerWrites, the graph's definitions (probe.graphs.attribution's nodes: the
    first `zeroed` positions' features and errors are none) kept in the model's dtype (the
    graph's own are float32)."""
    n = len(transcoders)
    inputs = [rep.captured.inputs[layer][0] for layer in range(n)]
    if isinstance(transcoders, CrossLayerTranscoder):
        acts = [transcoders.encode(layer, x) for layer, x in enumerate(inputs)]
    else:
        acts = [transcoders[layer].encode(x) for layer, x in enumerate(inputs)]
    for a in acts:
        a[:zeroed] = 0
    if isinstance(transcoders, CrossLayerTranscoder):
        recon = transcoders.decode(acts)
        outs = [recon[layer] + transcoders.skip(layer, inputs[layer]) for layer in range(n)]
    else:
        outs = [transcoders[layer].decode(a) + transcoders[layer].skip(x)
                for layer, (a, x) in enumerate(zip(acts, inputs, strict=True))]  # fmt: skip
    out = []
    for target in range(n):
        features, vectors = [], []
        sources = range(target + 1) if isinstance(transcoders, CrossLayerTranscoder) else [target]
        for source in sources:
            pos, feat = torch.nonzero(acts[source], as_tuple=True)
            value = acts[source][pos, feat]
            if isinstance(transcoders, CrossLayerTranscoder):
                rows = transcoders.W_dec[source][feat, target - source]
            else:
                rows = transcoders[target].W_dec[feat]
            features += [(source, p, f) for p, f in zip(pos.tolist(), feat.tolist(), strict=True)]
            vectors.append(value[:, None] * rows)
        value_out = rep.captured.mlp_values[target][0]
        error = value_out - outs[target].to(value_out.dtype)
        error[:zeroed] = 0
        out.append(_LayerWrites(features, torch.cat(vectors), error))
    return out


def _residual_parts(seen: _Forward, writes: list[_LayerWrites], graph) -> list[_Residual]:
    """Per layer, the parts of the residual stream at its attention's input, checked to sum to
    the norm's input the forward saw."""
    parts, n_layers = seen.parts, seen.parts.n_layers
    assert seen.rep.captured.embed is not None  # (the forward ran)
    embed = seen.rep.captured.embed[0].detach()
    first = seen.norm_io["attn_norm", 0][0][0]
    n_pos = int(embed.shape[0])
    node_of = graph.feature_numbers()
    residual = _Residual(n_pos)
    token0 = graph.offsets["token"]
    error0 = graph.offsets["error"]
    rest = first - embed.to(first.dtype)
    for pos in range(n_pos):
        residual.add(pos, f"token@{pos}", token0 + pos, embed[pos])
        if bool(rest[pos].abs().max() > 0):
            residual.add(pos, f"embed rest@{pos}", -1, rest[pos])
    out = []
    for layer in range(n_layers):
        here = _Residual(n_pos)
        here.parts = [dict((k, _Part(v.name, v.node, v.vector)) for k, v in p.items())
                      for p in residual.parts]  # fmt: skip
        _check_sum(here, seen.norm_io["attn_norm", layer][0][0], parts.name(parts.attns[layer]))
        out.append(here)
        if layer + 1 == n_layers:
            break
        through = (
            seen.frozen_norm("post_mlp_norm", layer, seen.rep.frozen_post_mlp[layer])
            if seen.rep.frozen_post_mlp
            else (lambda v: v)
        )
        attn = seen.attn_writes[layer][0]
        mlp = seen.mlp_writes[layer][0]
        accounted = torch.zeros_like(mlp)
        here_writes = writes[layer]
        vectors = through(here_writes.vectors.to(mlp.dtype))
        for key, vec in zip(here_writes.features, vectors, strict=True):
            pos = key[1]
            residual.add(pos, f"feature {key[0]}:{key[2]}@{pos}", node_of.get(key, -1), vec)
            accounted[pos] += vec
        errors = through(here_writes.error.to(mlp.dtype))
        for pos in range(n_pos):
            residual.add(pos, f"attn {layer}@{pos}", -1, attn[pos])
            if pos > 0 or bool(errors[pos].abs().max() > 0):
                residual.add(pos, f"error {layer}@{pos}", error0 + layer * n_pos + pos, errors[pos])
            residual.add(
                pos, f"mlp {layer} rest@{pos}", -1, mlp[pos] - accounted[pos] - errors[pos]
            )
    return out


def _check_sum(residual: _Residual, want: torch.Tensor, name: str,
               traced: str | None = None) -> None:  # fmt: skip
    """The parts of each position sum to the residual `want`, within the dtype's rounding of
    the parts' |sum| per component; `traced` (the direction that traced the parts through
    earlier layers, qk_sources): of their largest component at the position, as a norm
    computing in float32 inside a float64 model (Llama's) rounds the real residual, and the
    frozen map the parts follow does not."""
    got = torch.stack(
        [torch.stack([p.vector for p in here.values()]).sum(0) for here in residual.parts]
    )
    size = torch.stack([torch.stack([p.vector.abs() for p in here.values()]).sum(0)
                        for here in residual.parts])  # fmt: skip
    diff = (got.to(want.dtype) - want).abs()
    if traced:
        size = size.amax(-1, keepdim=True).expand_as(size)
    largest = float(diff.max())
    ok = bool((diff <= _rtol(want.dtype) * size.to(want.dtype) + 1e-30).all())
    if not ok:
        how = ""
        if traced is not None:  # (the other direction, or the parts at their own position)
            other = "nodes_backward" if traced == "forward" else "nodes_forward"
            how = (f", traced to the nodes by the {traced} direction; "
                   f"graph.qk_sources={other} or position may decompose them")  # fmt: skip
        raise ModelError(
            f"graphs: the parts of the residual stream at {name!r}'s input do not sum to it (off "
            f"by up to {largest:.3g}); the QK attribution cannot decompose its scores{how}"
        )


# -- the attention module on the parts -----------------------------------------------------------
@dataclass
class _QK:
    """What an attention module's query and key projections made of a batch of inputs."""

    query: list[torch.Tensor] = field(default_factory=list)  # (b, heads, n, d_head) per call
    key: list[torch.Tensor] = field(default_factory=list)


class _Capture:
    """The attention function the parts run through: it keeps the query and key it is given
    (after the family's projections, q/k norms and rotary) and returns zeros."""

    active: _QK | None = None

    @staticmethod
    def attend(module, query, key, value, attention_mask, **kwargs):
        if _Capture.active is None:
            raise ModelError(f"attention implementation {CAPTURE_NAME!r} called outside a QK pass")
        _Capture.active.query.append(query.detach())
        _Capture.active.key.append(key.detach())
        b, _, n, _ = query.shape
        return query.new_zeros(b, n, query.shape[1], value.shape[-1]), None


class _FrozenQKNorms:
    """Forward hooks on an attention's q/k norms (any norm inside it): the first batch's item 0
    (the real input) fixes each norm's scale per position and head; every item then gets
    centre(x) x that scale x the gain (exact on the real input, linear in the parts)."""

    def __init__(self, attn: nn.Module, hooks: HookSet, name: str) -> None:
        self.scales: dict[int, tuple] = {}
        for sub_name, m in attn.named_modules():
            if m is not attn and "norm" in type(m).__name__.lower() and not list(m.children()):
                hooks.forward(m, self._hook(f"{name}.{sub_name}"))

    def _hook(self, name: str):
        def hook(module, args, out):
            x = args[0]
            if id(module) not in self.scales:
                formula, eps = prove(module, name, x[:1], out[:1])
                _, scale = centred_and_scale(formula, eps, x[:1])
                self.scales[id(module)] = (formula, eps, scale)
            formula, eps, scale = self.scales[id(module)]
            xc, _ = centred_and_scale(formula, eps, x, scale)
            return apply_gain(formula, module, xc * scale).to(out.dtype)

        return hook


def _project(seen: _Forward, layer: int, inputs: list[torch.Tensor]) -> _QK:
    """The attention module of `layer` run on each of `inputs` (b, n, d) with its recorded
    call's other arguments; its queries and keys."""
    attn = seen.parts.attns[layer]
    got = _QK()
    hooks = HookSet("qk norms")
    try:
        _Capture.active = got
        with hooks, torch.no_grad():
            _FrozenQKNorms(attn, hooks, seen.parts.name(attn))
            for x in inputs:
                seen.rerun_attention(layer, x, CAPTURE_NAME, _Capture.attend)
    finally:
        _Capture.active = None
    return got


def _scaling(module: nn.Module, head_dim: int) -> float:
    """The family's factor on q . k: `scaling` (Llama, Qwen, Gemma, Mistral, GPT-NeoX) or
    GPT-2's (1/sqrt(d_head) with scale_attn_weights, divided by layer + 1 with
    scale_attn_by_inverse_layer_idx); checked against the pattern by the caller."""
    value = getattr(module, "scaling", None)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if hasattr(module, "scale_attn_weights"):
        s = head_dim**-0.5 if module.scale_attn_weights else 1.0
        if getattr(module, "scale_attn_by_inverse_layer_idx", False):
            s /= float(getattr(module, "layer_idx", 0)) + 1.0
        return s
    raise ConfigError(
        f"graphs: the attention {type(module).__name__} has no `scaling`, so probe cannot read "
        "its scores as scaled q . k; the QK attribution (graph.qk) covers GPT-2, Llama, Mistral, "
        "Qwen, Gemma and GPT-NeoX: leave graph.qk=0 for this model"
    )


def _layer_rows(seen, layer, residual: _Residual, positions, keys, rows) -> list[tuple]:
    """The table's rows of one layer (see qk_table)."""
    attn = seen.parts.attns[layer]
    args, kwargs = seen.calls[layer]
    query0, key0, q_parts, k_parts = _projected_parts(seen, layer, residual)
    heads, head_dim = query0.shape[0], query0.shape[-1]
    scaling = _scaling(attn, head_dim)
    real = (query0 @ key0.transpose(-1, -2)).double() * scaling  # (heads, n, n)
    pattern = seen.rep.saved["patterns"][layer][0].double()
    _check_pattern(seen, layer, real, pattern, args, kwargs, query0[None])
    names = [[("bias", -1)] + [(p.name, p.node) for p in residual.names(pos)]
             for pos in range(len(residual.parts))]  # fmt: skip
    n_parts = torch.tensor([len(x) for x in names], device=k_parts.device)
    out = []
    for q in positions:
        top = torch.topk(pattern[:, q], min(keys, q + 1), dim=-1)  # (heads, K), largest first
        k_pos = top.indices  # (heads, K)
        nq = len(names[q])
        nk = int(n_parts[k_pos].max())
        q_vectors = q_parts[:nq, :, q]  # (nq, heads, d)
        every_head = torch.arange(heads, device=k_pos.device)[:, None]
        k_vectors = k_parts[:nk, every_head, k_pos]  # (nk, heads, K, d)
        valid = torch.arange(nk, device=k_pos.device) < n_parts[k_pos][..., None]  # (H, K, nk)
        k_vectors = k_vectors * valid.permute(2, 0, 1)[..., None]  # (a key's padding: zeros)
        table = PairCells(q_vectors, k_vectors, valid, scaling, rows, f"layer {layer}, query {q}")
        score = real[:, q].gather(1, k_pos)  # (heads, K)
        size = query0[:, q].norm(dim=-1)[:, None] * key0.norm(dim=-1).gather(1, k_pos)
        _check_cells(seen, layer, q, k_pos, table, score, size.double() * abs(scaling))
        kept = top.values > 0
        out += _pair_rows(layer, q, k_pos, kept, table, score, top.values, names, rows)
    return out


def _projected_parts(seen, layer, residual: _Residual):
    """Layer `layer`'s attention run on the real input and on each part of `residual` (through
    the attention norm frozen at the prompt's scale): the real input's query and key (heads, n,
    d_head; a grouped key repeated to every query head) and the parts' (parts + 1, heads, n,
    d_head) in float64, the norm's and projections' biases first (`bias`), then each part's.
    Each intermediate is let go as soon as the next is made: one layer's parts are its largest
    tensors (some 6,000 parts at SmolLM2's late layers, 15 positions: 0.4 GB a side)."""
    norm = seen.parts.attn_norms[layer]
    x, normed = seen.norm_io["attn_norm", layer]
    frozen = seen.frozen_norm("attn_norm", layer, norm)
    bias = seen.norm_bias("attn_norm", layer, norm).expand_as(x[:1]).to(x.dtype)
    parts = frozen(residual.tensor(x.shape[-1], x.dtype, x.device)).to(x.dtype)
    inputs = [torch.cat([normed[:1], bias, torch.zeros_like(bias)])]
    inputs += [parts[i : i + PARTS_PER_PASS] for i in range(0, parts.shape[0], PARTS_PER_PASS)]
    del parts
    got = _project(seen, layer, inputs)
    del inputs
    sides: list[tuple[torch.Tensor, torch.Tensor]] = []
    for batches in (got.query, got.key):
        whole = torch.cat(batches)  # (0: the real input, 1: bias + zeros' constant, 2: zeros)
        batches.clear()
        if len(sides) == 1:  # (the key: one per query head)
            whole = whole.repeat_interleave(sides[0][0].shape[0] // whole.shape[1], dim=1)
        each = torch.empty(whole.shape[0] - 2, *whole.shape[1:], dtype=torch.float64,
                           device=whole.device)  # fmt: skip
        each[0] = whole[1]
        torch.sub(whole[3:], whole[2:3], out=each[1:])  # (each part: its projection's linear map)
        sides.append((whole[0].clone(), each))
        del whole
    (query0, q_parts), (key0, k_parts) = sides
    return query0, key0, q_parts, k_parts


def _check_pattern(seen, layer, real, pattern, args, kwargs, query) -> None:
    """The scores of the real input give the pattern the model produced: softcap (where the
    family has one), the call's mask and a softmax."""
    attn = seen.parts.attns[layer]
    softcap = getattr(attn, "attn_logit_softcapping", None) or kwargs.get("softcap")
    scores = real if not softcap else softcap * torch.tanh(real / softcap)
    mask = kwargs.get("attention_mask")
    n = real.shape[-1]
    if isinstance(mask, torch.Tensor) and mask.dim() == 4:
        mask = mask[:1, :, :, :n]
    q1 = query[:1]
    additive = _additive(mask if isinstance(mask, torch.Tensor) else None, q1, q1, 1)
    got = torch.softmax(scores + additive[0].double(), dim=-1)
    largest, ok = mismatch(got, pattern)
    if not ok or not math.isfinite(largest):
        raise ConfigError(
            f"graphs: the scores of {seen.parts.name(attn)!r} read as scaled q . k do not give "
            f"the pattern it produced (off by up to {largest:.3g}); the QK attribution "
            "(graph.qk) cannot decompose this family's attention: leave graph.qk=0"
        )


def _check_cells(seen, layer, q, k_pos, table: PairCells, score, size) -> None:
    """Each pair's cells sum to its score, within the dtype's rounding of |cells| and of |q| |k|
    (`size`: the scale of a rounding of the query or the key)."""
    bound = _rtol(seen.norm_io["attn_norm", layer][0].dtype) * (size + table.abs_total)
    bad = ((table.total - score).abs() > bound + 1e-30).nonzero()
    if len(bad):
        h, i = (int(v) for v in bad[0])
        raise ModelError(
            f"graphs: the QK parts of layer {layer}, head {h}, query {q}, key {int(k_pos[h, i])} "
            f"sum to {float(table.total[h, i]):.6g}, its score is {float(score[h, i]):.6g}; a "
            "computation between the residual stream and the scores is not the one probe reads"
        )


def _rtol(dtype: torch.dtype) -> float:
    """The relative tolerance of a sum of parts against the whole, by the model's dtype."""
    # (float64: 1e-6, as a norm may compute in float32 whatever the model's dtype: Llama's)
    return {torch.float64: 1e-6, torch.float32: 1e-4}.get(dtype, 1e-2)


def _pair_rows(layer, q, k_pos, kept, table: PairCells, score, pattern, names, rows) -> list[tuple]:
    """The rows of query position `q`'s pairs (heads x K keys; `kept`: those the head attends
    to at all): per pair its cells, then the query-side marginals (key part `*`), then the
    key-side ones (query part `*`), each the `rows` largest by |contribution| and a `rest`."""
    nq, nk = table.nq, table.nk
    every = (ALL, -1)
    q_names = names[q]
    key_magnitude = table.key.abs().masked_fill(~table.valid, -1.0)
    picked = [
        (table.largest, "cell"),
        (largest(table.query, table.query.abs(), torch.full_like(table.counts, nq), rows), "query"),
        (largest(table.key, key_magnitude, table.counts, rows), "key"),
    ]
    out = []
    k_list, kept_list = k_pos.tolist(), kept.tolist()
    scores, probs = score.tolist(), pattern.tolist()
    for h, (k_h, kept_h) in enumerate(zip(k_list, kept_list, strict=True)):
        for i, k in enumerate(k_h):
            if not kept_h[i]:
                continue
            head = (layer, h, q, k)
            tail = (scores[h][i], probs[h][i])
            k_names = names[k]
            for block, kind in picked:
                for j, v in zip(block.index[h][i], block.value[h][i], strict=True):
                    if kind == "cell":
                        (qp, qn), (kp, kn) = q_names[j // nk], k_names[j % nk]
                    elif kind == "query":
                        (qp, qn), (kp, kn) = q_names[j], every
                    else:
                        (qp, qn), (kp, kn) = every, k_names[j]
                    out.append((*head, qn, kn, qp, kp, v, *tail))
                rest = block.rest[h][i]
                if rest is not None:
                    sides = {"cell": (REST, REST), "query": (REST, ALL), "key": (ALL, REST)}[kind]
                    out.append((*head, -1, -1, *sides, rest, *tail))
    return out
