"""Linear CKA between feature matrices streamed over row windows, never held whole.

CKA needs only the features' cross-products, which add up over row windows (shifted by fixed means,
the exact means removed at the end, so large means lose no precision). Features wider than a bound
are count-sketched, which keeps every sample; the self terms a sketch inflates are corrected with
the source features' exact sums of squares (the formulas: docs/analyses.md).
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

log = logging.getLogger("probe")
CKA_COLUMNS = ["layer_a", "site_a", "layer_b", "site_b", "cka", "samples", "features_a",
               "features_b", "method"]  # fmt: skip


def linear_cka(x: np.ndarray, y: np.ndarray) -> float:
    """In-memory linear CKA of two (n, features) arrays (rows are samples)."""
    x = np.asarray(x, np.float64).reshape(len(x), -1)
    y = np.asarray(y, np.float64).reshape(len(y), -1)
    x, y = x - x.mean(axis=0), y - y.mean(axis=0)
    denom = np.linalg.norm(x.T @ x) * np.linalg.norm(y.T @ y)
    return float(np.linalg.norm(y.T @ x) ** 2 / denom) if denom > 0 else float("nan")


def sketch_seed(seed: int, *names: str) -> int:
    """A stable seed for one feature matrix's sketch: different names give independent sketches."""
    digest = hashlib.sha256("\0".join([str(seed), *names]).encode()).digest()
    return int.from_bytes(digest[:8], "little")


class CountSketch:
    """x (rows, width_in) -> (rows, width_out): feature j added with sign s_j into bucket h_j."""

    def __init__(self, width_in: int, width_out: int, seed: int):
        rng = np.random.default_rng(seed)
        bucket = rng.integers(0, width_out, width_in)
        self.sign = rng.choice(np.array([-1.0, 1.0]), width_in)
        self.order = np.argsort(bucket, kind="stable")
        ordered = bucket[self.order]
        self.starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
        self.buckets = ordered[self.starts]
        self.width_out = width_out

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """x is float64 and is overwritten (multiplied by the signs), saving a copy."""
        x *= self.sign
        out = np.zeros((len(x), self.width_out))
        if len(x):
            out[:, self.buckets] = np.add.reduceat(x[:, self.order], self.starts, axis=1)
        return out


class SourceMoments:
    """Per-feature centred sums of squares of the rows a sketch sees (the A_jj of its self
    terms), accumulated with a shift for precision."""

    def __init__(self) -> None:
        self.n, self.shift, self.sum, self.sumsq = 0, None, 0.0, 0.0

    def update(self, x: np.ndarray) -> None:
        if not len(x):
            return
        if self.shift is None:
            self.shift = x.mean(axis=0)
        xc = x - self.shift
        self.n += len(x)
        self.sum = self.sum + xc.sum(axis=0)
        self.sumsq = self.sumsq + np.einsum("ij,ij->j", xc, xc)

    def terms(self) -> tuple[float, float]:
        """(tr A, sum_j A_jj^2) for A the centred X^T X of the rows seen."""
        if not self.n:
            return 0.0, 0.0
        diag = np.clip(self.sumsq - self.sum * self.sum / self.n, 0.0, None)
        return float(diag.sum()), float(np.sum(diag * diag))


@dataclass
class Features:
    """A feature matrix as the CKA passes see it: width, a shift near its column means and, when
    sketched, the self-term correction of its source features over `counted` rows."""

    key: Hashable
    width: int
    shift: np.ndarray
    sketched: bool = False
    source_width: int = 0
    trace: float = 0.0
    diag_sq: float = 0.0
    counted: int = 0


def cka_pairs(
    features: Sequence[Features],
    pairs: Sequence[tuple[int, int]],
    read: Callable[[int, int, int], np.ndarray],
    usable: np.ndarray,
    budget: int,
    window_rows: int | None = None,
) -> dict[tuple[int, int], float]:
    """CKA of each pair (i, j) of `features`, read as windows `read(i, lo, hi)` of rows
    [lo, hi), over the rows where `usable` is true. Cross-product accumulators are packed into
    passes of at most budget/2 bytes (a single pair wider than that takes a pass alone), each pass
    reading only the matrices it needs; the windows take up to budget/4 bytes."""
    rows, n = len(usable), int(np.sum(usable))
    needed = sorted({(min(i, j), max(i, j)) for i, j in pairs} | {(i, i) for p in pairs for i in p})
    passes: list[list[tuple[int, int]]] = []
    used = budget  # starts a new pass at the first pair
    for i, j in needed:
        cost = features[i].width * features[j].width * 8
        if used + cost > budget // 2:
            passes.append([])
            used = 0
        passes[-1].append((i, j))
        used += cost
    sums: dict[int, np.ndarray] = {}
    hsic: dict[tuple[int, int], float] = {}
    for group in passes:
        members = sorted({i for pair in group for i in pair})
        fresh = [i for i in members if i not in sums]
        part = {i: np.zeros(features[i].width) for i in fresh}
        acc = {(i, j): np.zeros((features[i].width, features[j].width)) for i, j in group}
        width = sum(features[i].width for i in members)
        step = window_rows or max(1, (budget // 4) // (12 * width))
        xs: dict[int, np.ndarray] = {}
        for lo in range(0, rows, step):
            hi = min(rows, lo + step)
            keep = usable[lo:hi]
            if not keep.any():
                continue
            xs.clear()  # the last window's arrays go before this one's are read
            xs.update({i: _centred(read(i, lo, hi), keep, features[i].shift) for i in members})
            for i in fresh:
                part[i] += xs[i].sum(axis=0)
            for (i, j), a in acc.items():
                for r in range(0, len(a), 256):  # a += x_i^T x_j with a small temporary
                    a[r : r + 256] += xs[i][:, r : r + 256].T @ xs[j]
        sums.update(part)
        for (i, j), a in acc.items():  # centre: a -= n m_i m_j^T, a block of rows at a time
            mi, mj = sums[i] / max(n, 1), sums[j] / max(n, 1)
            for lo in range(0, len(a), 256):
                a[lo : lo + 256] -= n * np.outer(mi[lo : lo + 256], mj)
            hsic[i, j] = float(np.vdot(a, a))
        del acc
    self_terms = {i: _self_term(features[i], hsic[i, i], n) for i, j in needed if i == j}
    out = {}
    for i, j in pairs:
        denom = math.sqrt(self_terms[i] * self_terms[j])
        if i == j:
            out[i, j] = 1.0 if denom > 0 else float("nan")
        elif denom > 0:
            out[i, j] = min(1.0, max(0.0, hsic[min(i, j), max(i, j)] / denom))
        else:
            out[i, j] = float("nan")
    return out


def _centred(x: np.ndarray, keep: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """The kept rows of x as float64 minus the shift, with one copy where all rows are kept."""
    out = x.astype(np.float64) if keep.all() else x[keep].astype(np.float64)
    out -= shift
    return out


def _self_term(f: Features, measured: float, n: int) -> float:
    """||A||_F^2 of the source features: as measured, or corrected for the sketch's inflation
    (bounded below by tr(A)^2 / source width, which every PSD A reaches)."""
    if not f.sketched:
        return measured
    if f.counted != n:
        log.warning(
            "%s: the sketch correction was collected over %d rows, CKA uses %d: approximate",
            f.key,
            f.counted,
            n,
        )
    k = f.width
    corrected = (measured - (f.trace**2 - 2 * f.diag_sq) / k) / (1 + 1 / k)
    return max(corrected, f.trace**2 / max(f.source_width, 1))


def heatmap(
    matrix: np.ndarray, rows: list[str], columns: list[str], title: str, path: Path
) -> bool:
    """Write a CKA heatmap (0..1) to path; False, with a log line, when matplotlib (the `plot`
    extra) is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib is not installed (pip install -e '.[plot]'): %s not drawn", path.name)
        return False
    height = min(40.0, 2.0 + 0.28 * len(rows))
    width = min(40.0, 3.0 + 0.28 * max(len(columns), 8))
    fig, ax = plt.subplots(figsize=(width, height))
    image = ax.imshow(matrix, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
    ax.set_xticks(np.arange(len(columns)), columns, rotation=70, ha="right", fontsize=6)
    ax.set_yticks(np.arange(len(rows)), rows, fontsize=6)
    if matrix.size <= 256:
        for (i, j), value in np.ndenumerate(matrix):
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=6, color="w")
    fig.colorbar(image, ax=ax, label="linear CKA")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# -- tables and figures of runs (`probe.analysis.streamed_analyses.RunColumns`) ------------------------------------


def _pairs_table(left, right, pairs, values, usable) -> list[dict]:
    rows = []
    for i, j in pairs:
        a, b = left[i], right[j]
        sketched = a.features.sketched or b.features.sketched
        rows.append(
            {
                "layer_a": a.layer,
                "site_a": a.site,
                "layer_b": b.layer,
                "site_b": b.site,
                "cka": values[i, j],
                "samples": int(usable.sum()),
                "features_a": a.width,
                "features_b": b.width,
                "method": "sketch" if sketched else "exact",
            }
        )
    return rows


def run_cka_table(rf) -> pd.DataFrame:
    """CKA of every pair of the run's (layer, site), i before j in the run's order."""
    usable = rf.usable
    pairs = [(i, j) for i in range(len(rf.items)) for j in range(i + 1, len(rf.items))]
    feats = [item.features for item in rf.items]
    values = cka_pairs(
        feats,
        pairs,
        lambda i, lo, hi: rf.read(rf.items[i], lo, hi),
        usable,
        rf.options.budget,
        rf.options.window_rows,
    )
    rows = _pairs_table(rf.items, rf.items, pairs, values, usable)
    return pd.DataFrame(rows, columns=["run", *CKA_COLUMNS]).assign(run=rf.name)


def cross_cka_table(a, b) -> pd.DataFrame | None:
    """CKA of each (layer, site) of run a with the same (layer, site) of run b, over the rows
    both hold for the same samples; None when their samples differ."""
    n = min(a.rows, b.rows)
    if a.index is not None and b.index is not None and not np.array_equal(a.index[:n], b.index[:n]):
        log.warning("%s and %s hold different samples: not compared", a.name, b.name)
        return None
    usable = a.usable[:n] & b.usable[:n]
    theirs = {(item.layer, item.site): j for j, item in enumerate(b.items)}
    common = [
        (i, theirs[it.layer, it.site])
        for i, it in enumerate(a.items)
        if (it.layer, it.site) in theirs
    ]
    k = len(a.items)
    feats = [item.features for item in a.items] + [item.features for item in b.items]

    def read(i, lo, hi):
        return a.read(a.items[i], lo, hi) if i < k else b.read(b.items[i - k], lo, hi)

    values = cka_pairs(
        feats,
        [(i, k + j) for i, j in common],
        read,
        usable,
        a.options.budget,
        a.options.window_rows,
    )
    values = {(i, j): values[i, k + j] for i, j in common}
    rows = _pairs_table(a.items, b.items, common, values, usable)
    table = pd.DataFrame(rows, columns=CKA_COLUMNS)
    table.insert(0, "run_b", b.name)
    table.insert(0, "run_a", a.name)
    return table


def _label(layer: str, site: str) -> str:
    return layer if site == "output" else f"{layer} [{site}]"


def draw_run(table: pd.DataFrame, rf, path: Path) -> bool:
    names = [_label(it.layer, it.site) for it in rf.items]
    matrix = np.eye(len(names))
    where = {(it.layer, it.site): i for i, it in enumerate(rf.items)}
    for row in table.itertuples():
        i, j = where[row.layer_a, row.site_a], where[row.layer_b, row.site_b]
        matrix[i, j] = matrix[j, i] = row.cka
    return heatmap(matrix, names, names, f"linear CKA between layers of {rf.path}", path)


def draw_sweep(table: pd.DataFrame, path: Path) -> bool:
    keys = list(dict.fromkeys(zip(table.layer_a, table.site_a, strict=True)))
    columns = list(dict.fromkeys(zip(table.run_a, table.run_b, strict=True)))
    matrix = np.full((len(keys), len(columns)), np.nan)
    for row in table.itertuples():
        matrix[keys.index((row.layer_a, row.site_a)), columns.index((row.run_a, row.run_b))] = (
            row.cka
        )
    labels = [f"{a} vs {b}" for a, b in columns]
    return heatmap(matrix, [_label(*k) for k in keys], labels, "linear CKA across runs", path)
