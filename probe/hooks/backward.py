"""The gradients a batch's hooks asked for, resolved in one backward: gradient sites
(grad_output, grad_input), the values attribution sites explain, and parameter gradients.

Each is taken with respect to the autograd edge its tensor had when the hook saw it (see
probe.hooks.capture), so an in-place op after the module cannot move it onto another tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.autograd.graph import GradientEdge

from probe.hooks.module_select import Selection
from probe.site_keys import SiteKey

DTYPES = {"float32": torch.float32, "float16": torch.float16}


@dataclass
class PendingGrad:
    key: tuple[str, str]
    edge: GradientEdge
    shape: torch.Size
    selection: Selection


@dataclass
class Attributed:
    """A value an attribution site explains: the activation as the module gave it (copied before
    any later in-place op), its gradient edge (None: integrated gradients compute their own),
    and, once the backward ran, its gradient."""

    layer: str
    key: SiteKey  # its dataset's site (output, output.0, input@1, ...)
    value: torch.Tensor
    edge: GradientEdge | None
    selection: Selection
    sites: tuple[str, ...]  # the attribution sites asked of it
    grad: torch.Tensor | None = None


def resolve_grads(batch, loss: torch.Tensor, selections: list[Selection]) -> dict:
    """Fill batch.values with grad_output/grad_input per sample; return per-batch parameter grads."""
    params = [
        (sel, pname, p)
        for sel in selections
        if "param_grad" in sel.sites
        for pname, p in sel.module.named_parameters()
        if p.requires_grad
    ]
    edges: list[GradientEdge] = []
    index: dict[tuple[int, int], int] = {}
    slots = []
    explained = [a for a in batch.attributed if a.edge is not None]
    for edge in [pg.edge for pg in batch.pending] + [a.edge for a in explained]:
        ident = (id(edge.node), edge.output_nr)
        if ident not in index:
            index[ident] = len(edges)
            edges.append(edge)
        slots.append(index[ident])
    inputs = edges + [p for _, _, p in params]
    if not inputs:
        return {}
    grads: Sequence[torch.Tensor | None]  # (None: an input the objective does not reach)
    if loss.requires_grad:
        # torch's stub takes a list of tensors or one of edges; autograd.grad takes them mixed
        grads = torch.autograd.grad(loss, inputs, allow_unused=True)  # type: ignore[arg-type]
    else:  # every path to the objective was cut (e.g. a zeroed layer): all gradients are zero
        grads = (None,) * len(inputs)
    for a, slot in zip(explained, slots[len(batch.pending) :], strict=True):
        a.grad = grads[slot] if grads[slot] is not None else torch.zeros_like(a.value)
    for pg, slot in zip(batch.pending, slots, strict=False):
        key, change = pg.key, batch.edited.get(pg.key)
        if change is not None:  # a gradient edit acted: the gradient after it (and before it)
            before, after = change
            batch.take(key, after, pg.selection)
            if pg.selection.unedited:
                batch.take((key[0], str(SiteKey.parse(key[1]).unedited())), before, pg.selection)
            continue
        g = grads[slot]
        batch.take(key, torch.zeros(pg.shape) if g is None else g, pg.selection)
    param_grads = {}
    for (sel, pname, p), g in zip(params, grads[len(edges) :], strict=True):
        g = torch.zeros_like(p) if g is None else g.detach()
        row = g.to(DTYPES[sel.dtype], copy=True)[None]  # one row per batch, on the model's device
        param_grads[(sel.name, f"param_grad.{pname}")] = row
    batch.pending.clear()
    return param_grads
