"""Streaming per-dataset statistics with exact merges in float64 (Chan et al. for mean and variance).

Each batch is reduced in one compiled pass (`probe.kernels`) over a numpy view of it, accumulating
in float64; batches, files and processes merge with the same `merge`. No torch here: the summarizer
reads files with numpy alone. Mean, std, min, max, abs_mean and rms are over the finite values; NaN and Inf are
counted apart. std is the population standard deviation (ddof=0).

A batch is viewed as (rows, units, rest): units are axis 1 (channels of a conv output, features of a
linear one). When the data sit far from zero the variance is taken about a shift near their mean, so
data such as 1000 +- 0.01 keeps its variance.

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
from dataclasses import dataclass, field

import numpy as np

from probe.kernels import reduce_segments

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
NONFINITE_BUCKETS = np.concatenate([np.arange(0x7F80, 0x8000), np.arange(0xFF80, 0x10000)])


class LogHistogram:
    """Counts per float32 bucket of constant relative width (2**-7); merges by adding counts."""

    BINS = 1 << 16

    def __init__(self, counts: np.ndarray | None = None):
        self.counts = counts if counts is not None else np.zeros(self.BINS, dtype=np.int64)

    def merge(self, other: LogHistogram) -> None:
        self.counts += other.counts

    def ordered(self) -> tuple[np.ndarray, np.ndarray]:
        """(bucket midpoints, counts) of the non-empty buckets in increasing value order."""
        order = np.concatenate(
            [np.arange(self.BINS - 1, self.BINS // 2 - 1, -1), np.arange(self.BINS // 2)]
        )
        keep = order[self.counts[order] > 0]
        return bucket_midpoints(keep), self.counts[keep]

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
        idx = np.flatnonzero(self.counts)
        return idx.astype(np.int32), self.counts[idx]

    @classmethod
    def from_sparse(cls, index: np.ndarray, count: np.ndarray) -> LogHistogram:
        h = cls()
        h.counts[np.asarray(index, dtype=np.int64)] = np.asarray(count, dtype=np.int64)
        return h


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

    count: np.ndarray
    sum: np.ndarray
    min: np.ndarray
    max: np.ndarray
    positive: np.ndarray
    saturated: np.ndarray | None = None

    def merge(self, b: UnitStats) -> None:
        if b.count.shape != self.count.shape:
            raise ValueError(f"unit counts differ: {self.count.shape} vs {b.count.shape}")
        self.count += b.count
        self.sum += b.sum
        self.positive += b.positive
        np.minimum(self.min, b.min, out=self.min)
        np.maximum(self.max, b.max, out=self.max)
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
        return out

    def dead(self) -> np.ndarray:
        """Units never above zero (among their finite values), and that saw at least one value."""
        return (self.positive == 0) & (self.count > 0)

    def saturated_units(self) -> np.ndarray | None:
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

    def update(self, x) -> None:
        """Fold in one batch (axis 0 = rows): a numpy array or a CPU torch tensor."""
        self.merge(batch_stats(x, self.bounds, self.hist))

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
            row["dead_frac"] = float(self.units.dead().mean())
            saturated = self.units.saturated_units()
            if saturated is not None:
                row["saturated_frac"] = float(saturated.mean())
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
                k: np.array(arrays[f"unit_{k}"][()])
                for k in ("count", "sum", "min", "max", "positive")
            }
            sat = np.array(arrays["unit_saturated"][()]) if "unit_saturated" in arrays else None
            s.units = UnitStats(**get, saturated=sat)
        return s


def as_array(x) -> np.ndarray:
    """A C-contiguous numpy view of a CPU tensor or array, as float32 unless it is float32 or
    float64 (half precision, bfloat16 and integers are widened; none of them loses a value)."""
    if hasattr(x, "detach"):  # a torch tensor (duck-typed: this module does not import torch)
        x = x.detach()
        if not x.is_floating_point() or x.element_size() < 4:
            x = x.float()
        x = x.numpy()
    a = np.asarray(x)
    if a.dtype not in (np.float32, np.float64):
        a = a.astype(np.float32)
    return np.ascontiguousarray(a)


def variance_shift(row: np.ndarray) -> float:
    """A value to subtract before summing squares: the first row's mean (rounded to the data's
    dtype) when the data sit far from zero, so 1000 +- 0.01 keeps its variance; else 0."""
    finite = row[np.isfinite(row)]
    if finite.size == 0:
        return 0.0
    mean = finite.mean(dtype=np.float64)
    spread = float(finite.max()) - float(finite.min())
    return float(row.dtype.type(mean)) if abs(mean) > 0.1 * spread else 0.0


def stats_for(module_type: str, site: str) -> RunningStats:
    """Empty statistics for one dataset; output sites of bounded activations track saturation."""
    bounds = SATURATING.get(module_type) if site.split(".")[0].split("@")[0] == "output" else None
    return RunningStats(bounds=bounds)


def batch_stats(x, bounds: tuple[float, float] | None = None, hist: LogHistogram | None = None):
    """Statistics of one batch from one compiled pass. Its values are counted into `hist` (the
    running histogram: no new 64k-bin array per batch); NaN and Inf are counted apart."""
    a = as_array(x)
    rows = a.shape[0] if a.ndim else 1
    has_units = a.ndim >= 2
    s = RunningStats(rows=rows, hist=None)
    if a.size == 0:
        return s
    y = a.reshape(rows, a.shape[1] if has_units else 1, -1)
    bits = (y if y.dtype == np.float32 else y.astype(np.float32)).view(np.uint32)
    shift = variance_shift(y[0])
    counts = hist.counts if hist is not None else np.zeros(LogHistogram.BINS, dtype=np.int64)
    sums = np.empty((*y.shape[:2], 3))
    lows, highs = np.empty(y.shape[:2]), np.empty(y.shape[:2])
    tallies = np.empty((*y.shape[:2], 5), dtype=np.int64)
    reduce_segments(y, bits, shift, counts, sums, lows, highs, tallies)
    count = tallies[..., 0]
    s.nan_count, s.inf_count = int(tallies[..., 3].sum()), int(tallies[..., 4].sum())
    if s.nan_count or s.inf_count:
        counts[NONFINITE_BUCKETS] = 0  # they never hold a finite value
    n = s.n = int(count.sum())
    if n == 0:
        return s
    d_sum, d_sq = sums[..., 0], sums[..., 1]
    d_total = float(d_sum.sum())
    s.mean = shift + d_total / n
    s.m2 = max(float(d_sq.sum()) - d_total * d_total / n, 0.0)
    s.min, s.max = float(lows.min()), float(highs.max())
    s.abs_sum = float(sums[..., 2].sum())
    s.zeros = int(tallies[..., 1].sum())
    squares = d_sq + 2 * shift * d_sum + count * shift * shift  # sum of v**2 per (row, unit)
    s.l2_sum = float(np.sqrt(np.maximum(squares.sum(axis=1), 0.0)).sum())
    if has_units:
        unit_count = count.sum(axis=0)
        s.units = UnitStats(
            count=unit_count,
            sum=shift * unit_count + d_sum.sum(axis=0),
            min=lows.min(axis=0),
            max=highs.max(axis=0),
            positive=tallies[..., 2].sum(axis=0),
        )
        if bounds is not None:
            s.units.saturated = saturated_counts(y, bounds)
    return s


def saturated_counts(y: np.ndarray, bounds: tuple[float, float]) -> np.ndarray:
    """Per unit of y (rows, units, rest): finite values within SATURATION_TOL of the range from
    a bound (bounded activations only, so this extra pass is rare)."""
    lo, hi = bounds
    tol = SATURATION_TOL * (hi - lo)
    near = ((y <= lo + tol) | (y >= hi - tol)) & np.isfinite(y)
    return near.sum(axis=(0, 2))
