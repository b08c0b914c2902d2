"""Streaming per-dataset statistics with exact merges in float64 (Chan et al. for mean and variance).

Each batch is reduced with a few vectorised torch passes; batches, files and processes merge with
the same `merge`. Mean, std, min, max, abs_mean and rms are over the finite values; NaN and Inf are
counted apart. std is the population standard deviation (ddof=0).

A batch is viewed as (rows, units, rest): units are axis 1 (channels of a conv output, features of a
linear one). Reductions run in the tensor's own dtype along the contiguous last axis (fast, vectorised)
over blocks short enough to stay accurate, and are combined in float64; when the data sit far from zero
the variance is taken about a shift near their mean, so data such as 1000 +- 0.01 keeps its variance.

Quantiles come from `LogHistogram`: fixed log-spaced buckets (the top 16 bits of each float32 value:
sign, exponent and 7 mantissa bits; 65536 int64 counts, 512 KiB per dataset in memory, stored
sparse), so histograms merge exactly by adding counts. A quantile is the
midpoint of the bucket holding the value of rank floor(q*(n-1)) (numpy's method="lower"), clipped to
[min, max]; its error is at most QUANTILE_REL_ERROR = 2**-8 (0.39%) of that value's magnitude
(at most 2**-133 in absolute terms for |values| below 2**-126, where float32 turns subnormal).

Per-unit statistics (one entry per unit of axis 1): finite count, sum, min, max, count above zero, and
for bounded activations the count of values within 1% of the range from a bound. A unit is *dead*
when no value of it was ever above zero; it is *saturated* when every value of it was within 1% of
the range from a bound of the module's output range (`SATURATING`, output sites only).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

import numpy as np
import torch

F64 = torch.float64
QUANTILE_REL_ERROR = 2.0**-8
QUANTILES = {"p01": 0.01, "p50": 0.5, "p99": 0.99}
# Output range of bounded activations (defaults of their torch constructors).
SATURATING = {
    "Sigmoid": (0.0, 1.0),
    "Hardsigmoid": (0.0, 1.0),
    "Tanh": (-1.0, 1.0),
    "Hardtanh": (-1.0, 1.0),
    "ReLU6": (0.0, 6.0),
}
SATURATION_TOL = 0.01  # a value is saturated within 1% of the range from a bound
SCALARS = (
    "rows", "n", "mean", "m2", "min", "max", "abs_sum", "zeros", "nan_count", "inf_count", "l2_sum",
)  # fmt: skip


# Buckets of exponent 255 (NaN and Inf of either sign), which never hold a finite value.
NONFINITE_BUCKETS = torch.cat([torch.arange(0x7F80, 0x8000), torch.arange(0xFF80, 0x10000)])


class LogHistogram:
    """Counts per float32 bucket of constant relative width (2**-7); merges by adding counts."""

    BINS = 1 << 16

    def __init__(self, counts: torch.Tensor | None = None):
        self.counts = counts if counts is not None else torch.zeros(self.BINS, dtype=torch.int64)

    def merge(self, other: LogHistogram) -> None:
        self.counts += other.counts

    def ordered(self) -> tuple[np.ndarray, np.ndarray]:
        """(bucket midpoints, counts) of the non-empty buckets in increasing value order."""
        counts = self.counts.numpy()
        order = np.concatenate(
            [np.arange(self.BINS - 1, self.BINS // 2 - 1, -1), np.arange(self.BINS // 2)]
        )
        keep = order[counts[order] > 0]
        return bucket_midpoints(keep), counts[keep]

    def quantiles(self, qs, lo: float, hi: float) -> list[float]:
        """Value of rank floor(q*(n-1)) for each q, within QUANTILE_REL_ERROR of the true one."""
        mids, counts = self.ordered()
        n = int(counts.sum())
        if n == 0:
            return [math.nan for _ in qs]
        cum = np.cumsum(counts)
        ranks = np.floor(np.asarray(qs, dtype=np.float64) * (n - 1)).astype(np.int64)
        picked = mids[np.searchsorted(cum, ranks, side="right")]
        return [float(v) for v in np.clip(picked, lo, hi)]

    def sparse(self) -> tuple[np.ndarray, np.ndarray]:
        idx = torch.nonzero(self.counts).flatten()
        return idx.numpy().astype(np.int32), self.counts[idx].numpy()

    @classmethod
    def from_sparse(cls, index: np.ndarray, count: np.ndarray) -> LogHistogram:
        h = cls()
        h.counts[torch.as_tensor(np.asarray(index, dtype=np.int64))] = torch.as_tensor(
            np.asarray(count, dtype=np.int64)
        )
        return h


def bucket_index(x: torch.Tensor) -> torch.Tensor:
    """Bucket of each value: the top half of its float32 bits (sign, exponent, 7 mantissa bits) as an
    unsigned number: positive values below 2**15, negative ones from 2**15 up."""
    x = x.detach().reshape(-1)
    if x.dtype != torch.float32:
        x = x.float()
    x = x.contiguous()
    high = 1 if sys.byteorder == "little" else 0
    return x.view(torch.uint16)[high::2].to(torch.int32)  # the high 16 bits of each value


def bucket_midpoints(index: np.ndarray) -> np.ndarray:
    """The midpoint of each bucket; the bucket of +-0 (and |x| < 2**-133) is represented by 0."""
    index = np.asarray(index, dtype=np.int64)
    negative = index >= (1 << 15)
    magnitude = np.where(negative, index - (1 << 15), index)
    lo = (magnitude.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    hi = ((magnitude + 1).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    mid = np.where(magnitude == 0, 0.0, (lo + hi) / 2)
    return np.where(negative, -mid, mid)


@dataclass
class UnitStats:
    """Per-unit (axis 1) counts, sums and extremes; merges exactly by adding and comparing."""

    count: torch.Tensor
    sum: torch.Tensor
    min: torch.Tensor
    max: torch.Tensor
    positive: torch.Tensor
    saturated: torch.Tensor | None = None

    def merge(self, b: UnitStats) -> None:
        if b.count.shape != self.count.shape:
            raise ValueError(
                f"unit counts differ: {tuple(self.count.shape)} vs {tuple(b.count.shape)}"
            )
        self.count += b.count
        self.sum += b.sum
        self.positive += b.positive
        torch.minimum(self.min, b.min, out=self.min)
        torch.maximum(self.max, b.max, out=self.max)
        if self.saturated is not None and b.saturated is not None:
            self.saturated += b.saturated

    def arrays(self) -> dict[str, np.ndarray]:
        out = {
            "unit_count": self.count,
            "unit_sum": self.sum,
            "unit_min": self.min,
            "unit_max": self.max,
            "unit_positive": self.positive,
        }
        if self.saturated is not None:
            out["unit_saturated"] = self.saturated
        return {k: v.numpy() for k, v in out.items()}

    def dead(self) -> torch.Tensor:
        """Units never above zero (among their finite values), and that saw at least one value."""
        return (self.positive == 0) & (self.count > 0)

    def saturated_units(self) -> torch.Tensor | None:
        if self.saturated is None:
            return None
        return (self.saturated == self.count) & (self.count > 0)


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
    bounds: tuple[float, float] | None = None  # output range of a saturating activation
    hist: LogHistogram | None = field(default_factory=LogHistogram)
    units: UnitStats | None = None

    @torch.inference_mode()
    def update(self, x: torch.Tensor) -> None:
        """Fold in one batch (axis 0 = rows). Runs in inference mode wherever it is called from."""
        self.merge(batch_stats(x, self.bounds, self.hist))

    @torch.inference_mode()
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
        if b.hist is not None:
            self.hist.merge(b.hist)
        if b.units is not None:
            if self.units is None:
                self.units = b.units
            else:
                self.units.merge(b.units)

    def as_row(self) -> dict:
        n = self.n
        total = n + self.nan_count + self.inf_count
        quantiles = self.hist.quantiles(list(QUANTILES.values()), self.min, self.max)
        row = {
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
            **dict(zip(QUANTILES, quantiles, strict=True)),
            "units": 0,
            "dead_frac": math.nan,
            "saturated_frac": math.nan,
        }
        if self.units is not None and len(self.units.count):
            row["units"] = len(self.units.count)
            row["dead_frac"] = self.units.dead().double().mean().item()
            saturated = self.units.saturated_units()
            if saturated is not None:
                row["saturated_frac"] = saturated.double().mean().item()
        return row

    def state(self) -> dict:
        """The scalar state (HDF5 attributes); `arrays` holds the histogram and per-unit arrays."""
        return {k: getattr(self, k) for k in SCALARS}

    def arrays(self) -> dict[str, np.ndarray]:
        index, count = self.hist.sparse()
        out = {"hist_index": index, "hist_count": count}
        if self.units is not None:
            out.update(self.units.arrays())
        return out

    @classmethod
    def from_saved(cls, attrs, arrays) -> RunningStats:
        """Rebuild from `state()` attributes and `arrays()` (e.g. a /stats group of probe.h5)."""
        s = cls(**{k: attrs[k].item() if hasattr(attrs[k], "item") else attrs[k] for k in SCALARS})
        if "hist_index" in arrays:
            s.hist = LogHistogram.from_sparse(arrays["hist_index"][()], arrays["hist_count"][()])
        if "unit_count" in arrays:
            get = {
                k: torch.as_tensor(np.asarray(arrays[f"unit_{k}"][()]))
                for k in ("count", "sum", "min", "max", "positive")
            }
            sat = (
                torch.as_tensor(np.asarray(arrays["unit_saturated"][()]))
                if "unit_saturated" in arrays
                else None
            )
            s.units = UnitStats(**get, saturated=sat)
        return s


def sign_counts(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts of values above zero and of non-zero values per (row, unit), as int64. Float sums of
    signs (fast, vectorised) are exact below 2**24 values per (row, unit); beyond, integer sums."""
    if y.shape[2] >= (1 << 24):
        return (y > 0).sum(dim=2), (y != 0).sum(dim=2)
    signs = torch.sign(y)
    balance = signs.sum(dim=2)  # positives - negatives
    nonzero = signs.abs_().sum(dim=2)  # positives + negatives
    return ((balance + nonzero) / 2).to(torch.int64), nonzero.to(torch.int64)


def variance_shift(row: torch.Tensor) -> float:
    """A value to subtract before summing squares: the first row's mean when the data sit far from
    zero (1000 +- 0.01 keeps its variance), else 0 (x - 0 is exact, and no pass is needed)."""
    lo, hi = torch.aminmax(row)
    mean = row.sum() / max(row.numel(), 1)  # in row's dtype, so that x - shift is exact
    return float(mean) if abs(float(mean)) > 0.1 * float(hi - lo) else 0.0


def precise_sum(t: torch.Tensor) -> torch.Tensor:
    """Float64 sums over the last axis of a (rows, units, rest) tensor: float32 sums of short
    blocks (at most 64 values, vectorised), then float64. Near-float64 accuracy at float32 speed,
    which a mean close to zero (values cancelling) needs."""
    size = t.shape[2]
    block = next(b for b in range(min(64, size), 0, -1) if size % b == 0)
    return t.reshape(*t.shape[:2], size // block, block).sum(dim=3).to(F64).sum(dim=2)


def stats_for(module_type: str, site: str) -> RunningStats:
    """Empty statistics for one dataset; output sites of bounded activations track saturation."""
    bounds = SATURATING.get(module_type) if site.split(".")[0].split("@")[0] == "output" else None
    return RunningStats(bounds=bounds)


def batch_stats(
    x: torch.Tensor, bounds: tuple[float, float] | None = None, hist: LogHistogram | None = None
) -> RunningStats:
    """Statistics of one batch in a handful of vectorised passes, combined in float64. Its finite
    values are added to `hist` (the running histogram: no new 64k-bin array per batch)."""
    rows = x.shape[0] if x.ndim else 1
    has_units = x.ndim >= 2
    x = x.detach()
    if not x.is_floating_point() or x.dtype in (torch.float16, torch.bfloat16):
        x = x.float()
    s = RunningStats(rows=rows, hist=None)
    if x.numel() == 0:
        return s
    y = x.reshape(rows, x.shape[1] if has_units else 1, -1)
    counts = torch.bincount(bucket_index(y), minlength=LogHistogram.BINS)
    nonfinite = counts[NONFINITE_BUCKETS]
    finite = None
    if nonfinite.any():  # only NaN and Inf land in these buckets: count them exactly
        counts[NONFINITE_BUCKETS] = 0
        finite = torch.isfinite(y)
        s.nan_count = int(torch.isnan(y).sum())
        s.inf_count = int(y.numel() - finite.sum()) - s.nan_count
        y = torch.where(finite, y, 0.0)
        count = finite.sum(dim=2)
    else:
        count = torch.full(y.shape[:2], y.shape[2], dtype=torch.int64)
    if hist is not None:
        hist.counts += counts
    n = s.n = int(count.sum())
    if n == 0:
        return s
    shift = variance_shift(y[0])
    d = y if shift == 0 else y - shift
    if finite is not None and shift != 0:
        d = torch.where(finite, d, 0.0)
    d_sum = precise_sum(d)  # (rows, units)
    d_sq = torch.linalg.vector_norm(d, dim=2).to(F64).square()
    shift64 = float(shift)
    d_total = d_sum.sum().item()
    s.mean = shift64 + d_total / n
    s.m2 = max(d_sq.sum().item() - d_total * d_total / n, 0.0)
    lows, highs = (
        (y, y) if finite is None else (y.where(finite, math.inf), y.where(finite, -math.inf))
    )
    unit_min, unit_max = lows.amin(dim=2).amin(dim=0), highs.amax(dim=2).amax(dim=0)
    s.min, s.max = unit_min.min().item(), unit_max.max().item()
    positive_part = y.clamp(min=0)
    pos_sum = torch.sum(positive_part.sum(dim=2), dtype=F64).item()
    s.abs_sum = 2 * pos_sum - (shift64 * n + d_total)
    positive, nonzero = sign_counts(y)  # per (row, unit)
    s.zeros = n - int(nonzero.sum())
    sq = d_sq if d is y else torch.linalg.vector_norm(y, dim=2).to(F64).square()
    s.l2_sum = sq.sum(dim=1).sqrt().sum().item()
    if has_units:
        s.units = UnitStats(
            count=count.sum(dim=0),
            sum=shift64 * count.sum(dim=0).to(F64) + d_sum.sum(dim=0),
            min=unit_min.to(F64),
            max=unit_max.to(F64),
            positive=positive.sum(dim=0, dtype=torch.int64),
        )
        if bounds is not None:
            lo, hi = bounds
            tol = SATURATION_TOL * (hi - lo)
            near = (y <= lo + tol) | (y >= hi - tol)
            if finite is not None:
                near &= finite
            s.units.saturated = near.sum(dim=(0, 2))
    return s
