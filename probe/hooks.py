"""Register every probe hook in one context manager and collect what one batch produces.

Forward values are copied inside the hook (a later in-place op cannot change them). Gradients are
taken with respect to the autograd edge each tensor had when the hook saw it, so an in-place op
after the module (resnet's ReLU(inplace=True) after bn1, `out += identity` after bn2) does not move
the gradient onto the wrong tensor, and the user's model is never modified.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from probe.errors import ModelError
from probe.select import Selection

DTYPES = {"float32": torch.float32, "float16": torch.float16}


def flatten(value: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) pairs of a nested output: '' for a tensor, '.0', '.logits', '.0.aux' below it."""
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from flatten(v, f"{prefix}.{k}")
    elif isinstance(value, tuple) and hasattr(value, "_fields"):
        for k in value._fields:
            yield from flatten(getattr(value, k), f"{prefix}.{k}")
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            yield from flatten(v, f"{prefix}.{i}")
    elif hasattr(value, "__dataclass_fields__"):
        for k in value.__dataclass_fields__:
            yield from flatten(getattr(value, k), f"{prefix}.{k}")


def dataset_name(site: str, path: str, call: int) -> str:
    """Stable name of one captured tensor: `output`, `output.1` (tuple item), `output@1` (2nd call)."""
    return f"{site}{path}{'' if call == 0 else f'@{call}'}"


@dataclass
class PendingGrad:
    key: tuple[str, str]
    edge: GradientEdge
    shape: torch.Size
    selection: Selection


@dataclass
class BatchCapture:
    """What one batch produced: per-sample tensors by (layer, dataset) and per-batch parameter grads."""

    size: int
    values: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)
    pending: list[PendingGrad] = field(default_factory=list)


class Capture:
    """Context manager: all hooks on entry (all or none), every hook removed on any exit."""

    def __init__(self, selections: list[Selection]):
        self.selections = selections
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        self.batch: BatchCapture | None = None
        self.in_calls: Counter[str] = Counter()
        self.out_calls: Counter[str] = Counter()

    def __enter__(self) -> Capture:
        try:
            for sel in self.selections:
                if {"input", "grad_input"} & set(sel.sites):
                    self.handles.append(sel.module.register_forward_pre_hook(self._pre_hook(sel)))
                if {"output", "grad_output"} & set(sel.sites):
                    self.handles.append(sel.module.register_forward_hook(self._post_hook(sel)))
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def remove(self) -> None:
        while self.handles:
            self.handles.pop().remove()
        self.batch = None

    def begin(self, size: int) -> BatchCapture:
        self.batch = BatchCapture(size)
        self.in_calls.clear()
        self.out_calls.clear()
        return self.batch

    def _pre_hook(self, sel: Selection):
        def hook(module, args):
            call = self.in_calls[sel.name]
            self.in_calls[sel.name] += 1
            value = args[0] if len(args) == 1 else tuple(args)
            if not args:
                raise ModelError(
                    f"layer {sel.name!r} was called with no positional input, so it has no "
                    "'input'/'grad_input' to capture; capture 'output' instead or exclude it"
                )
            self._take(sel, value, call, "input", "grad_input")

        return hook

    def _post_hook(self, sel: Selection):
        def hook(module, args, output):
            call = self.out_calls[sel.name]
            self.out_calls[sel.name] += 1
            self._take(sel, output, call, "output", "grad_output")

        return hook

    def _take(self, sel: Selection, value: Any, call: int, site: str, grad_site: str) -> None:
        batch = self.batch
        if batch is None:  # a forward outside a probed batch (e.g. the user's own call): ignore
            return
        for path, t in flatten(value):
            if site in sel.sites:
                key = (sel.name, dataset_name(site, path, call))
                batch.values[key] = keep(t, sel, batch.size, key)
            if grad_site in sel.sites and t.requires_grad:
                key = (sel.name, dataset_name(grad_site, path, call))
                check_batch_axis(t, batch.size, key)
                batch.pending.append(PendingGrad(key, get_gradient_edge(t), t.shape, sel))


def check_batch_axis(t: torch.Tensor, size: int, key: tuple[str, str]) -> None:
    if t.ndim == 0 or t.shape[0] != size:
        raise ModelError(
            f"layer {key[0]!r} {key[1]} has shape {tuple(t.shape)}, whose first axis is not the batch "
            f"of {size}; exclude this layer from the probe (exclude: [{key[0]!r}])"
        )


def keep(t: torch.Tensor, sel: Selection, size: int, key: tuple[str, str]) -> torch.Tensor:
    """A private copy of `t` after the probe's reduction, in its storage dtype, on its device
    (probe.device.to_host moves GPU copies to the host without stalling the GPU)."""
    check_batch_axis(t, size, key)
    x = t.detach()
    reduced = sel.reduce == "spatial_mean" and x.ndim >= 3
    if reduced:
        x = x.float().mean(dim=tuple(range(2, x.ndim)))
    dtype = DTYPES[sel.dtype] if x.is_floating_point() else x.dtype
    return x.to(dtype=dtype, copy=not reduced)


def resolve_grads(batch: BatchCapture, loss: torch.Tensor, selections: list[Selection]) -> dict:
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
    for pg in batch.pending:
        ident = (id(pg.edge.node), pg.edge.output_nr)
        if ident not in index:
            index[ident] = len(edges)
            edges.append(pg.edge)
        slots.append(index[ident])
    inputs = edges + [p for _, _, p in params]
    if not inputs:
        return {}
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    for pg, slot in zip(batch.pending, slots, strict=True):
        g = grads[slot]
        if g is None:
            g = torch.zeros(pg.shape)
        batch.values[pg.key] = keep(g, pg.selection, batch.size, pg.key)
    param_grads = {}
    for (sel, pname, p), g in zip(params, grads[len(edges) :], strict=True):
        g = torch.zeros_like(p) if g is None else g.detach()
        param_grads[(sel.name, f"param_grad.{pname}")] = g.to(torch.float32, copy=True)[None]
    batch.pending.clear()
    return param_grads
