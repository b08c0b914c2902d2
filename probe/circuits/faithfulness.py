"""How much of the model's behaviour a circuit keeps, as MIB measures it
(hannamw/MIB-circuit-track, `MIB_circuit_track/evaluation.py`, `evaluate_area_under_curve`).

A circuit's metric m(C) is the metric with every edge outside it ablated (probe.circuits.exact
.evaluate), averaged over the pairs. Its faithfulness is normalised between the empty circuit
(every edge ablated) and the full one (no edge ablated: the clean model):

    faithfulness(C) = (m(C) - m(empty)) / (m(full) - m(empty))

so the empty circuit scores 0 and the full one 1 by construction. Over the sizes (percent of the
edges) the curve gives MIB's two areas, trapezoids over x = size / 100 (a fraction of the edges,
linear, not log), from the smallest size to 100% (where faithfulness is 1), nothing clipped:

    CPR = sum over neighbours of (x2 - x1) (f1 + f2) / 2                (higher is better)
    CMD = sum over neighbours of (x2 - x1) (|1 - f1| + |1 - f2|) / 2    (lower is better)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from probe.circuits.cut import check_sizes, circuits, edge_counts, importance

FULL = 100.0


def faithfulness(values, full: float, empty: float) -> np.ndarray:
    """(m(C) - m(empty)) / (m(full) - m(empty)) per circuit; NaN where full equals empty."""
    values = np.asarray(values, dtype=np.float64)
    span = full - empty
    if span == 0:
        return np.full(values.shape, np.nan)
    return (values - empty) / span + 0.0  # (no -0.0)


def curve_points(sizes, faithful) -> tuple[np.ndarray, np.ndarray]:
    """The curve MIB integrates: x = size / 100 for each size, then 100% (faithfulness 1) unless
    the sizes end there; sizes ascending."""
    sizes = np.asarray(sizes, dtype=np.float64)
    faithful = np.asarray(faithful, dtype=np.float64)
    order = np.argsort(sizes, kind="stable")
    sizes, faithful = sizes[order], faithful[order]
    if not len(sizes) or sizes[-1] != FULL:
        sizes, faithful = np.append(sizes, FULL), np.append(faithful, 1.0)
    return sizes / 100, faithful


def areas(sizes, faithful) -> tuple[float, float]:
    """MIB's (CPR, CMD) of a faithfulness curve over `sizes` (percent): see the module."""
    x, f = curve_points(sizes, faithful)
    dx = np.diff(x)
    cpr = float(np.sum(dx * (f[:-1] + f[1:]) / 2))
    cmd = float(np.sum(dx * (np.abs(1 - f[:-1]) + np.abs(1 - f[1:])) / 2))
    return cpr, cmd


@dataclass(frozen=True)
class Curve:
    """One method's circuits and what they keep: per size (percent), the edges asked
    (int(size / 100 x edges)) and kept after pruning, and the circuit's mean metric; the full
    and empty circuits' metrics."""

    method: str
    sizes: tuple[float, ...]
    asked: tuple[int, ...]
    edges: tuple[int, ...]
    metric: tuple[float, ...]
    full: float
    empty: float

    @property
    def faithfulness(self) -> np.ndarray:
        return faithfulness(self.metric, self.full, self.empty)

    @property
    def areas(self) -> tuple[float, float]:
        """(CPR, CMD)."""
        return areas(self.sizes, self.faithfulness)


@dataclass(frozen=True)
class Plan:
    """The circuits to evaluate, each once: `keep` (circuits, E) bool, its first two rows the
    full and the empty circuit; `rows[method]` the row of each size's circuit."""

    methods: tuple[str, ...]
    sizes: tuple[float, ...]
    asked: tuple[int, ...]
    keep: np.ndarray
    rows: dict[str, np.ndarray]

    def curves(self, values) -> dict[str, Curve]:
        """Each method's Curve from the mean metric of every row of `keep`."""
        values = np.asarray(values, dtype=np.float64)
        return {
            m: Curve(
                m,
                self.sizes,
                self.asked,
                tuple(int(n) for n in self.keep[r].sum(1)),
                tuple(float(v) for v in values[r]),
                float(values[0]),
                float(values[1]),
            )
            for m, r in self.rows.items()
        }


def plan(graph, scores: dict[str, np.ndarray], sizes, how: str, absolute: bool, metric: str):
    """The circuits of every method's edge `scores` at `sizes` (percent), cut by `how` (topn,
    greedy) on absolute or signed scores for `metric` (probe.circuits.cut), each distinct
    circuit once, after the full and the empty one."""
    sizes = check_sizes(sizes)
    full, empty = np.ones(graph.n_edges, dtype=bool), np.zeros(graph.n_edges, dtype=bool)
    keep, seen, rows = [full, empty], {full.tobytes(): 0, empty.tobytes(): 1}, {}
    for method, edges in scores.items():
        cut = circuits(graph, importance(edges, metric, absolute), sizes, how)
        at = []
        for row in cut:
            k = row.tobytes()
            if k not in seen:
                seen[k] = len(keep)
                keep.append(row)
            at.append(seen[k])
        rows[method] = np.array(at, dtype=np.int64)
    asked = tuple(int(n) for n in edge_counts(sizes, graph.n_edges))
    return Plan(tuple(scores), sizes, asked, np.stack(keep), rows)
