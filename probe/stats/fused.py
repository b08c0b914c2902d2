"""Per-batch statistics in a dozen torch operations: the torch backend on a GPU.

The same quantities as `probe.stats.torch_backend` (its reference path), from two stacked tensors
built by one broadcast operation each, so that a batch costs 12 operations whatever its shape
(the reference: about 150, each a kernel launch on a GPU):

- `y`, from the values' bits: one row whose histogram (`histc`) is the quantile sketch, and four
  rotations of the bit patterns whose per-unit maxima are each unit's extremes (the largest and
  smallest pattern of its positive and of its negative finite values, signed zeros included):
  `(a * bits + b) mod m` puts one arc of the circle of patterns at the top.
- `z`, from the values, float64: the value masked to 0 where not finite, its positive part, and
  rows clamped to three levels whose sums and sums of squares (`var_mean`) count the positive,
  negative, not finite, infinite and saturated values of each unit exactly.

`reduce` packs both reductions into one float64 tensor on the batch's device, without a host sync;
`Layout.unpack` makes a `RunningStats` of its host copy in float64 (Chan's formula across units).
Each unit's moments are taken by `var_mean` over all its values with the masked ones as zeros,
then the zeros are taken out exactly; float64 batches take the reference path instead (the level
rows count float32, float16 and bfloat16 values, whose magnitudes are multiples of 2**-149).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np
import torch

from probe.stats.running import SATURATION_TOL, LogHistogram, RunningStats, UnitStats

BINS = 1 << 16
_STEP = 2.0**150  # |STEP * v| >= 2 for every nonzero v of float32, float16 or bfloat16
_TINY = 2.0**-277  # |TINY * v| <= 2**-149 for every finite such v: it vanishes beside 0.5


@dataclass(frozen=True)
class _Format:
    """A floating type's bit patterns: their width, the integer type that views them, the
    patterns of its positive and negative finite values, and how a pattern becomes a value."""

    bits: int
    ints: torch.dtype
    positive: tuple[int, int]
    negative: tuple[int, int]
    name: str

    def values(self, patterns: np.ndarray) -> np.ndarray:
        p: np.ndarray = patterns.astype(np.uint32)
        if self.name == "float16":
            return p.astype(np.uint16).view(np.float16).astype(np.float64)
        if self.name == "bfloat16":
            p = p << 16
        return p.view(np.float32).astype(np.float64)

    def buckets(self) -> np.ndarray | None:
        """The float32 bucket of each pattern (None: the pattern's top 16 bits are its bucket)."""
        if self.name != "float16":
            return None
        halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
        return (halves.astype(np.float32).view(np.uint32) >> 16).astype(np.int64)


FORMATS = {
    torch.float32: _Format(32, torch.int32, (0, 0x7F7FFFFF), (0x80000000, 0xFF7FFFFF), "float32"),
    torch.float16: _Format(16, torch.int16, (0, 0x7BFF), (0x8000, 0xFBFF), "float16"),
    torch.bfloat16: _Format(16, torch.int16, (0, 0x7F7F), (0x8000, 0xFF7F), "bfloat16"),
}


def supports(x: torch.Tensor) -> bool:
    """Whether `reduce` takes x: float32, float16, bfloat16 and integers (widened to float32)."""
    return x.dtype in FORMATS or not (x.dtype.is_floating_point or x.dtype.is_complex)


@dataclass(frozen=True)
class _Plan:
    """The constants of one kind of batch: the affine maps of y's and z's rows (broadcast over
    the batch's dimensions), y's moduli, z's clamps, and the sorted histogram's bucket edges."""

    rows: int  # K: rows of y and of z
    tracked: bool  # saturation rows present
    step: float  # patterns per histogram bucket
    ay: torch.Tensor
    by: torch.Tensor
    my: torch.Tensor
    az: torch.Tensor
    bz: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    edges: torch.Tensor | None


@dataclass(frozen=True)
class Layout:
    """How to read a `reduce` result: one block per slab of `slab_rows` batch rows, each with
    `per_unit` values per unit; `width` units (0: none, one flat block per slab)."""

    fmt: _Format
    rows: int
    width: int
    tracked: bool
    hist: bool
    single: bool
    slab_rows: tuple[int, ...]
    per_unit: tuple[int, ...]
    unit_axis: int

    def unpack(self, packed: np.ndarray) -> RunningStats:
        """The statistics of a packed result's host copy, in float64 (slabs merged by Chan)."""
        p = np.asarray(packed, dtype=np.float64)
        if p.size == 0:
            return RunningStats(rows=sum(self.slab_rows), hist=None, unit_axis=self.unit_axis)
        p = p.reshape(-1)
        out: RunningStats | None = None
        at = 0
        for rows, n in zip(self.slab_rows, self.per_unit, strict=True):
            size = self._size(rows)
            s = self._slab(p[at : at + size], rows, n)
            at += size
            if out is None:
                out = s
            else:
                out.merge(s)
        assert out is not None  # a result with values has a slab
        return out

    def _size(self, rows: int) -> int:
        """Values in the block of a slab of `rows` rows."""
        bins = _bins(self.rows) if self.hist else 0
        if not self.width:
            return 3 * self.rows + bins
        return self.rows * (3 * self.width + (0 if self.single else rows)) + bins

    def _pieces(self, block: np.ndarray, rows: int):
        """(ext, var, mean, norms, histogram) of one slab's block, each (K, columns)."""
        k = self.rows
        if not self.width:  # flat: K extremes, K variances, K means, then the histogram
            ext, var, mean = (block[i * k : (i + 1) * k, None] for i in range(3))
            return ext, var, mean, None, block[3 * k :]
        b = block.reshape(k, -1)
        c = self.width
        ext, var, mean = b[:, :c], b[:, c : 2 * c], b[:, 2 * c : 3 * c]
        at = 3 * c + (0 if self.single else rows)
        norms = None if self.single else b[:, 3 * c : at]
        return ext, var, mean, norms, b[:, at:].reshape(-1)

    def _slab(self, block: np.ndarray, rows: int, n: int) -> RunningStats:
        ext, var, mean, norms, hist_block = self._pieces(block, rows)
        sums, squares = mean * n, (var + mean * mean) * n  # per row of z and unit
        fin, plus, minus = _levels(squares[2], squares[4], sums[4])
        positive = np.rint((sums[2] + fin + minus - plus) / 2)
        negative = np.rint((fin + plus - minus - sums[3]) / 2)
        value_sums = sums[0]
        unit_mean = np.where(fin > 0, value_sums / np.maximum(fin, 1), 0.0)
        masked = n - fin  # values not finite, zeros in var_mean's view: taken out (Chan)
        unit_m2 = np.maximum(var[0] * n - unit_mean**2 * fin * masked / n, 0.0)
        lows, highs = self._extremes(ext)
        total = fin.sum()
        mean_all = value_sums.sum() / total if total else 0.0
        m2 = unit_m2.sum() + (fin * (unit_mean - mean_all) ** 2).sum()
        abs_sum = float((2 * sums[1] - value_sums).sum())
        infs = int((plus + minus).sum())
        nans = int(n * len(fin) - total - infs)
        l2 = abs_sum if self.single else float(norms[0].sum())
        lo, hi = _first(lows, lows.min()), _first(highs, highs.max())
        zeros = int((fin - positive - negative).sum())
        hist = self._histogram(hist_block) if self.hist else None
        units = None
        if self.width:
            saturated = None
            if self.tracked:
                below = np.rint((fin + plus - minus - sums[5]) / 2)
                above = np.rint((sums[6] + fin + minus - plus) / 2)
                saturated = (below + above).astype(np.int64)
            units = UnitStats(fin.astype(np.int64), value_sums.copy(), lows, highs,
                              positive.astype(np.int64), saturated)  # fmt: skip
        # the batch's accumulator (`stat_columns.BATCH`), by name
        batch = {"n": int(total), "mean": mean_all, "m2": m2, "min": lo, "max": hi,
                 "abs_sum": abs_sum, "zeros": zeros, "nan_count": nans, "inf_count": infs,
                 "l2_sum": l2}  # fmt: skip
        return RunningStats(rows, **batch, hist=hist, units=units, unit_axis=self.unit_axis)

    def _extremes(self, ext: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per unit the lowest and highest finite value (+inf and -inf where there is none)."""
        (a, b), (na, nb) = self.fmt.positive, self.fmt.negative
        top_pos, low_pos, top_neg, low_neg = ext[1], ext[2], ext[3], ext[4]
        has_pos, has_neg = top_pos >= a - b, top_neg >= na - nb
        f = self.fmt.values
        pos_max = f(np.where(has_pos, b + top_pos, 0))
        pos_min = f(np.where(has_pos, a - low_pos, 0))
        neg_min = f(np.where(has_neg, nb + top_neg, 0))
        neg_max = f(np.where(has_neg, na - low_neg, 0))
        highs = np.where(has_pos, pos_max, np.where(has_neg, neg_max, -np.inf))
        lows = np.where(has_neg, neg_min, np.where(has_pos, pos_min, np.inf))
        return lows, highs

    def _histogram(self, block: np.ndarray) -> LogHistogram:
        counts = np.rint(block[:BINS]).astype(np.int64)
        table = self.fmt.buckets()
        if table is not None:
            counts = np.bincount(table, weights=counts, minlength=BINS).astype(np.int64)
        counts[0x7F80:0x8000] = counts[0xFF80:] = 0  # NaN and Inf: never a finite value's
        return LogHistogram(counts)


def _levels(p_squares, f_squares, f_sums) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(finite, +inf, -inf) counts per unit from the level rows: the sign row is +-1 wherever a
    value is not NaN, the finiteness row 0.5 at finite values and +-1 at infinite ones."""
    fin = np.rint((p_squares - f_squares) / 0.75)
    infinite = np.rint(p_squares - fin)
    plus = np.rint((infinite + f_sums - 0.5 * fin) / 2)
    return fin, plus, infinite - plus


def _first(values: np.ndarray, extreme: float) -> float:
    """The first of `values` equal to `extreme` (as floats: the first unit's zero keeps its sign,
    as the kernels compare the units' extremes)."""
    return float(values[int(np.argmax(values == extreme))])


class _Plans(threading.local):
    def __init__(self):
        self.cache: dict = {}


_plans = _Plans()


def _plan(x: torch.Tensor, fmt: _Format, bounds, hist: bool, sorts: bool) -> _Plan:
    """This kind of batch's constants, made once per thread and device and kept (on a GPU copied
    from pinned memory, so that making them does not wait either)."""
    key = (x.device, fmt.name, max(x.dim(), 1), bounds, hist, sorts)
    plan = _plans.cache.get(key)
    if plan is None:
        plan = _plans.cache[key] = _make_plan(x, fmt, bounds, hist, sorts)
    return plan


def _make_plan(x: torch.Tensor, fmt: _Format, bounds, hist: bool, sorts: bool) -> _Plan:
    modulus = 2.0**fmt.bits
    (a, b), (na, nb) = fmt.positive, fmt.negative
    # y, (a, b, m) of (a * bits + b) mod m: the histogram's row (patterns shifted by one, so the
    # last, a NaN's, falls out of its range), then each finite arc's top and bottom brought to
    # the top of (-m, 0]
    y_rows = [(1, 1, modulus), (1, -b, -modulus), (-1, a, -modulus), (1, -nb, -modulus),
              (-1, na, -modulus)]  # fmt: skip
    # z, (a, b, lo, hi) of clamp(a * v + b, lo, hi), NaN then 0: the value, its positive part,
    # and levels: +-1 by v > 0, by v >= 0, 0.5 where finite (+-1 at +-inf)
    inf = math.inf
    z_rows = [(1.0, 0.0, -inf, inf), (1.0, 0.0, 0.0, inf), (_STEP, -1.0, -1.0, 1.0),
              (_STEP, 1.0, -1.0, 1.0), (_TINY, 0.5, -1.0, 1.0)]  # fmt: skip
    if bounds is not None:  # then +-1 by v > lo and by v >= hi
        for mid, scale in _splits(bounds):
            z_rows.append((scale, -scale * mid, -1.0, 1.0))
    rows = max(len(y_rows), len(z_rows))
    y_rows += [y_rows[1]] * (rows - len(y_rows))  # (padding: K rows each, to pack as a block)
    z_rows += [z_rows[1]] * (rows - len(z_rows))
    if not hist:
        y_rows[0] = y_rows[1]
    shape = (rows,) + (1,) * max(x.dim(), 1)
    columns = [[r[i] for r in y_rows] for i in range(3)] + [
        [r[i] for r in z_rows] for i in range(4)
    ]
    ay, by, my, az, bz, lo, hi = [_constant(c, shape, x.device) for c in columns]
    step = modulus / BINS
    edges = None
    if hist and sorts:
        edges = _constant([0.5 + i * step for i in range(_bins(rows) + 1)], (-1,), x.device)
    return _Plan(rows, bounds is not None, step, ay, by, my, az, bz, lo, hi, edges)


def _constant(values, shape, device) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float64).reshape(shape)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _splits(bounds) -> list[tuple[float, float]]:
    """(midpoint, scale) of the two saturation rows. The thresholds are rounded to float32, in
    which the reference compares them; each midpoint lies halfway from its threshold to the next
    float32 on the unsaturated side, and scale * (v - midpoint) is at least 1 in magnitude for
    every float32 v (so v <= lo and v >= hi are told apart exactly)."""
    lo, hi = bounds
    tol = SATURATION_TOL * (hi - lo)
    out = []
    for t, inward in ((np.float32(lo + tol), np.inf), (np.float32(hi - tol), -np.inf)):
        other = np.nextafter(t, np.float32(inward))
        gap = abs(float(other) - float(t))
        out.append(((float(t) + float(other)) / 2, 2.0 / gap))
    return out


def _bins(rows: int) -> int:
    """Histogram bins, padded to a multiple of the rows so that they pack as a block."""
    return -(-BINS // rows) * rows


def reduce(
    x: torch.Tensor,
    bounds=None,
    unit_axis: int = 1,
    *,
    hist: bool = True,
    slab: int = 1 << 22,
    sorted_from: int | None = None,
) -> tuple[torch.Tensor, Layout]:
    """(packed float64 tensor on x's device, its Layout) for batch x (axis 0 = rows; float32,
    float16, bfloat16, or integers widened to float32); no host sync on a GPU. `hist=False` leaves
    out the quantile sketch. Rows are reduced about `slab` values at a time. With `sorted_from`
    (off the host), a slab of that many values, or any under torch's deterministic algorithms,
    counts its histogram by sorting instead of `histc`'s atomic adds."""
    with torch.no_grad():
        if not x.dtype.is_floating_point:
            x = x.float()
        fmt = FORMATS[x.dtype]
        axis = None if x.dim() < 2 else 1 if x.dim() == 2 else unit_axis % x.dim()
        width = 0 if axis is None else x.shape[axis]
        tracked = bounds if bounds is not None and width else None
        plan = _plan(x, fmt, tracked, hist, sorted_from is not None)
        rows = x.shape[0] if x.dim() else 1
        single = x.numel() == rows
        per_row = x.numel() // max(rows, 1)
        step = max(1, slab // max(1, per_row))
        cuts = [min(step, rows - i) for i in range(0, rows, step)] if x.numel() else [rows]
        layout = Layout(fmt, plan.rows, width, plan.tracked, hist, single, tuple(cuts),
                        tuple(c * per_row // max(width, 1) for c in cuts), unit_axis)  # fmt: skip
        if x.numel() == 0:
            return x.new_zeros(0, dtype=torch.float64), layout
        sort = sorted_from is not None and (
            min(x.numel(), step * per_row) >= sorted_from
            or torch.are_deterministic_algorithms_enabled()
        )
        if len(cuts) == 1:
            return _reduce(x, plan, axis, single, hist, sort), layout
        parts = [_reduce(x[i : i + step], plan, axis, single, hist, sort).reshape(-1)
                 for i in range(0, rows, step)]  # fmt: skip
        return torch.cat(parts), layout


def _reduce(x, plan: _Plan, axis: int | None, single: bool, hist: bool, sort: bool):
    """One slab in a dozen operations (fewer without the histogram or for one value a row)."""
    d = max(x.dim(), 1)
    dims = tuple(i for i in range(1, d + 1) if axis is None or i != axis + 1)
    bits = x.view(FORMATS[x.dtype].ints)
    y = torch.addcmul(plan.by, plan.ay, bits).remainder_(plan.my)
    z = torch.addcmul(plan.bz, plan.az, x).clamp_(plan.lo, plan.hi).nan_to_num_(0.0, 0.0, 0.0)
    pieces = [y.amax(dims), *torch.var_mean(z, dims, correction=0)]
    if not single:
        pieces.append(torch.linalg.vector_norm(z, 2, tuple(range(2, d + 1))))
    if hist:
        h = _histogram(y, plan, sort)
        pieces.append(h if axis is None else h.view(plan.rows, -1))
    return torch.cat(pieces, dim=0 if axis is None else 1)


def _histogram(y: torch.Tensor, plan: _Plan, sort: bool) -> torch.Tensor:
    """Counts of the histogram row's buckets: the other rows lie at or below 0, out of range. A
    sorted slab's keys are searched for the bucket edges instead (no atomic adds to contend on
    the few buckets activations fill, and deterministic)."""
    if not sort:
        bins = _bins(plan.rows)
        return torch.histc(y, bins, 0.5, 0.5 + bins * plan.step)
    keys = torch.sort(y[0].reshape(-1)).values
    assert plan.edges is not None  # a plan for sorted slabs has their edges
    return torch.searchsorted(keys, plan.edges).diff()
