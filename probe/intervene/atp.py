"""Attribution patching: every cell of a patching grid from two forwards and one backward per
batch, against one patched forward per cell for the exact grid.

delta(cell) = sum over the cell's region of (source - target) x dMetric/d(site), the gradient
taken on the target run (Nanda; Kramar et al. 2024, AtP); the cell's value is the target's metric
plus delta, in the exact grid's sign convention. It is exact on a model linear in the site and
misses where attention saturates: atp_star recomputes the softmax exactly for query and key
cells and linearises only through the attention probabilities (probe.intervene.attention).
With exact and atp in one run, patching_agreement.csv says how far they agree.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch
from torch.autograd.graph import get_gradient_edge

from probe.errors import ConfigError
from probe.hooks import device as devices
from probe.hooks.forward import call, first_output
from probe.hooks.hookset import HookSet
from probe.intervene.metrics import at_position, value


class Edges:
    """Hooks that keep, during one forward with gradients, each grid site's value and its
    autograd edge (an input site's own use: the module gets a copy). A context manager: hung on
    entry, all or none, removed on any exit."""

    def __init__(self, grid):
        self.grid, self.values, self.edges = grid, {}, {}
        self.hooks = HookSet(f"{grid.label} atp")
        self.called: set[str] = set()

    def __enter__(self) -> Edges:
        self.hooks.enter(self._hang)
        return self

    def _hang(self) -> None:
        for name, module in self.grid.modules:
            if self.grid.site == "output":
                self.hooks.forward(module, self._output(name), name=name)
            else:
                self.hooks.forward_pre(module, self._input(name), name=name)

    def __exit__(self, *exc) -> None:
        self.hooks.__exit__(*exc)

    def _keep(self, name: str, x: torch.Tensor) -> None:
        self.called.add(name)
        if name not in self.values and x.requires_grad:
            self.values[name], self.edges[name] = x.detach(), get_gradient_edge(x)

    def _output(self, name: str):
        def hook(module, args, output):
            first = output if isinstance(output, torch.Tensor) else output[0]
            self._keep(name, first)

        return hook

    def _input(self, name: str):
        def hook(module, args):
            if not args or not isinstance(args[0], torch.Tensor) or not args[0].requires_grad:
                raise ConfigError(
                    f"{self.grid.label}: method atp needs the gradient of {name!r}'s input, which "
                    "has none (the module's input does not depend on anything trained); use "
                    "method exact, or site: output"
                )
            own = args[0].clone()  # its own use, not every use of the tensor
            self._keep(name, own)
            return (own, *args[1:])

        return hook


def linearised(grid, model, inputs, tokens, side, metrics, position, device, precision) -> dict:
    """{patching/<metric>_atp and _atp_star: (N, cells)} of one batch: the target's metric plus
    each cell's delta (atp_star differs from atp only where cells read queries or keys)."""
    if grid.attention is not None:
        return _attention_cells(
            grid, model, inputs, tokens, side, metrics, position, device, precision
        )
    edges = Edges(grid)
    with edges, torch.enable_grad(), devices.autocast(device, precision):
        out = call(model, inputs)
        logits = at_position(first_output(out), tokens, position)
    missing = [n for n in edges.called if n not in edges.edges]
    if missing:
        raise ConfigError(
            f"{grid.label}: method atp needs gradients at {missing[0]!r}, whose {grid.site} has "
            "none; use method exact"
        )
    names = [n for n, _ in grid.modules if n in edges.edges]  # (one never called: no effect)
    rows = {}
    reference = logits.detach()
    for metric in metrics:
        scores = value(metric, logits, reference, side)
        grads = torch.autograd.grad(
            scores.sum(), [edges.edges[n] for n in names], retain_graph=True, allow_unused=True
        )
        products = {}
        for name, g in zip(names, grads, strict=True):
            target = edges.values[name]
            source = grid.source_of(name, target).to(device=target.device, dtype=torch.float64)
            g = torch.zeros_like(target) if g is None else g
            products[name] = (source - target.double()) * g.double()
        zero = torch.zeros(len(scores), dtype=torch.float64, device=scores.device)
        deltas = [
            _summed(products[c.layer], grid.region(c), tokens) if c.layer in products else zero
            for c in grid.cells
        ]
        cells = scores.detach()[:, None] + torch.stack(deltas, 1).to(scores.device)
        rows[f"patching/{metric}_atp"] = rows[f"patching/{metric}_atp_star"] = cells.cpu()
    return rows


def _attention_cells(grid, model, inputs, tokens, side, metrics, position, device, precision):
    """Query or key cells: atp through the query or key, atp_star through the probabilities."""
    sites = grid.attention
    sites.kept, sites.mode = {}, "grad"
    try:
        with torch.enable_grad(), devices.autocast(device, precision):
            logits = at_position(first_output(call(model, inputs)), tokens, position)
    finally:
        sites.mode = None
    names = [n for n, _ in grid.modules]
    rows = {}
    for metric in metrics:
        scores = value(metric, logits, logits.detach(), side)
        wanted = [sites.kept[n][k] for n in names for k in (sites.kind, "weights")]
        grads = torch.autograd.grad(scores.sum(), wanted, retain_graph=True, allow_unused=True)
        by_layer = {}
        for i, n in enumerate(names):
            g = [grads[2 * i], grads[2 * i + 1]]
            g = [
                torch.zeros_like(w) if x is None else x
                for x, w in zip(g, wanted[2 * i : 2 * i + 2], strict=True)
            ]
            by_layer[n] = {sites.kind: g[0], "weights": g[1]}
        for method, star in (("atp", False), ("atp_star", True)):
            deltas = {}
            for n in names:
                cells = [c for c in grid.cells if c.layer == n]
                for c, d in zip(cells, sites.deltas(n, cells, by_layer[n], star), strict=True):
                    deltas[c] = d
            stacked = torch.stack([deltas[c].to(scores.device) for c in grid.cells], 1)
            rows[f"patching/{metric}_{method}"] = (scores.detach()[:, None] + stacked).cpu()
    return rows


def _summed(product: torch.Tensor, region, tokens) -> torch.Tensor:
    """Each sample's sum of `product` over the region (all of it where the region is None)."""
    mask = region.mask(product, tokens)
    picked = product if mask is None else product * mask
    return picked.reshape(len(picked), -1).sum(1)


def agreement(table: pd.DataFrame) -> pd.DataFrame | None:
    """patching_agreement.csv: per metric, layer type and approximate method, the Spearman
    correlation of its cells' values with the exact grid's and the share of the exact top 10
    cells (by |value - target|) among its own top 10."""
    if "exact" not in set(table.method):
        return None
    rows = []
    exact = table[table.method == "exact"]
    for method in sorted(set(table.method) - {"exact"}):
        other = table[table.method == method]
        for (metric, kind), part in exact.groupby(["metric", "layer_type"], sort=False):
            mine = other[(other.metric == metric) & (other.layer_type == kind)]
            a = (part.value - part.target).to_numpy()
            b = (mine.value - mine.target).to_numpy()
            if len(a) != len(b) or not len(a):
                continue
            top = min(10, len(a))
            recall = len(set(np.argsort(-np.abs(a))[:top]) & set(np.argsort(-np.abs(b))[:top]))
            rows.append(
                {"metric": metric, "layer_type": kind, "method": method, "cells": len(a),
                 "spearman": _spearman(a, b), "top10_recall": recall / top}
            )  # fmt: skip
    return pd.DataFrame(rows)


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    ra, rb = (pd.Series(x).rank().to_numpy() for x in (a, b))
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])
