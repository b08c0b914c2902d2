"""Many one-row batches reduced together: the statistics of a model's parameters (their values,
gradients or updates, each one row whose units lie along its first axis) in a few dozen
operations for the whole model, instead of a dozen or more per tensor.

The tensors of one device and one dtype are laid end to end; each value knows its unit and each
unit its tensor (index tensors made once per list of shapes and kept). Per unit, segment sums
(`index_add_`) give the counts, sums, two-pass moments, positive counts; segment extremes
(`scatter_reduce_` over order keys) the lowest and highest values, -0.0 below +0.0; per tensor,
the same sums over its units give the batch's accumulator, and one `index_add_` over (tensor,
bucket) keys its quantile sketch. The result is each tensor's packed batch in the reference's
layout (`probe.stats.torch_backend.reduce`: the head, the units' rows, the histogram), so that
`torch_backend.unpack` reads it, with the same counts, extremes and histograms and the moments
within float64 rounding (tests/stats/test_batched.py). Nothing waits for the device.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from probe.stats.stat_columns import BATCH_NAMES, PACKED_AT, PACKED_HEAD
from probe.stats.torch_backend import _CLEARED, _INT, BINS, UNIT_ROWS, _key, _value

_FIRST = PACKED_AT[BATCH_NAMES[0]]


# values reduced together at most: the temporaries (about 60 bytes a value) stay near 500 MB
CHUNK = 1 << 23


def supports(x: torch.Tensor) -> bool:
    """Floating tensors (half precision and bfloat16 widened to float32, as the kernels do)."""
    return x.dtype.is_floating_point


@dataclass(frozen=True)
class _Layout:
    """Where each value, unit and tensor of one list of shapes lies, on one device."""

    numel: tuple[int, ...]
    units: tuple[int, ...]  # each tensor's units (0: a value alone, no unit rows)
    values: int  # all the tensors' values
    unit_values: torch.Tensor  # (units,) each unit's values (the per-value indices: `_per_value`)
    tensor_of_unit: torch.Tensor  # (units,) each unit's tensor
    first_unit: torch.Tensor  # (tensors,) each tensor's first unit
    sizes: tuple[int, ...]  # each tensor's packed size
    head_at: torch.Tensor  # (tensors, PACKED_HEAD) where each head's values go in the output
    units_at: torch.Tensor  # (UNIT_ROWS, written units) where each unit's rows go
    hist_at: torch.Tensor  # (tensors, BINS) where each histogram goes
    written: torch.Tensor  # (written units,) the units with rows (those of tensors with units)
    widths: torch.Tensor  # (tensors,) float64 each tensor's units
    numels: torch.Tensor  # (tensors,) float64 each tensor's values


class _Layouts(threading.local):
    def __init__(self):
        self.cache: dict = {}


_layouts = _Layouts()


def _layout(shapes: tuple[torch.Size, ...], device: torch.device) -> _Layout:
    key = (shapes, device)
    found = _layouts.cache.get(key)
    if found is None:
        found = _layouts.cache[key] = _make_layout(shapes, device)
    return found


def _make_layout(shapes: tuple[torch.Size, ...], device: torch.device) -> _Layout:
    numel = tuple(math.prod(s) for s in shapes)
    units = tuple(s[0] if len(s) >= 1 else 0 for s in shapes)
    unit_values, tensor_of_unit, first_unit = [], [], []
    sizes, head_at, hist_at = [], [], []
    units_at: list[list] = [[] for _ in range(UNIT_ROWS)]  # (None: a tensor without rows)
    u0, at = 0, 0
    for i, (n, u) in enumerate(zip(numel, units, strict=True)):
        width = max(u, 1)  # (a value alone: one unit of its own, not written)
        rest = n // width if n else 0
        unit_values.append(torch.full((width,), rest))
        tensor_of_unit.append(torch.full((width,), i))
        first_unit.append(u0)
        size = PACKED_HEAD + UNIT_ROWS * u + BINS
        head_at.append(torch.arange(PACKED_HEAD) + at)
        for r in range(UNIT_ROWS):
            units_at[r].append(at + PACKED_HEAD + r * u + torch.arange(u) if u else None)
        hist_at.append(at + PACKED_HEAD + UNIT_ROWS * u + torch.arange(BINS))
        sizes.append(size)
        u0, at = u0 + width, at + size
    # units of tensors with no unit rows are left out of units_at (their rows are not written)
    with_rows = [t for t in range(len(shapes)) if units[t]]
    unit_rows = [torch.cat([units_at[r][t] for t in with_rows]) if with_rows else torch.zeros(0)
                 for r in range(UNIT_ROWS)]  # fmt: skip
    written = [first_unit[t] + i for t in with_rows for i in range(units[t])]
    on = lambda t: t.to(device=device, dtype=torch.int64)  # noqa: E731
    f64 = lambda t: torch.tensor(t, dtype=torch.float64).to(device)  # noqa: E731
    return _Layout(
        numel, units, sum(numel), on(torch.cat(unit_values)),
        on(torch.cat(tensor_of_unit)), on(torch.tensor(first_unit)), tuple(sizes),
        on(torch.stack(head_at)), on(torch.stack(unit_rows)), on(torch.stack(hist_at)),
        on(torch.tensor(written, dtype=torch.int64)), f64(units), f64(numel),
    )  # fmt: skip


def reduce_many(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor of `tensors` (one device, one floating dtype; each one row, its units along
    its first axis) as its packed batch in the reference's layout, on the device."""
    x0 = tensors[0]
    dtype = x0.dtype if x0.dtype in _INT else torch.float32
    device = x0.device
    layout = _layout(tuple(t.shape for t in tensors), device)
    f64 = torch.float64
    v = torch.cat([t.detach().reshape(-1).to(dtype) for t in tensors])
    n_units, n_tensors = len(layout.tensor_of_unit), len(tensors)
    unit_of, tensor_of = _per_value(layout)
    fin = torch.isfinite(v)
    xd = torch.where(fin, v, 0.0).to(f64)

    def per_unit(values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(n_units, dtype=f64, device=device).index_add_(0, unit_of, values)

    def per_tensor(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return torch.zeros(n_tensors, dtype=f64, device=device).index_add_(0, index, values)

    count = per_unit(fin.to(f64))
    sums = per_unit(xd)
    mean_u = sums / count.clamp_min(1)
    m2_u = per_unit((xd - mean_u[unit_of]).mul_(fin).square_())  # two passes per unit
    positive = per_unit((xd > 0).to(f64))  # (finite values: the others count as 0)
    nonzero = per_unit(((v != 0) & fin).to(f64))
    ints, bits = _INT[dtype]
    low_keys = _key(torch.where(fin, v, torch.inf), ints, bits)
    high_keys = _key(torch.where(fin, v, -torch.inf), ints, bits)
    low = torch.full((n_units,), torch.iinfo(ints).max, dtype=ints, device=device)
    low.scatter_reduce_(0, unit_of, low_keys, "amin")
    high = torch.full((n_units,), torch.iinfo(ints).min, dtype=ints, device=device)
    high.scatter_reduce_(0, unit_of, high_keys, "amax")
    lows = torch.where(count > 0, _value(low, dtype), torch.inf)
    highs = torch.where(count > 0, _value(high, dtype), -torch.inf)
    # per tensor: its units' sums (Chan's formula across them for M2)
    of_unit = layout.tensor_of_unit
    n = per_tensor(count, of_unit)
    total = per_tensor(sums, of_unit)
    mean = total / n.clamp_min(1)
    m2 = per_tensor(m2_u + count * (mean_u - mean[of_unit]).square(), of_unit)
    nans = per_tensor(torch.isnan(v).to(f64), tensor_of)
    numel = layout.numels
    abs_sum = per_tensor(xd.abs(), tensor_of)
    l2 = per_tensor(xd.square(), tensor_of).sqrt_()
    single = numel == 1  # (a one-value row's norm is |v|, as the kernels take it)
    l2 = torch.where(single, abs_sum, l2)
    zeros = n - per_tensor(nonzero, of_unit)
    low_t = _first_of(lows, of_unit, n_tensors, torch.minimum, torch.inf)
    high_t = _first_of(highs, of_unit, n_tensors, torch.maximum, -torch.inf)
    batch = {"n": n, "mean": mean, "m2": m2, "min": low_t, "max": high_t, "abs_sum": abs_sum,
             "zeros": zeros, "nan_count": nans, "inf_count": numel - n - nans,
             "l2_sum": l2}  # fmt: skip
    head = torch.zeros(n_tensors, PACKED_HEAD, dtype=f64, device=device)
    head[:, 0] = layout.widths
    head[:, _FIRST : _FIRST + len(BATCH_NAMES)] = torch.stack([batch[k] for k in BATCH_NAMES], 1)
    out = torch.zeros(sum(layout.sizes), dtype=f64, device=device)
    out.index_copy_(0, layout.head_at.reshape(-1), head.reshape(-1))
    if layout.units_at.numel():
        rows = torch.stack([count, sums, lows, highs, positive, torch.zeros_like(count)])
        rows = rows.index_select(1, layout.written)
        out.index_copy_(0, layout.units_at.reshape(-1), rows.reshape(-1))
    hists = _histograms(v, tensor_of, n_tensors)
    out.index_copy_(0, layout.hist_at.reshape(-1), hists.reshape(-1))
    return list(out.split(layout.sizes))


def _first_of(values: torch.Tensor, of_unit: torch.Tensor, n_tensors: int, pick, empty: float):
    """Per tensor the extreme of its units' `values` as the first unit holding it has it (a
    zero's sign: the reference takes the first unit's extreme equal to the batch's)."""
    extreme = torch.full((n_tensors,), empty, dtype=values.dtype, device=values.device)
    extreme.scatter_reduce_(0, of_unit, values, "amin" if pick is torch.minimum else "amax")
    hit = values == extreme[of_unit]
    index = torch.arange(len(values), device=values.device)
    first = torch.full((n_tensors,), len(values), dtype=torch.int64, device=values.device)
    first.scatter_reduce_(0, of_unit, torch.where(hit, index, len(values)), "amin")
    found = values[first.clamp_max(len(values) - 1)]
    return torch.where(first < len(values), found, extreme)


def _per_value(layout: _Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """(each value's unit, each value's tensor), made for one call (16 bytes a value: not kept;
    `output_size` spares the device a synchronisation)."""
    units = torch.arange(len(layout.unit_values), device=layout.unit_values.device)
    unit_of = torch.repeat_interleave(units, layout.unit_values, output_size=layout.values)
    return unit_of, layout.tensor_of_unit[unit_of]


def _histograms(v: torch.Tensor, tensor_of: torch.Tensor, n_tensors: int) -> torch.Tensor:
    """(tensors, BINS) float64 counts of the top 16 bits of each value's float32 pattern, per
    tensor (NaN and Inf buckets cleared)."""
    f = v if v.dtype == torch.float32 else v.to(torch.float32)
    top = f.view(torch.int32).bitwise_right_shift(16).bitwise_and_(0xFFFF).to(torch.int64)
    keys = tensor_of * BINS + top
    one = torch.ones((), dtype=torch.float64, device=v.device).expand(len(v))
    hist = torch.zeros(n_tensors * BINS, dtype=torch.float64, device=v.device)
    hist.index_add_(0, keys, one)
    hist = hist.view(n_tensors, BINS)
    for lo, hi in _CLEARED:
        hist[:, lo:hi].zero_()
    return hist
