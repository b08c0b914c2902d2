"""Per-batch statistics in torch, on the tensor's own device: the kernels' portable reference,
and the path that picks between it and the fused reduction (`probe.stats.fused`).

The same quantities as `probe.stats.backend.batch_stats`. `reduce` packs a batch into one float64
vector (PACKED_HEAD scalars, the batch accumulator at `stat_columns.PACKED_AT`; UNIT_ROWS rows of
per-unit values; BINS histogram counts) without syncing with the host on CUDA, so a caller can
queue it and copy it back when it likes; `unpack` turns the host copy into a `RunningStats`. Rows are reduced in slabs, merged exactly, to keep temporaries small.

`on_device` and `batch_stats` take the fused reduction (a dozen operations a batch) off the host
and this reference (dozens of short operations, faster on a CPU) on it; `PROBE_TORCH_REDUCTION`
(auto, fused or reference) or `use_reduction` chooses otherwise. float64 batches always take the
reference.
"""

from __future__ import annotations

import math
import os
import sys
import threading
from typing import NamedTuple

import numpy as np
import torch

from probe.errors import ConfigError
from probe.stats import fused
from probe.stats.running import SATURATION_TOL, LogHistogram, RunningStats, UnitStats
from probe.stats.stat_columns import (
    BATCH_AT,
    BATCH_NAMES,
    PACKED_AT,
    PACKED_HEAD,
    batch_values,
    by_name,
)

_FIRST, _END = PACKED_AT[BATCH_NAMES[0]], PACKED_AT[BATCH_NAMES[-1]] + 1  # the accumulator
_N, _NANS, _INFS = BATCH_AT["n"], BATCH_AT["nan_count"], BATCH_AT["inf_count"]
UNIT_ROWS = 6
BINS = 1 << 16
SLAB_HOST = 1 << 19  # values per slab on the CPU: its float64 copies stay in L3 (fastest there)
SLAB_DEVICE = 1 << 22  # on a GPU: 32 MiB float64 temporaries, few launches
# from this many values a GPU histogram sorts its keys: index_add_'s atomics contend on the few
# buckets activations fill (H100, 6.4M ReLU values: 2.4 ms against 0.42 ms; at 1M: 0.09 vs 0.12)
SORTED_HISTOGRAM = 1 << 21
EXACT_F32 = 1 << 24  # float32 sums of 0 and +-1 stay exact up to this many values
_HIGH = 1 if sys.byteorder == "little" else 0  # the 16-bit half of a float32 with its top bits
_INT = {torch.float32: (torch.int32, 32), torch.float64: (torch.int64, 64)}
_CLEARED = ((0x7F80, 0x8000), (0xFF80, BINS))  # NaN and Inf buckets: never a finite value


class _Part(NamedTuple):
    """A slab's statistics: per unit (count, sum, M2 about the unit's mean, extremes as order
    keys, positive and saturated counts), then 0-d scalars and the histogram. (`counts`, not
    `count`: a NamedTuple's field would hide tuple.count.)"""

    counts: torch.Tensor
    sums: torch.Tensor
    m2: torch.Tensor
    low: torch.Tensor
    high: torch.Tensor
    positive: torch.Tensor
    saturated: torch.Tensor | None
    abs_sum: torch.Tensor
    zeros: torch.Tensor
    nans: torch.Tensor
    l2: torch.Tensor
    hist: torch.Tensor


def reduce(
    x: torch.Tensor, bounds: tuple[float, float] | None = None, unit_axis: int = 1
) -> torch.Tensor:
    """The packed statistics of batch x (axis 0 = rows, units along `unit_axis`) on x's device.
    On the CPU on one thread: a batch is dozens of short operations, and a parallel one waits
    for every core, so on a shared machine each is a chance to stall (a conv1 batch of resnet18
    at 224 px: 250 ms on two busy cores, 56 ms on one)."""
    threads = torch.get_num_threads()
    if x.device.type != "cpu" or threads == 1:
        return _reduce(x, bounds, unit_axis)
    torch.set_num_threads(1)
    try:
        return _reduce(x, bounds, unit_axis)
    finally:
        torch.set_num_threads(threads)


def _reduce(x: torch.Tensor, bounds, unit_axis: int) -> torch.Tensor:
    x = x.detach()
    if x.dtype not in _INT:  # half precision, bfloat16, integers: widened, as the kernels do
        x = x.float()
    width = _width(x.shape, unit_axis)
    tracked = bounds is not None and width > 0
    out = torch.zeros(PACKED_HEAD + UNIT_ROWS * width + BINS, dtype=torch.float64, device=x.device)
    # fill_ with a Python number launches a kernel; `out[0] = n` copies a host scalar (a sync)
    out[0:1].fill_(width)
    out[1:2].fill_(float(tracked))
    units = out[PACKED_HEAD : PACKED_HEAD + UNIT_ROWS * width].view(UNIT_ROWS, width)
    if x.numel() == 0:
        low, high = PACKED_AT["min"], PACKED_AT["max"]
        for row, value in ((out[low : low + 1], torch.inf), (out[high : high + 1], -torch.inf),
                           (units[2], torch.inf), (units[3], -torch.inf)):  # fmt: skip
            row.fill_(value)
        return out
    near = _thresholds(bounds, x.dtype) if tracked else None
    rows = x.shape[0] if x.dim() else 1
    step = max(1, (SLAB_HOST if _host(x.device) else SLAB_DEVICE) // (x.numel() // rows))
    acc = None
    for i in range(0, rows, step):
        part = x[i : i + step] if x.dim() else x
        y, regrouped = _units_view(part, unit_axis)
        single = not regrouped and y.shape[1] * y.shape[2] == 1
        if y.shape[2] == 1:  # (rows', units): per-unit reductions over one axis run faster
            y = y.reshape(y.shape[:2])
        p = _slab(y.contiguous(), len(part) if x.dim() else 1, single, near)
        acc = p if acc is None else _merge(acc, p)
    if acc is None:  # (x holds values: at least one slab)
        raise RuntimeError("a batch with values reduced no slab")
    count = acc.counts
    n = count.sum()
    mean = acc.sums.sum() / n.clamp_min(1)
    m2 = acc.m2.sum() + (count * (acc.sums / count.clamp_min(1) - mean).square()).sum()
    lows = torch.where(count > 0, _value(acc.low, x.dtype), torch.inf)
    highs = torch.where(count > 0, _value(acc.high, x.dtype), -torch.inf)
    infs = x.numel() - n - acc.nans
    batch = {"n": n, "mean": mean, "m2": m2, "min": _first(lows, lows.amin()),
             "max": _first(highs, highs.amax()), "abs_sum": acc.abs_sum, "zeros": acc.zeros,
             "nan_count": acc.nans, "inf_count": infs, "l2_sum": acc.l2}  # fmt: skip
    out[_FIRST:_END] = torch.stack([batch[name] for name in BATCH_NAMES])
    if width:
        saturated = acc.saturated if tracked else torch.zeros_like(count)
        if saturated is None:  # (tracked bounds: every slab counted its saturated values)
            raise RuntimeError("tracked bounds without saturated counts")
        torch.stack([count, acc.sums, lows, highs, acc.positive, saturated], out=units)
    for lo, hi in _CLEARED:
        acc.hist[lo:hi].fill_(0)
    out[PACKED_HEAD + UNIT_ROWS * width :] = acc.hist
    return out


def unpack(packed: np.ndarray, rows: int, unit_axis: int = 1) -> RunningStats:
    """A `RunningStats` from the host copy of a `reduce` result; an empty batch (no value at all)
    has no histogram, as `probe.stats.backend.batch_stats` gives it."""
    return _unpack(packed, rows, unit_axis, hist=True)


def unpack_without_histogram(packed: np.ndarray, rows: int, unit_axis: int = 1) -> RunningStats:
    """`unpack` of a `reduce` result whose histogram was left on its device (the packed head and
    units alone: probe.stats.device_histograms.split); no histogram."""
    return _unpack(packed, rows, unit_axis, hist=False)


def _unpack(packed: np.ndarray, rows: int, unit_axis: int, hist: bool) -> RunningStats:
    p = np.asarray(packed, dtype=np.float64)
    width, tracked = int(p[0]), bool(p[1])
    batch = batch_values(p[:PACKED_HEAD].tolist())
    if batch[_N] + batch[_NANS] + batch[_INFS] == 0:
        return RunningStats(rows=rows, hist=None, unit_axis=unit_axis)
    units = None
    if width:
        count, sums, lows, highs, positive, saturated = p[
            PACKED_HEAD : PACKED_HEAD + UNIT_ROWS * width
        ].reshape(UNIT_ROWS, width)
        units = UnitStats(
            count.astype(np.int64),
            sums.copy(),
            lows.copy(),
            highs.copy(),
            positive.astype(np.int64),
            saturated.astype(np.int64) if tracked else None,
        )
    counts = LogHistogram(p[PACKED_HEAD + UNIT_ROWS * width :].astype(np.int64)) if hist else None
    return RunningStats(rows, **by_name(batch), hist=counts, units=units, unit_axis=unit_axis)


REDUCTION_ENV = "PROBE_TORCH_REDUCTION"
REDUCTIONS = ("auto", "fused", "reference")
_reduction: str | None = None  # this process's choice (None: the environment's, else auto)


def use_reduction(name: str | None) -> None:
    """Reduce this process's batches with `name` (auto, fused or reference) from now on; None
    goes back to PROBE_TORCH_REDUCTION's or auto."""
    global _reduction
    if name is not None and name not in REDUCTIONS:
        raise ConfigError(
            f"torch reduction {name!r} is unknown; choose from {', '.join(REDUCTIONS)}"
        )
    _reduction = name


def takes_fused(x: torch.Tensor) -> bool:
    """Whether x is reduced by the fused path: auto takes it off the host; float64 never."""
    name = _reduction or os.environ.get(REDUCTION_ENV) or "auto"
    if name not in REDUCTIONS:
        raise ConfigError(
            f"{REDUCTION_ENV}={name!r} is unknown; choose from {', '.join(REDUCTIONS)}"
        )
    if name == "reference" or not fused.supports(x):
        return False
    return name == "fused" or not _host(x.device)


def on_device(x: torch.Tensor, bounds=None, unit_axis: int = 1):
    """(packed tensor on x's device, unpack) for batch x without a host sync on a GPU: `unpack`
    makes a `RunningStats` of the packed tensor's host copy (as a numpy array)."""
    rows = x.shape[0] if x.dim() else 1
    if takes_fused(x):
        sorted_from = None if _host(x.device) else SORTED_HISTOGRAM
        packed, layout = fused.reduce(
            x, bounds, unit_axis, slab=SLAB_DEVICE, sorted_from=sorted_from
        )
        return packed, layout.unpack
    return reduce(x, bounds, unit_axis), lambda p: unpack(p, rows, unit_axis)


def packed_on_device(x: torch.Tensor, bounds=None, unit_axis: int = 1):
    """(packed tensor on x's device, its fused Layout, or None: the reference's packing, whose
    units are `width`): `on_device`'s reduction, for a caller that reads the pack itself
    (probe.stats.device_histograms)."""
    if takes_fused(x):
        sorted_from = None if _host(x.device) else SORTED_HISTOGRAM
        packed, layout = fused.reduce(
            x, bounds, unit_axis, slab=SLAB_DEVICE, sorted_from=sorted_from
        )
        return packed, layout, layout.width
    return reduce(x, bounds, unit_axis), None, _width(x.shape, unit_axis)


def batch_stats(x, bounds=None, unit_axis: int = 1) -> RunningStats:
    """`on_device`, one copy to the host, its unpack: x a torch tensor on any device or an array."""
    if not isinstance(x, torch.Tensor):
        x = torch.from_numpy(_native(x))
    rows = x.shape[0] if x.dim() else 1
    if x.numel() == 0:
        return RunningStats(rows=rows, hist=None, unit_axis=unit_axis)
    packed, read = on_device(x, bounds, unit_axis)
    return read(packed.cpu().numpy())


def _native(x) -> np.ndarray:
    """An array torch can view: float32 unless float32 or float64, native byte order, writable."""
    a = np.asarray(x)
    if a.dtype.char not in "fd":
        a = a.astype(np.float32)
    elif not a.dtype.isnative:
        a = a.astype(a.dtype.newbyteorder("="))
    return a if a.flags.writeable else a.copy()


def _host(device: torch.device) -> bool:
    """Whether reading a value back costs nothing (the CPU): the fast paths that branch on the
    data, and bincount, are taken there only."""
    return device.type == "cpu"


def _width(shape: torch.Size, axis: int) -> int:
    """How many units a batch of this shape has (none below two dimensions), as `_units_view`."""
    if len(shape) < 2:
        return 0
    axis %= len(shape)
    return shape[1] if len(shape) == 2 or axis == 1 else shape[axis]


def _units_view(a: torch.Tensor, axis: int) -> tuple[torch.Tensor, bool]:
    """`probe.stats.units.units_view` in torch: (rows', units, rest), and whether rows' are tokens."""
    if a.dim() < 2:
        return a.reshape(len(a) if a.dim() else 1, 1, -1), False
    axis %= a.dim()
    if a.dim() == 2 or axis == 1:
        return a.reshape(a.shape[0], a.shape[1], -1), False
    if axis == a.dim() - 1:
        return a.reshape(-1, a.shape[-1], 1), True
    return a.movedim(axis, 1).reshape(a.shape[0], a.shape[axis], -1), False


def _thresholds(bounds: tuple[float, float], dtype: torch.dtype) -> tuple[float, float]:
    """The saturation thresholds rounded to the values' dtype, in which numpy compares them."""
    lo, hi = bounds
    tol = SATURATION_TOL * (hi - lo)
    low, high = (float(torch.tensor(t, dtype=dtype)) for t in (lo + tol, hi - tol))
    return low, high


def _slab(y: torch.Tensor, rows: int, single: bool, near) -> _Part:
    """The statistics of y (rows', units, rest) or (rows', units), over its finite values; `rows`
    of the batch's own (rows' are tokens for units on the last axis). On the CPU a slab whose
    units' extremes are finite (so all its values are: NaN propagates) skips the masking."""
    f64, shape, device = torch.float64, y.shape, y.device
    dims, rest = ((0, 2), shape[2]) if y.dim() == 3 else ((0,), 1)
    lo, hi = y.amin(dims), y.amax(dims)
    host = _host(device)
    if host and bool(torch.isfinite(lo).all() and torch.isfinite(hi).all()):
        fin, v, low_src, high_src = None, y, y, y
        count = torch.full(lo.shape, shape[0] * rest, dtype=f64, device=device)
        nans = count.new_zeros(())
    else:
        fin = torch.isfinite(y)
        low_src, high_src = torch.where(fin, y, torch.inf), torch.where(fin, y, -torch.inf)
        lo, hi = low_src.amin(dims), high_src.amax(dims)
        v = torch.where(fin, y, 0.0)
        count = fin.sum(dims, dtype=f64)
        nans = torch.isnan(y).sum(dtype=f64)
    ints, bits = _INT[y.dtype]
    if not host or bool(((lo == 0) | (hi == 0)).any()):  # which zero: any value of that sign?
        lo = torch.where((lo == 0) & (low_src.view(ints).amin(dims) < 0), -0.0, lo)
        hi = torch.where((hi == 0) & (high_src.view(ints).amax(dims) >= 0), 0.0, hi)
    xd = v if v.dtype == f64 else _buffer("v", shape, f64, device).copy_(v)
    scratch = _buffer("d", shape, f64, device)  # (xd may be the caller's batch: never written)
    sums = xd.sum(2).sum(0) if rest > 1 else xd.sum(0)
    l2 = torch.linalg.vector_norm(xd.view(rows, -1), dim=1).sum()
    mean = sums / count.clamp_min(1)
    torch.sub(xd, mean[:, None] if rest > 1 else mean, out=scratch)  # two-pass M2 per unit
    if fin is not None:
        scratch.mul_(fin)
    if rest > 1:
        m2 = torch.linalg.vector_norm(scratch, dim=2).square_().sum(0)
    else:
        m2 = scratch.square_().sum(0)  # (vector_norm across rows runs 10x slower)
    abs_sum = torch.abs(xd, out=scratch).sum()
    if single:  # a row of one value: its norm is |v| (as the kernels take it, never overflowing)
        l2 = abs_sum
    sign = torch.sign(v, out=_buffer("sign", shape, v.dtype, device))
    tally = v.dtype if v.numel() <= EXACT_F32 else f64
    signed = sign.sum(dims, dtype=tally).to(f64)  # positive - negative
    nonzero = sign.abs_().sum(dims, dtype=tally).to(f64)  # positive + negative
    saturated = None
    if near is not None:
        hit = torch.le(v, near[0], out=_buffer("low", shape, torch.bool, device))
        hit |= torch.ge(v, near[1], out=_buffer("high", shape, torch.bool, device))
        if fin is not None:
            hit &= fin
        saturated = hit.sum(dims, dtype=f64)
    low, high = _key(lo, ints, bits), _key(hi, ints, bits)
    positive, zeros = (signed + nonzero) / 2, count.sum() - nonzero.sum()
    return _Part(count, sums, m2, low, high, positive, saturated, abs_sum, zeros, nans, l2,
                 _histogram(y))  # fmt: skip


def _histogram(y: torch.Tensor) -> torch.Tensor:
    """int64 counts of the top 16 bits of each value's float32 pattern (float64 values rounded;
    beyond float32's range they become Inf). Off the host without bincount, which syncs."""
    f = y
    if y.dtype != torch.float32:
        f = _buffer("f32", y.shape, torch.float32, y.device).copy_(y)
    if _host(f.device):
        top = f.view(torch.uint16).view(-1)[_HIGH::2]
        top = _buffer("top", top.shape, torch.int32, f.device).copy_(top)
        return torch.bincount(top, minlength=BINS)
    if f.numel() >= SORTED_HISTOGRAM:  # sorted keys and a search: no atomics to contend on
        keys = torch.sort(f.view(torch.int32).view(-1).bitwise_right_shift(16).bitwise_and_(0xFFFF))
        edges = torch.arange(BINS + 1, dtype=torch.int32, device=f.device)
        return torch.searchsorted(keys.values, edges).diff().to(torch.int64)
    top = f.view(torch.int16).view(-1)[_HIGH::2].to(torch.int64).bitwise_and_(0xFFFF)
    one = torch.ones((), dtype=torch.int64, device=f.device).expand(top.numel())
    return torch.zeros(BINS, dtype=torch.int64, device=f.device).index_add_(0, top, one)


def _merge(a: _Part, b: _Part) -> _Part:
    """Two slabs' statistics as one: Chan's formula per unit for the moments."""
    count = a.counts + b.counts
    delta = b.sums / b.counts.clamp_min(1) - a.sums / a.counts.clamp_min(1)
    m2 = a.m2 + b.m2 + delta.square() * a.counts * b.counts / count.clamp_min(1)
    # (both slabs track saturation or neither: one batch's bounds)
    saturated = None if a.saturated is None or b.saturated is None else a.saturated + b.saturated
    low, high = torch.minimum(a.low, b.low), torch.maximum(a.high, b.high)
    return _Part(count, a.sums + b.sums, m2, low, high, a.positive + b.positive, saturated,
                 a.abs_sum + b.abs_sum, a.zeros + b.zeros, a.nans + b.nans, a.l2 + b.l2,
                 a.hist.add_(b.hist))  # fmt: skip


class _Scratch(threading.local):
    """This thread's CPU buffers, reused across slabs and batches (13 MiB at most): fresh pages
    for each temporary cost more than the passes that fill them (a fault per 4 KiB)."""

    def __init__(self):
        self.buffers: dict = {}


_scratch = _Scratch()


def _buffer(name: str, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor: on the host a view of this thread's buffer `name`, else a new
    one (CUDA's caching allocator reuses its blocks)."""
    size = math.prod(shape)
    if not _host(device) or size > SLAB_HOST:  # (a slab of one huge row is not kept)
        return torch.empty(shape, dtype=dtype, device=device)
    buf = _scratch.buffers.get((name, dtype))
    if buf is None or len(buf) < size:
        with torch.inference_mode(False):  # (one made in a run's inference mode stays read-only)
            buf = _scratch.buffers[name, dtype] = torch.empty(size, dtype=dtype)
    return buf[:size].view(shape)


def _key(values: torch.Tensor, ints: torch.dtype, bits: int) -> torch.Tensor:
    """Integers that sort as the floats do, -0.0 below +0.0 (`kernels.keys.order_key`); the map is
    its own inverse."""
    k = values.view(ints)
    return k ^ ((k >> (bits - 1)) & ((1 << (bits - 1)) - 1))


def _value(keys: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    ints, bits = _INT[dtype]
    return _key(keys, ints, bits).view(dtype).to(torch.float64)


def _first(values: torch.Tensor, extreme: torch.Tensor) -> torch.Tensor:
    """The first of `values` equal to `extreme`: the kernels compare the units' extremes as
    floats, keeping the first of +0.0 and -0.0."""
    at = (values == extreme).to(torch.uint8).argmax()
    return values.index_select(0, at.view(1)).squeeze(0)
