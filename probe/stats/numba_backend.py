"""The numba backend of the statistics: one compiled pass per batch (`probe.stats.kernels`) over a
numpy view, split across torch's OpenMP team (`probe.stats.team`) or threads of our own.

An optional accelerator (the `fast` extra): `probe.stats.backend` picks it on the CPU once its kernels
are compiled, and `probe.stats.torch_backend` is the reference it must equal. Importing this module
imports numba and loads (or compiles) the kernels.
"""

from __future__ import annotations

import threading

import numpy as np

from probe.stats import team
from probe.stats.kernels.gomp import WORK, team_batch
from probe.stats.kernels.packing import finish, fold_packed
from probe.stats.kernels.rows import reduce_rows
from probe.stats.kernels.solo import solo_batch
from probe.stats.parallel import threads
from probe.stats.running import (
    SATURATION_TOL,
    BucketSpans,
    LogHistogram,
    RunningStats,
    UnitStats,
    as_array,
)
from probe.stats.stat_columns import PACKED_AT, PACKED_HEAD, batch_values, by_name
from probe.stats.units import row_l2_sum, units_view

PARALLEL_MIN_VALUES = 1 << 18  # below this a batch is reduced on the calling thread alone
TEAM_MIN_VALUES = (
    1 << 14
)  # torch's idle workers start at once (`probe.stats.team`): worth it sooner
LOW_BITS = {np.dtype(t): t(np.iinfo(t).max) for t in (np.int32, np.int64)}  # all but the sign
# The order key of +Inf per key width; NaN's lie beyond +-Inf's.
INFINITE = {
    np.dtype(np.int32): np.float32(np.inf).view(np.int32),
    np.dtype(np.int64): np.float64(np.inf).view(np.int64),
}


class _Scratch(threading.local):
    """This thread's histogram that batches without a running one count into, before their
    ranges are copied out and zeroed again. int32 counts: a cache-friendlier half the size, and
    a batch with fewer than 2**31 values cannot overflow them."""

    def __init__(self):
        self.hist = LogHistogram(np.zeros(LogHistogram.BINS, dtype=np.int32))


_scratch = _Scratch()


def batch_stats(
    x,
    bounds: tuple[float, float] | None = None,
    hist: LogHistogram | None = None,
    unit_axis: int = 1,
):
    """Statistics of one batch from one compiled pass, split by rows across torch's threads
    (`probe.stats.team`) or else `threads`, or on this thread alone in one call (`solo_batch`). Its values are counted into `hist` (a running histogram),
    or without one into this thread's scratch, whose occupied buckets become its own histogram
    (`BucketSpans`); NaN and Inf are counted apart. Units lie along `unit_axis`."""
    a = as_array(x)
    rows = a.shape[0] if a.ndim else 1
    has_units = a.ndim >= 2
    if a.size == 0:
        return RunningStats(rows=rows, hist=None, unit_axis=unit_axis)
    y, regrouped = units_view(a, unit_axis)
    own = hist is None
    if hist is None:
        hist = _scratch.hist if y.size < 1 << 31 else LogHistogram()
    parts, entry = _split(y)
    lanes = hist.lanes(parts)
    try:
        if entry:
            result = team_batch(y, lanes, own, entry, WORK[lanes.dtype].address)
        elif parts == 1 and y.dtype.char == "f":  # one compiled call, as on the team
            result = solo_batch(y, lanes[0], own)
        else:
            result = _by_threads(y, lanes, parts, own)
    except BaseException:  # e.g. a second Ctrl-C: the scratch must not carry counts to the next
        if own:
            lanes[:] = 0
        raise
    s = _from_result(rows, has_units, result, own)
    s.unit_axis = unit_axis
    if regrouped:  # the pass's rows were tokens: each sample's L2 norm is taken here
        s.l2_sum = row_l2_sum(a, bool(s.nan_count or s.inf_count))
    if has_units and bounds is not None:
        assert s.units is not None  # _from_result gives a batch with units their statistics
        s.units.saturated = saturated_counts(y, bounds)
    return s


def _from_result(rows: int, has_units: bool, packed: np.ndarray, spans: bool) -> RunningStats:
    """RunningStats of a batch from the array `packing.finish` packed it into."""
    width, k, o = _layout(packed)
    s = RunningStats(rows, **by_name(batch_values(packed[:PACKED_HEAD].tolist())), hist=None)
    if spans:  # (the counts as packed: float64 integers, no conversion)
        s.hist = BucketSpans(
            packed[o : o + 2 * k].astype(np.int64).reshape(k, 2), packed[o + 2 * k :]
        )
    if has_units:
        count, sums, lows, highs, positive = packed[PACKED_HEAD:o].reshape(5, width)
        s.units = UnitStats(  # copies: a running one adopting them must not hold `packed`
            count.astype(np.int64),
            sums.copy(),
            lows.copy(),
            highs.copy(),
            positive.astype(np.int64),
        )
    return s


def _layout(packed: np.ndarray) -> tuple[int, int, int]:
    """(units' width, histogram spans k, where the span heads start) of a `packing.finish` result:
    PACKED_HEAD scalars (`stat_columns.PACKED_AT`), then 5 arrays of `width`, then 2k heads, then
    the spans' counts."""
    width = int(packed[0])
    return width, int(packed[1]), PACKED_HEAD + 5 * width


L2_AT, NANS_AT, INFS_AT = PACKED_AT["l2_sum"], PACKED_AT["nan_count"], PACKED_AT["inf_count"]


class Pending:
    """A batch's statistics as the compiled pass packed them, folded straight into running
    ones by `RunningStats.merge` (no RunningStats of its own to build)."""

    __slots__ = ("rows", "packed")

    def __init__(self, rows: int, packed: np.ndarray):
        self.rows, self.packed = rows, packed

    def fold_into(self, s: RunningStats) -> None:
        """Merge into running statistics: the scalars there, the units and histogram spans in
        one compiled call."""
        packed = self.packed
        s.add(self.rows, batch_values(packed[:PACKED_HEAD].tolist()))
        u, width = s.units, int(packed[0])
        if u is None:
            u = s.units = UnitStats.empty(width)
        elif width != len(u.count):
            raise ValueError(f"unit counts differ: {u.count.shape} vs ({width},)")
        fold_packed(packed, s.whole_histogram().counts, u.count, u.sum, u.min, u.max, u.positive)

    @property
    def nan_count(self) -> int:
        return int(self.packed[NANS_AT])

    @property
    def inf_count(self) -> int:
        return int(self.packed[INFS_AT])

    @property
    def buckets(self) -> int:
        """Non-empty histogram buckets (the span counts close the packed array)."""
        _, k, heads = _layout(self.packed)
        return int(np.count_nonzero(self.packed[heads + 2 * k :]))


class HookStats:
    """`batch_stats` for captures taken in a forward's hooks, in as few Python steps as they
    allow: after a convolution each step costs microseconds (its caches are cold). Torch's team
    and this thread's scratch lanes are looked up once per batch (`begin`, on the thread that
    runs the forward); a float32 capture of rows and units is then one numpy view and one
    compiled call, its result a `Pending`. Other captures, and those on another thread, take
    `batch_stats`."""

    def __init__(self):
        self.thread: int | None = None
        self.entry = 0
        self.lanes: np.ndarray | None = None
        self.work = WORK[np.dtype(np.int32)].address

    def begin(self) -> None:
        width, entry = team.entry()
        self.thread = threading.get_ident() if width > 1 else None
        self.entry = entry
        self.lanes = _scratch.hist.lanes(width) if width > 1 else None

    def __call__(
        self, x, bounds: tuple[float, float] | None = None, unit_axis: int = 1
    ) -> RunningStats | Pending:
        if bounds is None and self.thread == threading.get_ident():
            try:
                a = x.numpy()
            except (RuntimeError, TypeError, AttributeError):  # needs grad, bfloat16, ...
                a = None
            if (
                a is not None
                and a.dtype.char == "f"
                and a.ndim >= 2
                and TEAM_MIN_VALUES <= a.size < 1 << 31  # (int32 scratch counts)
                and a.flags.c_contiguous
            ):
                lanes = self.lanes
                assert lanes is not None  # begin() gave this thread its lanes
                y, regrouped = units_view(a, unit_axis)
                try:
                    packed = team_batch(y, lanes, True, self.entry, self.work)
                except BaseException:  # the scratch must not carry counts to the next batch
                    lanes[:] = 0
                    raise
                if regrouped:  # (see batch_stats)
                    packed[L2_AT] = row_l2_sum(a, bool(packed[NANS_AT] or packed[INFS_AT]))
                return Pending(len(a), packed)
        return batch_stats(x, bounds, unit_axis=unit_axis)


def _split(y: np.ndarray) -> tuple[int, int]:
    """How many parts of rows y is reduced in, and on torch's threads (`probe.stats.team`) the
    address of their entry (else 0)."""
    rows = y.shape[0]
    if y.dtype.char == "f" and y.flags.c_contiguous and y.size >= TEAM_MIN_VALUES:
        width, entry = team.entry()
        if min(width, rows) > 1:
            return min(width, rows), entry
    return (min(threads.total, rows) if y.size >= PARALLEL_MIN_VALUES else 1), 0


def _by_threads(y: np.ndarray, lanes: np.ndarray, parts: int, spans: bool) -> tuple:
    """`packing.finish` of y reduced in `parts` parts of rows on `threads`."""
    with np.errstate(over="ignore"):  # float64 beyond float32's range: an Inf bucket, cleared
        bits = (y if y.dtype == np.float32 else y.astype(np.float32)).view(np.uint32)
    keys = y.view(np.int32 if y.dtype == np.float32 else np.int64)
    low_bits, infinite = LOW_BITS[keys.dtype], INFINITE[keys.dtype]
    rows, units = y.shape[:2]
    outs = (
        np.empty((parts, 4)),
        np.empty((parts, 5), np.int64),
        np.empty((parts, 3, units)),
        np.empty((parts, 2, units), np.int64),
    )
    cuts = [rows * i // parts for i in range(parts + 1)]
    threads.run(
        reduce_rows,
        [
            (y[i:j], bits[i:j], keys[i:j], low_bits, infinite, lanes[p], *(o[p] for o in outs))
            for p, (i, j) in enumerate(zip(cuts[:-1], cuts[1:], strict=True))
        ],
    )
    return finish(*outs, low_bits, keys, y, lanes, spans)


def saturated_counts(y: np.ndarray, bounds: tuple[float, float]) -> np.ndarray:
    """Per unit of y (rows, units, rest): finite values within SATURATION_TOL of the range from
    a bound (bounded activations only, so this extra pass is rare)."""
    lo, hi = bounds
    tol = SATURATION_TOL * (hi - lo)
    near = ((y <= lo + tol) | (y >= hi - tol)) & np.isfinite(y)
    return near.sum(axis=(0, 2))
