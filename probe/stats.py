"""Streaming per-dataset statistics with exact merges in float64 (Chan et al. for mean and variance).

Each batch is reduced in a few numpy passes over float64 blocks; batches, files and processes
merge with the same `merge`. Mean, std, min, max, abs_mean and rms are over the finite values; NaN and Inf are
counted apart. std is the population standard deviation (ddof=0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np
import torch

F64 = torch.float64


@dataclass
class RunningStats:
    rows: int = 0
    n: int = 0
    mean: float = 0.0
    m2: float = 0.0
    min: float = math.inf
    max: float = -math.inf
    abs_sum: float = 0.0
    zeros: int = 0
    nan_count: int = 0
    inf_count: int = 0
    l2_sum: float = 0.0  # sum over rows of each row's L2 norm (finite values)

    def update(self, x: torch.Tensor) -> None:
        """Fold in one batch (axis 0 = rows)."""
        self.merge(batch_stats(x))

    def merge(self, b: RunningStats) -> None:
        """Chan et al.: exact for count, mean and M2 in float64; the rest add or compare."""
        n = self.n + b.n
        if b.n:
            d = b.mean - self.mean
            self.mean += d * b.n / n
            self.m2 += b.m2 + d * d * self.n * b.n / n
            self.min, self.max = min(self.min, b.min), max(self.max, b.max)
        self.n = n
        self.rows += b.rows
        for name in ("abs_sum", "zeros", "nan_count", "inf_count", "l2_sum"):
            setattr(self, name, getattr(self, name) + getattr(b, name))

    def as_row(self) -> dict:
        n = self.n
        total = n + self.nan_count + self.inf_count
        return {
            "rows": self.rows,
            "n": n,
            "mean": self.mean if n else math.nan,
            "std": math.sqrt(max(self.m2, 0.0) / n) if n else math.nan,
            "min": self.min if n else math.nan,
            "max": self.max if n else math.nan,
            "abs_mean": self.abs_sum / n if n else math.nan,
            "rms": math.sqrt((self.m2 + n * self.mean**2) / n) if n else math.nan,
            "frac_zero": self.zeros / total if total else math.nan,
            "nan_count": self.nan_count,
            "inf_count": self.inf_count,
            "l2_mean": self.l2_sum / self.rows if self.rows else math.nan,
        }

    def state(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


BLOCK = 1 << 20  # elements per float64 block: few numpy calls (each one a GIL hand-off) per batch


def batch_stats(x: torch.Tensor) -> RunningStats:
    """Statistics of one batch, in single-threaded numpy over cache-sized float64 blocks.

    Squares of float32 values are exact in float64 and every sum accumulates in float64. M2 comes
    from the block's sum of squares unless that would cancel (|mean| >> std, e.g. 1000 +- 0.01), in
    which case the block is centred first. Batches holding NaN or Inf take the masked path."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        a = (x.float() if x.dtype == torch.bfloat16 else x).numpy()
    else:
        a = np.asarray(x)
    rows = a.shape[0] if a.ndim else 1
    s = RunningStats(rows=rows)
    if a.size == 0:
        return s
    a = a.reshape(rows, -1)
    row_sq = np.zeros(rows)
    width = min(a.size, BLOCK if a.shape[1] >= BLOCK else max(1, BLOCK // a.shape[1]) * a.shape[1])
    b, t = np.empty(width), np.empty(width)
    is_zero = np.empty(width, dtype=bool)
    for r0, r1, piece in _blocks(a):
        k, cols = piece.shape
        bb, tt = b[: piece.size].reshape(k, cols), t[: piece.size].reshape(k, cols)
        np.copyto(bb, piece)
        total = float(bb.sum())
        sq = np.einsum("ij,ij->i", bb, bb)  # no temporary, no BLAS threads
        row_sq[r0:r1] += sq
        mean = total / bb.size
        m2 = float(sq.sum()) - total * mean
        if not m2 > 1e-7 * float(sq.sum()):  # cancellation (or NaN): centre, then square
            bb -= mean
            m2 = float(np.vdot(bb, bb))
            np.copyto(bb, piece)
        s.merge(RunningStats(n=bb.size, mean=mean, m2=m2))
        s.abs_sum += float(np.abs(bb, out=tt).sum())
        s.zeros += int(
            np.count_nonzero(np.equal(piece, 0, out=is_zero[: piece.size].reshape(k, cols)))
        )
    if not math.isfinite(s.mean + s.m2 + s.abs_sum) and not np.isfinite(a).all():
        return _masked_batch_stats(a)
    s.rows = rows
    s.min, s.max = float(a.min()), float(a.max())
    s.l2_sum = float(np.sqrt(row_sq).sum())
    return s


def _blocks(a: np.ndarray):
    """(first row, end row, 2-D view) pieces of at most BLOCK elements: whole rows, or row segments."""
    rows, cols = a.shape
    if cols >= BLOCK:
        for r in range(rows):
            for lo in range(0, cols, BLOCK):
                yield r, r + 1, a[r : r + 1, lo : lo + BLOCK]
    else:
        step = max(1, BLOCK // cols)
        for lo in range(0, rows, step):
            yield lo, min(rows, lo + step), a[lo : lo + step]


def _masked_batch_stats(a: np.ndarray) -> RunningStats:
    """A batch holding NaN or Inf: statistics of its finite values, with the others counted."""
    finite = np.isfinite(a)
    s = batch_stats(a[finite].reshape(1, -1))
    s.rows = len(a)
    s.nan_count = int(np.isnan(a).sum())
    s.inf_count = int(a.size - finite.sum()) - s.nan_count
    clean = np.where(finite, a, 0).astype(np.float64)
    s.l2_sum = float(np.sqrt(np.einsum("ij,ij->i", clean, clean)).sum())
    return s
