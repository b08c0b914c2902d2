"""Streaming per-dataset statistics with exact merges in float64 (Chan et al. for mean and variance).

Each batch is reduced with a few vectorised torch passes; batches, files and processes merge with
the same `merge`. Mean, std, min, max, abs_mean and rms are over the finite values; NaN and Inf are
counted apart. std is the population standard deviation (ddof=0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

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


def batch_stats(x: torch.Tensor) -> RunningStats:
    """Statistics of one batch. The variance is taken about a float32 shift and corrected in float64,
    so data such as 1000 +- 0.01 keeps its variance."""
    rows = x.shape[0] if x.ndim else 1
    x = x.reshape(rows, -1)
    if not x.is_floating_point() or x.dtype in (torch.float16, torch.bfloat16):
        x = x.float()
    total = torch.sum(x, dtype=F64)
    nan_count = inf_count = 0
    if not torch.isfinite(total):
        finite = torch.isfinite(x)
        nan_count = int(torch.isnan(x).sum())
        inf_count = int(x.numel() - finite.sum()) - nan_count
        x_rows = torch.where(finite, x, 0.0)
        x = x[finite]
        total = torch.sum(x, dtype=F64)
    else:
        x_rows = x
    n = x.numel()
    s = RunningStats(rows=rows, n=n, nan_count=nan_count, inf_count=inf_count)
    if n == 0:
        return s
    mean = total.item() / n
    shift = torch.tensor(mean, dtype=x.dtype)
    d = x - shift
    s.mean = mean
    s.m2 = torch.sum(d * d, dtype=F64).item() - n * (mean - shift.double().item()) ** 2
    lo, hi = torch.aminmax(x)
    s.min, s.max = lo.item(), hi.item()
    s.abs_sum = torch.sum(x.abs(), dtype=F64).item()
    s.zeros = int((x == 0).sum())
    s.l2_sum = torch.linalg.vector_norm(x_rows, dim=1, dtype=F64).sum().item()
    return s
