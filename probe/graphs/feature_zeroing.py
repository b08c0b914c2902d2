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
distance from the live model, what freezing attention and norms does.

Both take per-layer transcoder sets (a cross-layer transcoder's feature writes to several
layers; refused by graph_claims).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from probe.errors import ModelError
from probe.graphs.replacement import LocalReplacement, Parts, replacement_parts
from probe.hooks.hookset import HookSet
from probe.models.transcoder import Transcoder, TranscoderSet, normalized

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


def _writes(t: Transcoder, amount: torch.Tensor, feature: torch.Tensor, like: torch.Tensor):
    """(batch, k, d_out): amount (batch, k) x each feature's decoder row, in `like`'s dtype."""
    return (amount[..., None] * t.W_dec[feature]).to(device=like.device, dtype=like.dtype)


def _tensor_output(out, where: str) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise ModelError(
            f"graph claims: {where} returns a {type(out).__name__}, not a tensor, so a feature's "
            "write cannot be subtracted from it"
        )
    return out


def write_module(parts: Parts, transcoders: TranscoderSet, layer: int) -> nn.Module:
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
    transcoders: TranscoderSet,
    zeroed: Sequence[Place] = (),
    *,
    overrides: dict | None = None,
) -> torch.Tensor:
    """The last position's logits (vocab,) of `model` on `tokens` (1-D ids) with the features at
    `zeroed` zeroed in the live model (the module docstring); none zeroed: the clean forward."""
    parts = replacement_parts(model, overrides)
    device = next(model.parameters()).device
    kept: dict[int, torch.Tensor] = {}
    hooks = HookSet("graph claims: live zeroing")
    with hooks:
        for layer, (pos, feature) in _by_layer(zeroed, device).items():
            t = transcoders[layer]
            module, reads = _reader(parts, transcoders.reads, layer)

            def keep(_m, args, layer=layer, reads=reads):
                kept[layer] = reads(args[0])

            def subtract(m, _args, out, layer=layer, t=t, pos=pos, feature=feature):
                out = _tensor_output(out, parts.name(m))
                act = _pick(t.encode(kept.pop(layer)[:, pos]), feature)
                return out.index_add(1, pos, -_writes(t, act, feature, out))

            hooks.forward_pre(module, keep, name=f"transcoder {layer} input")
            hooks.forward(write_module(parts, transcoders, layer), subtract,
                          name=f"mlp write {layer}")  # fmt: skip
        return _last_logits(model(tokens[None].to(device)))


@torch.no_grad()
def frozen_logits(
    model: nn.Module,
    tokens: torch.Tensor,
    transcoders: TranscoderSet,
    nodes: Sequence[Place],
    zeroings: Sequence[Sequence[Place]],
    *,
    mlps: str = "linear",
    overrides: dict | None = None,
) -> list[torch.Tensor]:
    """The last position's logits (vocab,) of the graph's linear model on `tokens` (the module
    docstring), whose feature nodes are `nodes`: first with nothing zeroed, then one per set of
    `zeroings` (each a subset of `nodes`) with its features zeroed. One record forward serves
    them all. `mlps="live"`: attention and norms frozen, the MLPs live (the module docstring)."""
    if mlps not in MLPS:
        raise ModelError(f"graph claims: mlps={mlps!r}; choose from {', '.join(MLPS)}")
    known = set(map(tuple, nodes))
    missing = sorted({tuple(p) for zeroed in zeroings for p in zeroed} - known)
    if missing:
        raise ModelError(f"graph claims: zeroed features {missing[:4]} are not graph nodes")
    device = next(model.parameters()).device
    ids = tokens[None].to(device)
    rep = LocalReplacement(model, transcoders, overrides, mode="record")
    with rep:
        model(ids)
    rep.mode = "replay"
    out = []
    for removed in [(), *zeroings]:
        gone = set(map(tuple, removed))
        # (rep's hooks come first: they fill captured.inputs and freeze the write)
        with rep, HookSet("graph claims: frozen zeroing") as hooks:
            if mlps == "linear":
                for layer, (pos, feature) in _by_layer(nodes, device).items():
                    places = zip(pos.tolist(), feature.tolist(), strict=True)
                    zero = torch.tensor([(layer, p, f) in gone for p, f in places],
                                        dtype=torch.bool, device=device)  # fmt: skip
                    write = _linear_features(rep, transcoders[layer], layer, pos, feature, zero)
                    hooks.forward(rep.mlp_writes[layer], write, name=f"mlp write {layer}")
            else:
                chosen = _by_layer(removed, device)
                none = torch.zeros(0, dtype=torch.long, device=device)
                for layer, module in enumerate(rep.mlp_writes):
                    pos, feature = chosen.get(layer, (none, none))
                    write = _live_mlp(rep, transcoders[layer], layer, pos, feature)
                    hooks.forward(module, write, name=f"mlp write {layer}")
            out.append(_last_logits(model(ids)))
    return out


def _linear_features(rep, t: Transcoder, layer: int, pos, feature, zero):
    """The replayed MLP write of block `layer` plus each feature node's move: (pre-activation
    now - on the prompt) x its decoder row, or minus its prompt write where `zero`."""

    def hook(_m, _args, out):
        now, then = rep.captured.inputs[layer], rep.saved["inputs"][layer]
        moved = _pick(t.pre_activations(now[:, pos]), feature)
        moved = moved - _pick(t.pre_activations(then[:, pos]), feature)
        act = _pick(t.encode(then[:, pos]), feature)
        amount = torch.where(zero, -act, moved)
        return out.index_add(1, pos, _writes(t, amount, feature, out))

    return hook


def _live_mlp(rep, t: Transcoder, layer: int, pos, feature):
    """The MLP's own output in this forward (not the replay's frozen one) minus each feature's
    write at (pos, feature), its activation read from the transcoder's input in this forward."""

    def hook(_m, _args, out):
        real = rep.captured.mlp_values[layer].to(out.dtype)
        act = _pick(t.encode(rep.captured.inputs[layer][:, pos]), feature)
        return real.index_add(1, pos, -_writes(t, act, feature, real))

    return hook


def _last_logits(out) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out[0] if isinstance(out, tuple) else out
    return logits[0, -1]
