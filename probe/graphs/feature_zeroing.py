"""Forwards of a graph's prompt with chosen transcoder features zeroed: where the graph's claim
about those features is put to the test (probe.graphs.graph_claims reads them).

`live_logits`: the model itself. Each zeroed feature's write, activation x decoder row, is
subtracted from its block's MLP write at its position, the activation read from what the
transcoder reads in this same forward (so a feature downstream of another zeroed one loses
what it has by then). The MLP's own output is kept, so the transcoder's error stays, and
everything else (attention patterns, norm scales, the other features, the later MLPs) is live.
A run's feature edit (`site: feature`, `op: zero`: probe.intervene.feature_edit) does the same
to one feature.

`frozen_logits`: the graph's own linear model. Attention patterns, norm scales and every MLP
write are frozen at their values on the prompt (LocalReplacement's record and replay), except
that each of the graph's feature nodes moves its write by (its pre-activation now minus on the
prompt) x its decoder row, as the graph takes an active feature (an active ReLU, JumpReLU or
TopK feature's activation moves with its pre-activation), and a zeroed feature's write is
removed whole. Skip paths stay live, as in the graph; features that are not nodes (inactive,
at position 0, or left out by `max_feature_nodes`) and the errors are constants. That model is
linear, so a zeroing moves the answer by exactly what the adjacency predicts through every path
(graph_claims.total_change): it is the proof that the prediction is computed right, and the
live model's distance from it is the graph's error.

`frozen_logits(..., mlps="live")` splits that distance in two: attention patterns and norm
scales frozen as in the graph, but every MLP write is the MLP's own output in this forward
(features switch on and off, the errors move), with each zeroed feature's write removed as in
the live model. Its distance from the linear model is what the MLPs' nonlinearity costs; its
distance from the live model, what freezing attention and norms does. `freeze` splits that
second part again: `freeze=("patterns",)` holds the attention patterns alone (every norm's
scale live), `freeze=("norms",)` the norms' scales alone (the patterns made from this forward's
queries and keys); with the MLPs live and nothing frozen (`freeze=()`) it is the live model.

Both take a per-layer transcoder set or a cross-layer transcoder (CLT). A CLT's feature read at
layer l writes into the MLP output of every layer l' >= l (its decoder's slot l' - l), so each of
its moves and removals above is made at all those layers, with the one activation read at layer
l (`Dictionary` holds the difference).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from probe.errors import ModelError
from probe.graphs.replacement import FREEZABLE, LocalReplacement, Parts, replacement_parts
from probe.hooks.hookset import HookSet
from probe.models.cross_layer_transcoder import AnyTranscoders, CrossLayerTranscoder
from probe.models.transcoder import normalized

MLPS = ("linear", "live")  # frozen_logits' MLPs: the graph's linear features, or the MLPs' own
# a feature node's place: (layer, position, feature index in its layer's transcoder)
Place = tuple[int, int, int]


def _by_layer(places: Sequence[Place], device) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """{layer: (positions, features)} of `places`, as index tensors on `device`."""
    grouped: dict[int, list[tuple[int, int]]] = {}
    for layer, pos, feature in places:
        grouped.setdefault(int(layer), []).append((int(pos), int(feature)))
    return {
        layer: tuple(torch.tensor(column, device=device) for column in zip(*pairs, strict=True))  # type: ignore[misc]
        for layer, pairs in sorted(grouped.items())
    }


def _pick(rows: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
    """(batch, k): of rows (batch, k, d_tc), row j's entry feature[j]."""
    return rows.gather(-1, feature[None, :, None].expand(rows.shape[0], -1, 1))[..., 0]


class Dictionary:
    """A per-layer TranscoderSet or a CrossLayerTranscoder seen the one way the zeroings need:
    the layers a layer's features write to, their pre-activations and activations at one layer,
    and their decoder rows into one layer."""

    def __init__(self, transcoders: AnyTranscoders) -> None:
        self.transcoders = transcoders
        self.cross_layer = isinstance(transcoders, CrossLayerTranscoder)
        self.reads = transcoders.reads
        self.n_layers = len(transcoders)

    def targets(self, layer: int) -> range:
        """The layers whose MLP output layer `layer`'s features write into: that layer (a
        per-layer set), or it and every later one (a CLT)."""
        return range(layer, self.n_layers if self.cross_layer else layer + 1)

    def sources(self, layer: int) -> range:
        """The layers whose features write into layer `layer`'s MLP output."""
        return range(0 if self.cross_layer else layer, layer + 1)

    def pre_activations(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        t = self.transcoders
        if isinstance(t, CrossLayerTranscoder):
            return t.pre_activations(layer, x)
        return t[layer].pre_activations(x)

    def encode(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        t = self.transcoders
        if isinstance(t, CrossLayerTranscoder):
            return t.encode(layer, x)
        return t[layer].encode(x)

    def writes(self, source: int, target: int, amount: torch.Tensor, feature: torch.Tensor,
               like: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """(batch, k, d_out): amount (batch, k) x each feature of layer `source`'s decoder row
        into layer `target`'s MLP output, in `like`'s dtype and device."""
        t = self.transcoders
        if isinstance(t, CrossLayerTranscoder):
            rows = t.W_dec[source][feature, target - source]
        else:
            rows = t[source].W_dec[feature]
        return (amount[..., None] * rows).to(device=like.device, dtype=like.dtype)


def _tensor_output(out, where: str) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise ModelError(
            f"graph claims: {where} returns a {type(out).__name__}, not a tensor, so a feature's "
            "write cannot be subtracted from it"
        )
    return out


def write_module(parts: Parts, transcoders: AnyTranscoders, layer: int) -> nn.Module:
    """The module whose output block `layer`'s transcoder predicts: the MLP module
    (writes=mlp_module_out), or the MLP's write to the residual (mlp_out: after a norm that
    follows the MLP, as LocalReplacement's)."""
    if transcoders.writes == "mlp_module_out":
        return parts.mlps[layer]
    return parts.mlp_writes[layer]


def _reader(parts: Parts, reads: str, layer: int):
    """(module, function of its input): where block `layer`'s transcoder reads, as the input of
    a module: the MLP's (mlp_in), the norm before it (resid_mid) or that norm's input normalised
    without its weight and bias (mlp_normalized)."""
    if reads == "mlp_in":
        return parts.mlps[layer], lambda x: x
    norm = parts.mlp_norms[layer]
    if reads == "resid_mid":
        return norm, lambda x: x
    return norm, lambda x: normalized(norm, x)


@torch.no_grad()
def live_logits(
    model: nn.Module,
    tokens: torch.Tensor,
    transcoders: AnyTranscoders,
    zeroed: Sequence[Place] = (),
    *,
    overrides: dict | None = None,
) -> torch.Tensor:
    """The last position's logits (vocab,) of `model` on `tokens` (1-D ids) with the features at
    `zeroed` zeroed in the live model (the module docstring); none zeroed: the clean forward. A
    CLT feature's write is subtracted at every layer it writes to, its activation read once,
    at its own layer."""
    parts = replacement_parts(model, overrides)
    device = next(model.parameters()).device
    book = Dictionary(transcoders)
    chosen = _by_layer(zeroed, device)
    kept: dict[int, torch.Tensor] = {}  # a source layer's transcoder input in this forward
    acts: dict[int, torch.Tensor] = {}  # its zeroed features' activations (batch, k)
    hooks = HookSet("graph claims: live zeroing")
    with hooks:
        for layer in chosen:
            module, reads = _reader(parts, book.reads, layer)

            def keep(_m, args, layer=layer, reads=reads):
                kept[layer] = reads(args[0])
                acts.pop(layer, None)

            hooks.forward_pre(module, keep, name=f"transcoder {layer} input")
        targets = sorted({t for layer in chosen for t in book.targets(layer)})
        for target in targets:
            sources = [s for s in book.sources(target) if s in chosen]

            def subtract(m, _args, out, target=target, sources=sources):
                out = _tensor_output(out, parts.name(m))
                for source in sources:
                    pos, feature = chosen[source]
                    if source not in acts:
                        acts[source] = _pick(book.encode(source, kept[source][:, pos]), feature)
                    out = out.index_add(
                        1, pos, -book.writes(source, target, acts[source], feature, out)
                    )
                return out

            hooks.forward(write_module(parts, transcoders, target), subtract,
                          name=f"mlp write {target}")  # fmt: skip
        return _last_logits(model(tokens[None].to(device)))


@torch.no_grad()
def frozen_logits(
    model: nn.Module,
    tokens: torch.Tensor,
    transcoders: AnyTranscoders,
    nodes: Sequence[Place],
    zeroings: Sequence[Sequence[Place]],
    *,
    mlps: str = "linear",
    freeze: Sequence[str] = FREEZABLE,
    overrides: dict | None = None,
) -> list[torch.Tensor]:
    """The last position's logits (vocab,) of the graph's linear model on `tokens` (the module
    docstring), whose feature nodes are `nodes`: first with nothing zeroed, then one per set of
    `zeroings` (each a subset of `nodes`) with its features zeroed. One record forward serves
    them all. `mlps="live"`: attention and norms frozen, the MLPs live; `freeze` (a subset of
    FREEZABLE: "patterns", "norms"; both by default, as the graph): what stays at the prompt's
    values, the rest running live (the module docstring)."""
    if mlps not in MLPS:
        raise ModelError(f"graph claims: mlps={mlps!r}; choose from {', '.join(MLPS)}")
    known = set(map(tuple, nodes))
    missing = sorted({tuple(p) for zeroed in zeroings for p in zeroed} - known)
    if missing:
        raise ModelError(f"graph claims: zeroed features {missing[:4]} are not graph nodes")
    device = next(model.parameters()).device
    ids = tokens[None].to(device)
    book = Dictionary(transcoders)
    node_places = _by_layer(nodes, device)
    rep = LocalReplacement(model, transcoders, overrides, mode="record", frozen=freeze)
    with rep:
        model(ids)
    rep.mode = "replay"
    out = []
    for removed in [(), *zeroings]:
        gone = set(map(tuple, removed))
        # a source layer's amounts (batch, k) once per forward, for every layer it writes to
        amounts: dict[int, torch.Tensor] = {}
        # (rep's hooks come first: they fill captured.inputs and freeze the write)
        with rep, HookSet("graph claims: frozen zeroing") as hooks:
            if mlps == "linear":
                zero = {
                    layer: torch.tensor(
                        [(layer, p, f) in gone for p, f in zip(pos.tolist(), feature.tolist(),
                                                               strict=True)],
                        dtype=torch.bool, device=device,
                    )
                    for layer, (pos, feature) in node_places.items()
                }  # fmt: skip
                for target, module in enumerate(rep.mlp_writes):
                    sources = [s for s in book.sources(target) if s in node_places]
                    if sources:
                        write = _linear_features(rep, book, target, sources, node_places, zero,
                                                 amounts)  # fmt: skip
                        hooks.forward(module, write, name=f"mlp write {target}")
            else:
                chosen = _by_layer(removed, device)
                for target, module in enumerate(rep.mlp_writes):
                    sources = [s for s in book.sources(target) if s in chosen]
                    write = _live_mlp(rep, book, target, sources, chosen, amounts)
                    hooks.forward(module, write, name=f"mlp write {target}")
            out.append(_last_logits(model(ids)))
    return out


def _linear_features(rep, book: Dictionary, target: int, sources, places, zero, amounts):
    """The replayed MLP write of block `target` plus the move of each feature node of the
    `sources` layers that write into it: (pre-activation now - on the prompt) x its decoder row
    into `target`, or minus its prompt write where `zero`; a source's amounts computed at the
    first layer it writes to and kept in `amounts`."""

    def hook(_m, _args, out):
        for source in sources:
            pos, feature = places[source]
            if source not in amounts:
                now, then = rep.captured.inputs[source], rep.saved["inputs"][source]
                moved = _pick(book.pre_activations(source, now[:, pos]), feature)
                moved = moved - _pick(book.pre_activations(source, then[:, pos]), feature)
                act = _pick(book.encode(source, then[:, pos]), feature)
                amounts[source] = torch.where(zero[source], -act, moved)
            out = out.index_add(1, pos, book.writes(source, target, amounts[source], feature, out))
        return out

    return hook


def _live_mlp(rep, book: Dictionary, target: int, sources, chosen, acts):
    """The MLP's own output in this forward (not the replay's frozen one) minus the write into
    it of each zeroed feature of the `sources` layers, its activation read from its layer's
    transcoder input in this forward (kept in `acts` for the later layers it writes to)."""

    def hook(_m, _args, out):
        real = rep.captured.mlp_values[target].to(out.dtype)
        for source in sources:
            pos, feature = chosen[source]
            if source not in acts:
                acts[source] = _pick(book.encode(source, rep.captured.inputs[source][:, pos]),
                                     feature)  # fmt: skip
            real = real.index_add(1, pos, -book.writes(source, target, acts[source], feature, real))
        return real

    return hook


def _last_logits(out) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out[0] if isinstance(out, tuple) else out
    return logits[0, -1]
