"""Streaming per-dataset statistics with exact merges in float64 (Chan et al. for mean and variance).

Batches, files and processes merge with the same `merge`, so the statistics do not depend on how
the rows were split. Each unit's moments are taken about its own values and the units merged with
Chan's formula, so data such as 1000 +- 0.01 keeps its variance; quantiles come from `LogHistogram`,
fixed buckets that merge exactly by adding counts. This module needs numpy alone.
"""

from __future__ import annotations

import math
import operator
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from probe.site_keys import family_of
from probe.stats import stat_columns
from probe.stats.stat_columns import BATCH, BATCH_AT, BATCH_NAMES, INTEGER_SCALARS, SCALARS

QUANTILE_REL_ERROR = 2.0**-8
# Output range of bounded activations (defaults of their torch constructors).
SATURATING = {
    "Sigmoid": (0.0, 1.0),
    "Hardsigmoid": (0.0, 1.0),
    "Tanh": (-1.0, 1.0),
    "Hardtanh": (-1.0, 1.0),
    "ReLU6": (0.0, 6.0),
}
SATURATION_TOL = 0.01  # a value is saturated within 1% of the range from a bound
UNIT_FIELDS = ("count", "sum", "min", "max", "positive", "saturated")  # rows of a saved `units`


class LogHistogram:
    """Counts per float32 bucket of constant relative width (2**-7); merges by adding counts."""

    BINS = 1 << 16

    def __init__(self, counts: np.ndarray | None = None):
        counts = counts if counts is not None else np.zeros(self.BINS, dtype=np.int64)
        self._rows = counts[None]  # its own counts, then lanes that other threads count into

    @property
    def counts(self) -> np.ndarray:
        rows = self._rows
        for lane in rows[1:]:
            np.add(rows[0], lane, out=rows[0])
            lane[:] = 0
        return rows[0]

    def lanes(self, n: int) -> np.ndarray:
        """(n, BINS) counts, one row per thread: this histogram's own, then helpers' lanes (kept
        across batches, so a parallel batch allocates and adds nothing)."""
        if len(self._rows) < n:
            rows = np.zeros((n, self.BINS), dtype=self._rows.dtype)
            rows[: len(self._rows)] = self._rows
            self._rows = rows
        return self._rows[:n]

    def add_to(self, counts: np.ndarray) -> None:
        np.add(counts, self.counts, out=counts)

    def occupied(self) -> int:
        """Its non-empty buckets (at most: a sketch summed on a device says so without reading
        its counts, probe.stats.device_sketch)."""
        return int(np.count_nonzero(self.counts))

    def merge(self, other: LogHistogram | BucketSpans) -> None:
        other.add_to(self.counts)

    def ordered(self) -> tuple[np.ndarray, np.ndarray]:
        """(bucket midpoints, counts) of the non-empty buckets in increasing value order."""
        index, counts = occupied(self.counts, True)
        return bucket_midpoints(index), counts

    def quantiles(self, qs, lo: float, hi: float) -> list[float]:
        """Value of rank floor(q*(n-1)) for each q, within QUANTILE_REL_ERROR of the true one.
        `lo` and `hi`, the values' min and max, bound the buckets read: only those between
        their buckets (the whole histogram where they do not hold every count)."""
        counts = self.counts
        spans = [(start, counts[start : start + length]) for start, length in ranges(lo, hi)]
        if spans and sum(int(c.sum()) for _, c in spans) == int(counts.sum()):
            return ranked(spans, qs, lo, hi)
        mids, counts = self.ordered()
        n = int(counts.sum())
        if n == 0:
            return [math.nan for _ in qs]
        cum = np.cumsum(counts)
        ranks = np.floor(np.asarray(qs, dtype=np.float64) * (n - 1)).astype(np.int64)
        picked = mids[np.searchsorted(cum, ranks, side="right")]
        return [float(v) for v in np.clip(picked, lo, hi)]

    def sparse(self) -> tuple[np.ndarray, np.ndarray]:
        index, counts = occupied(self.counts, False)
        return index.astype(np.int32), counts

    @classmethod
    def from_sparse(cls, index: np.ndarray, count: np.ndarray) -> LogHistogram:
        h = cls()
        h.counts[np.asarray(index, dtype=np.int64)] = np.asarray(count, dtype=np.int64)
        return h


@dataclass
class PointQuantiles:
    """A histogram read on its device: the quantiles of `qs` as bucket midpoints (not clipped);
    `quantiles` clips them to the values' min and max as `LogHistogram.quantiles` does."""

    qs: tuple[float, ...]
    points: tuple[float, ...]

    def quantiles(self, qs, lo: float, hi: float) -> list[float]:
        if tuple(qs) != self.qs:
            raise ValueError(f"quantiles {list(qs)} asked of a sketch read at {list(self.qs)}")
        out = []
        for v in self.points:
            if np.isnan(v):
                out.append(float("nan"))
            else:
                out.append(v if lo < v < hi else float(np.clip(v, lo, hi)))
        return out


class BucketSpans:
    """One batch's histogram as copies of the bucket ranges its finite values can fall in (one
    per sign, from its min and max): up to the bucket of the largest magnitude instead of all
    65536 (a batch in [-5, 5] copies 33K buckets, one in [1, 2] 129)."""

    def __init__(self, heads: np.ndarray, counts: np.ndarray):
        self.heads = heads  # (first bucket, length) per range
        # the counts of the ranges, one after another: int64, or float64 holding integers (as
        # the compiled pass packs them, exact below 2**53: no conversion per batch)
        self.spans = counts

    def add_to(self, counts: np.ndarray) -> None:
        for start, piece in self.pieces():
            view = counts[start : start + len(piece)]
            np.add(view, piece, out=view, casting="unsafe")  # (float64 counts are integers)

    def pieces(self) -> list[tuple[int, np.ndarray]]:
        """(first bucket, counts) of each range."""
        out, offset = [], 0
        for start, length in self.heads.tolist():
            out.append((start, self.spans[offset : offset + length]))
            offset += length
        return out

    def quantiles(self, qs, lo: float, hi: float) -> list[float]:
        """As `LogHistogram.quantiles`, read from the ranges alone (no 65536 buckets to fill)."""
        return ranked(self.pieces(), qs, lo, hi)

    def whole(self) -> LogHistogram:
        """The same counts as a LogHistogram (to merge others into)."""
        h = LogHistogram()
        self.add_to(h.counts)
        return h

    def union(self, other: BucketSpans) -> BucketSpans:
        """Both histograms' counts over, per sign, the one range that covers both's ranges of
        that sign (buckets between them count zero): a step's micro-batches merged without
        all 65536 buckets, read by `quantiles` as a LogHistogram of the same counts is."""
        pieces = self.pieces() + other.pieces()
        covered: dict[bool, tuple[int, int]] = {}  # negative? -> (first bucket, stop)
        for start, piece in pieces:
            first, stop = covered.get(start >= NEGATIVE, (start, start + len(piece)))
            covered[start >= NEGATIVE] = (min(first, start), max(stop, start + len(piece)))
        heads: list[tuple[int, int]] = []
        at: dict[bool, tuple[int, int]] = {}  # negative? -> (first bucket, where its counts start)
        for sign in sorted(covered):
            first, stop = covered[sign]
            at[sign] = (first, sum(length for _, length in heads))
            heads.append((first, stop - first))
        kind = np.result_type(np.int64, *(piece.dtype for _, piece in pieces))
        counts = np.zeros(sum(length for _, length in heads), dtype=kind)
        for start, piece in pieces:
            first, offset = at[start >= NEGATIVE]
            counts[offset + start - first : offset + start - first + len(piece)] += piece
        return BucketSpans(np.array(heads, dtype=np.int64).reshape(-1, 2), counts)


NEGATIVE = 1 << 15  # the first bucket of negative values (-0.0)


def _magnitude_bucket(v: float) -> int:
    """The bucket of |v| as a float32 (beyond float32's range: the Inf bucket)."""
    with np.errstate(over="ignore"):
        return int(np.array(abs(v), dtype=np.float32).view(np.int32)) >> 16


def ranges(lo: float, hi: float) -> list[tuple[int, int]]:
    """(first bucket, length) of the buckets values in [lo, hi] fall in, one range per sign
    (both zero buckets where 0 is in [lo, hi]: a min or max of 0.0 may carry either sign); none
    where lo > hi or either is not finite (no value)."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or lo > hi:
        return []
    out = []
    if hi >= 0.0:
        first = _magnitude_bucket(max(lo, 0.0))
        out.append((first, _magnitude_bucket(hi) + 1 - first))
    if lo <= 0.0:
        first = _magnitude_bucket(min(hi, 0.0))
        out.append((NEGATIVE | first, _magnitude_bucket(lo) + 1 - first))
    return out


def ranked(pieces: list[tuple[int, np.ndarray]], qs, lo: float, hi: float) -> list[float]:
    """The quantiles of `LogHistogram.quantiles` from counts given only over bucket ranges, at
    most one per sign ((first bucket, counts) each) and every count in them: the negative range
    read from its largest magnitude down, then the positive one up, as `occupied` orders."""
    negative = [(start, c) for start, c in pieces if start >= NEGATIVE]
    positive = [(start, c) for start, c in pieces if start < NEGATIVE]
    if len(negative) > 1 or len(positive) > 1:
        raise ValueError("ranked takes at most one range of buckets per sign")
    none = np.zeros(0, np.int64)  # (a sign without a range: no counts)
    down = np.cumsum(negative[0][1][::-1]) if negative else none
    up = np.cumsum(positive[0][1]) if positive else none
    below = int(down[-1]) if len(down) else 0
    n = below + (int(up[-1]) if len(up) else 0)
    if n == 0:
        return [math.nan for _ in qs]
    ranks = [math.floor(q * (n - 1)) for q in qs]
    # the first bucket whose cumulated count passes each rank, in the range that holds it
    neg = down.searchsorted([r for r in ranks if r < below], "right").tolist() if below else []
    pos = [r - below for r in ranks if r >= below]
    pos = up.searchsorted(pos, "right").tolist()[::-1] if pos else []
    out = []
    for rank in ranks:
        if rank < below:
            index = negative[0][0] + len(down) - 1 - neg.pop(0)
        else:
            index = positive[0][0] + pos.pop()
        v = _midpoint(index)
        out.append(v if lo < v < hi else float(np.clip(v, lo, hi)))
    return out


def _midpoint(index: int) -> float:
    """`bucket_midpoints` of one bucket."""
    magnitude = index - NEGATIVE if index >= NEGATIVE else index
    if magnitude == 0:
        return -0.0 if index >= NEGATIVE else 0.0
    low, high = struct.unpack("<2f", struct.pack("<2I", magnitude << 16, (magnitude + 1) << 16))
    mid = (low + high) / 2
    return -mid if index >= NEGATIVE else mid


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

    @classmethod
    def empty(cls, width: int) -> UnitStats:
        """What merges into anything unchanged."""
        zeros = np.zeros(width, np.int64)
        return cls(
            zeros, np.zeros(width), np.full(width, np.inf), np.full(width, -np.inf), zeros.copy()
        )

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

    def packed(self) -> np.ndarray:
        """(UNIT_FIELDS, units) float64, the saturated row only where it is tracked."""
        rows = [self.count, self.sum, self.min, self.max, self.positive]
        return np.stack(rows + ([] if self.saturated is None else [self.saturated])).astype(float)

    @classmethod
    def unpacked(cls, a: np.ndarray) -> UnitStats:
        a = np.asarray(a, dtype=np.float64)
        ints = [a[i].astype(np.int64) for i in (0, 4, 5) if i < len(a)]
        return cls(ints[0], a[1].copy(), a[2].copy(), a[3].copy(), *ints[1:])

    @property
    def width(self) -> int:
        """How many units (known without reading a device's counts)."""
        return len(self.count)

    @property
    def tracked(self) -> bool:
        """Whether saturation is counted (known without reading a device's counts)."""
        return self.saturated is not None

    def dead(self) -> np.ndarray:
        """Units never above zero (among their finite values), and that saw at least one value."""
        return (self.positive == 0) & (self.count > 0)

    def saturated_units(self) -> np.ndarray | None:
        if self.saturated is None:
            return None
        return (self.saturated == self.count) & (self.count > 0)


@dataclass
class RunningStats:
    """One dataset's statistics: the slots of `stat_columns.SLOTS` (in that order, each starting
    at its `empty` value), the histogram of its finite values and its per-unit statistics."""

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
    # a batch's may be its own ranges (BucketSpans); `whole_histogram` makes it a LogHistogram
    hist: LogHistogram | BucketSpans | PointQuantiles | None = field(default_factory=LogHistogram)
    units: UnitStats | None = None
    unit_axis: int = 1  # the axis of a batch (axis 0: rows) along which the units lie

    def merge(self, b) -> None:
        """Chan et al.: exact for count, mean and M2 in float64; the rest add or compare. `b` is
        another RunningStats, or a backend's packed batch result, which folds itself in."""
        fold = getattr(b, "fold_into", None)
        if fold is not None:
            fold(self)
            return
        self.add(b.rows, b.accumulator())
        if b.hist is not None:
            self.whole_histogram().merge(b.hist)
        if b.units is not None:
            if self.units is None:
                self.units = b.units
            else:
                self.units.merge(b.units)

    def whole_histogram(self) -> LogHistogram:
        """The histogram as all 65536 buckets, to merge into: one kept as a batch's own ranges
        (`BucketSpans`), or none yet, becomes a LogHistogram first."""
        if isinstance(self.hist, PointQuantiles):  # (a device's quantiles: no buckets left)
            raise ValueError("statistics read as their quantiles on the device merge no further")
        if not isinstance(self.hist, LogHistogram):
            self.hist = LogHistogram() if self.hist is None else self.hist.whole()
        return self.hist

    def accumulator(self) -> tuple:
        """Its batch accumulator: every slot but `rows`, in `stat_columns.BATCH` order."""
        return _ACCUMULATOR(self)

    def add(self, rows: int, batch: Sequence) -> None:
        """Merge a batch's accumulator (in `stat_columns.BATCH` order) of `rows` rows, each slot
        as declared: the moments by Chan's formula, the extremes (of a batch with finite values)
        by comparing, the rest by adding."""
        d = self.__dict__  # (a hook's batch merges here: dict lookups cost less than getattr)
        n = batch[_N]
        total = d["n"] + n
        if n:
            mean = batch[_MEAN]
            delta = mean - d["mean"]
            d["mean"] += delta * n / total
            d["m2"] += batch[_M2] + delta * delta * d["n"] * n / total
            for name, i in _LOWEST:
                d[name] = min(d[name], batch[i])
            for name, i in _HIGHEST:
                d[name] = max(d[name], batch[i])
        d["n"] = total
        d["rows"] += rows
        for name, i in _ADDED:
            d[name] += batch[i]

    def as_row(self) -> dict:
        """summary.csv's statistics of this state (`stat_columns.summary_columns`), by name."""
        return stat_columns.values(self, stat_columns.summary_columns())

    def state(self) -> dict:
        """The `state` attribute: the SCALARS as one float64 vector (one HDF5 attribute is much
        cheaper to write than eleven; counts stay exact below 2**53)."""
        return {"state": np.array([getattr(self, k) for k in SCALARS], dtype=np.float64)}

    def arrays(self) -> dict[str, np.ndarray]:
        """`hist` (2, k): index and count of the non-empty buckets; `units` (UNIT_FIELDS, units)."""
        out = {"hist": occupied(self.whole_histogram().counts, False)}
        if self.units is not None:
            out["units"] = self.units.packed()
        return out

    @classmethod
    def from_saved(cls, attrs, arrays) -> RunningStats:
        """Rebuild from `state()` attributes and `arrays()` (e.g. a /stats group of probe.h5);
        files written before the packed layout keep one attribute per scalar and unit_* arrays."""
        if "state" not in attrs:
            return cls._from_unpacked(attrs, arrays)
        values = dict(zip(SCALARS, np.asarray(attrs["state"], dtype=np.float64), strict=True))
        scalars: dict[str, Any] = {  # (the scalar slots: ints and floats, by name)
            k: int(v) if k in INTEGER_SCALARS else float(v) for k, v in values.items()
        }
        s = cls(**scalars)
        s.unit_axis = int(attrs.get("unit_axis", 1))
        if "hist" in arrays:
            index, count = np.asarray(arrays["hist"][()])
            s.hist = LogHistogram.from_sparse(index, count)
        if "units" in arrays:
            s.units = UnitStats.unpacked(arrays["units"][()])
        return s

    @classmethod
    def _from_unpacked(cls, attrs, arrays) -> RunningStats:
        s = cls(**{k: np.asarray(attrs[k]).item() for k in SCALARS})
        if "hist_index" in arrays:
            s.hist = LogHistogram.from_sparse(arrays["hist_index"][()], arrays["hist_count"][()])
        if "unit_count" in arrays:
            fields = [f for f in UNIT_FIELDS if f"unit_{f}" in arrays]
            s.units = UnitStats.unpacked(np.stack([arrays[f"unit_{f}"][()] for f in fields]))
        return s


_ACCUMULATOR = operator.attrgetter(*BATCH_NAMES)
_N, _MEAN, _M2 = BATCH_AT["n"], BATCH_AT["mean"], BATCH_AT["m2"]
_ADDED = tuple((s.name, BATCH_AT[s.name]) for s in BATCH if s.merge == "sum")
_LOWEST = tuple((s.name, BATCH_AT[s.name]) for s in BATCH if s.merge == "min")
_HIGHEST = tuple((s.name, BATCH_AT[s.name]) for s in BATCH if s.merge == "max")


def counts_agree(s: RunningStats, dtype: str) -> bool:
    """Whether saved statistics are all of one moment: per-unit counts add up to the count of
    finite values, and so do the histogram's (at most, for float64 values beyond float32's range,
    whose buckets are cleared). A kill while /stats is rewritten can leave parts of two flushes."""
    total = int(s.whole_histogram().counts.sum())
    if total > s.n or (total < s.n and dtype != "float64"):
        return False
    return s.units is None or int(s.units.count.sum()) == s.n


def as_array(x) -> np.ndarray:
    """A C-contiguous numpy view of a CPU tensor or array, as float32 unless it is float32 or
    float64 (half precision, bfloat16 and integers are widened; none of them loses a value).
    Few steps for the common case, a float32 tensor outside autograd: in a hook each costs."""
    if hasattr(x, "detach"):  # a torch tensor (duck-typed: this module does not import torch)
        kind = x.dtype
        if not kind.is_floating_point or kind.itemsize < 4:  # torch widens 20x faster than numpy
            x = x.detach().float()
        try:
            x = x.numpy()
        except RuntimeError:  # a tensor that needs grad
            x = x.detach().numpy()
    a = x if type(x) is np.ndarray else np.asarray(x)
    kind = a.dtype
    if kind.char not in "fd":  # float32 and float64 are kept
        a = a.astype(np.float32)
    elif not kind.isnative:  # (a file written on a machine of the other byte order)
        a = a.astype(kind.newbyteorder("="))
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def bounds_for(module_type: str, site: str) -> tuple[float, float] | None:
    """The output range whose saturation a dataset tracks: output sites of bounded activations."""
    return SATURATING.get(module_type) if family_of(site) == "output" else None


def stats_for(module_type: str, site: str, unit_axis: int = 1) -> RunningStats:
    """Empty statistics for one dataset; output sites of bounded activations track saturation."""
    return RunningStats(bounds=bounds_for(module_type, site), unit_axis=unit_axis)


def occupied_buckets(stats) -> int:
    """How many histogram buckets a batch's (or a run's) statistics fill: /stats stores each.
    A backend's packed batch result counts its own (`buckets`)."""
    if hasattr(stats, "buckets"):
        return stats.buckets
    hist = stats.hist
    if hist is None:
        return 0
    if isinstance(hist, BucketSpans):
        return int(np.count_nonzero(hist.spans))
    return hist.occupied() if isinstance(hist, LogHistogram) else 0  # (quantiles: no buckets)


def occupied(counts: np.ndarray, by_value: bool) -> np.ndarray:
    """(2, k) int64: the index and count of each non-empty bucket, in index order or, with
    `by_value`, in increasing value order (the negative buckets from the largest magnitude down,
    then the positive ones up)."""
    index = np.flatnonzero(counts)
    if by_value:
        negative = index >= LogHistogram.BINS // 2
        index = np.concatenate([index[negative][::-1], index[~negative]])
    return np.stack([index, counts[index]]).astype(np.int64, copy=False)
