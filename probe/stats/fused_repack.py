"""A fused reduction's result (without its histogram) read on its own device into the torch
reference's packing: the batch's accumulator at `stat_columns.PACKED_AT` and its units' rows
(`probe.stats.torch_backend.unpack_without_histogram` reads it), the same numbers
`fused.Layout.unpack` computes on the host from the whole result, computed where the result
lies, so that a run merges the units' rows there (probe.stats.device_sketch) and sends the host
the batch's scalars alone.

Each step mirrors `fused.Layout._slab` (the levels' counts, the extremes from the rotated bit
patterns, Chan's formula across units) and `RunningStats.merge` across slabs (Chan's formula, the
first of equal extremes kept, numpy's `minimum`/`maximum` for the units), element for element:
the per-unit rows equal the host's exactly, the batch's sums agree within float64 rounding
(torch and numpy add many values in different orders). Nothing here reads a value on the host.
"""

from __future__ import annotations

import dataclasses

import torch

from probe.stats.fused import Layout, _Format
from probe.stats.stat_columns import BATCH_NAMES, PACKED_FIRST, PACKED_HEAD

UNIT_ROWS = 6  # count, sum, min, max, positive, saturated (the reference's units)
_ADDED = ("abs_sum", "zeros", "nan_count", "inf_count", "l2_sum")


def repacked(packed: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The reference's packing (head, then UNIT_ROWS x width units; no histogram) of a fused
    result whose histogram was taken out (`layout.hist` False: probe.stats.device_histograms
    .split's rest), float64 on its device."""
    layout = dataclasses.replace(layout, hist=False)
    width, device = layout.width, packed.device
    out = torch.zeros(PACKED_HEAD + UNIT_ROWS * width, dtype=torch.float64, device=device)
    out[0:1].fill_(width)  # (fill_ with a Python number: no copy from the host)
    out[1:2].fill_(float(layout.tracked))
    if packed.numel() == 0:  # no value: nothing counted (the reader sees an empty batch)
        return out
    acc: dict | None = None
    at = 0
    for rows, n in zip(layout.slab_rows, layout.per_unit, strict=True):
        size = layout._size(rows)
        slab = _slab(layout, packed[at : at + size], rows, n)
        at += size
        acc = slab if acc is None else _merge(acc, slab)
    assert acc is not None  # (a result with values has a slab)
    out[PACKED_FIRST : PACKED_FIRST + len(BATCH_NAMES)] = torch.stack(
        [acc[name] for name in BATCH_NAMES]
    )
    if width:
        units = [acc["u_" + k] for k in ("count", "sum", "min", "max", "positive", "saturated")]
        torch.stack(units, out=out[PACKED_HEAD:].view(UNIT_ROWS, width))
    return out


def _rint(x: torch.Tensor) -> torch.Tensor:
    return torch.round(x)  # (half to even, as numpy's rint)


def _slab(layout: Layout, block: torch.Tensor, rows: int, n: int) -> dict:
    """`fused.Layout._slab` in torch: one slab's accumulator and units, by name."""
    ext, var, mean, norms, _ = layout._pieces(block, rows)
    sums, squares = mean * n, (var + mean * mean) * n
    fin = _rint((squares[2] - squares[4]) / 0.75)
    infinite = _rint(squares[2] - fin)
    plus = _rint((infinite + sums[4] - 0.5 * fin) / 2)
    minus = infinite - plus
    positive = _rint((sums[2] + fin + minus - plus) / 2)
    negative = _rint((fin + plus - minus - sums[3]) / 2)
    value_sums = sums[0]
    unit_mean = torch.where(fin > 0, value_sums / fin.clamp_min(1), 0.0)
    masked = n - fin
    unit_m2 = var[0] * n - unit_mean.square() * fin * masked / n
    unit_m2 = torch.where(unit_m2 > 0.0, unit_m2, 0.0)  # (numpy's maximum(x, 0.0))
    lows, highs = _extremes(layout.fmt, ext)
    total = fin.sum()
    mean_all = torch.where(total > 0, value_sums.sum() / total.clamp_min(1), 0.0)
    m2 = unit_m2.sum() + (fin * (unit_mean - mean_all).square()).sum()
    abs_sum = (2 * sums[1] - value_sums).sum()
    infs = (plus + minus).sum()
    nans = n * len(fin) - total - infs
    l2 = abs_sum if layout.single else norms[0].sum()
    out = {"n": total, "mean": mean_all, "m2": m2, "min": _first(lows, lows.amin()),
           "max": _first(highs, highs.amax()), "abs_sum": abs_sum,
           "zeros": (fin - positive - negative).sum(), "nan_count": nans, "inf_count": infs,
           "l2_sum": l2}  # fmt: skip
    if layout.width:
        saturated = torch.zeros_like(fin)
        if layout.tracked:
            below = _rint((fin + plus - minus - sums[5]) / 2)
            above = _rint((sums[6] + fin + minus - plus) / 2)
            saturated = below + above
        out |= {"u_count": fin, "u_sum": value_sums, "u_min": lows, "u_max": highs,
                "u_positive": positive, "u_saturated": saturated}  # fmt: skip
    return out


def _merge(a: dict, b: dict) -> dict:
    """Two slabs as one, as `RunningStats.merge` takes them: Chan's formula for the moments,
    the extremes of a slab with finite values by Python's min and max (the first of equal
    ones kept), the rest added; the units as `UnitStats.merge` (numpy's minimum and maximum)."""
    n = b["n"]
    total = a["n"] + n
    some = n > 0
    delta = b["mean"] - a["mean"]
    mean = a["mean"] + delta * n / total.clamp_min(1)
    m2 = a["m2"] + (b["m2"] + delta * delta * a["n"] * n / total.clamp_min(1))
    out = {
        "n": total,
        "mean": torch.where(some, mean, a["mean"]),
        "m2": torch.where(some, m2, a["m2"]),
        "min": torch.where(some & (b["min"] < a["min"]), b["min"], a["min"]),
        "max": torch.where(some & (b["max"] > a["max"]), b["max"], a["max"]),
    }
    for name in _ADDED:
        out[name] = a[name] + b[name]
    if "u_count" in a:
        for name in ("u_count", "u_sum", "u_positive", "u_saturated"):
            out[name] = a[name] + b[name]
        out["u_min"] = torch.where(a["u_min"] < b["u_min"], a["u_min"], b["u_min"])
        out["u_max"] = torch.where(a["u_max"] > b["u_max"], a["u_max"], b["u_max"])
    return out


def _extremes(fmt: _Format, ext: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`fused.Layout._extremes` in torch: per unit the lowest and highest finite value."""
    (a, b), (na, nb) = fmt.positive, fmt.negative
    top_pos, low_pos, top_neg, low_neg = ext[1], ext[2], ext[3], ext[4]
    has_pos, has_neg = top_pos >= a - b, top_neg >= na - nb
    pos_max = _values(fmt, torch.where(has_pos, b + top_pos, 0.0))
    pos_min = _values(fmt, torch.where(has_pos, a - low_pos, 0.0))
    neg_min = _values(fmt, torch.where(has_neg, nb + top_neg, 0.0))
    neg_max = _values(fmt, torch.where(has_neg, na - low_neg, 0.0))
    highs = torch.where(has_pos, pos_max, torch.where(has_neg, neg_max, -torch.inf))
    lows = torch.where(has_neg, neg_min, torch.where(has_pos, pos_min, torch.inf))
    return lows, highs


def _values(fmt: _Format, patterns: torch.Tensor) -> torch.Tensor:
    """`_Format.values` in torch: bit patterns (whole numbers in float64) as float64 values."""
    p = patterns.to(torch.int64)
    if fmt.name == "float16":
        p = torch.where(p >= 1 << 15, p - (1 << 16), p)
        return p.to(torch.int16).view(torch.float16).to(torch.float64)
    if fmt.name == "bfloat16":
        p = p << 16
    p = torch.where(p >= 1 << 31, p - (1 << 32), p)
    return p.to(torch.int32).view(torch.float32).to(torch.float64)


def _first(values: torch.Tensor, extreme: torch.Tensor) -> torch.Tensor:
    """The first of `values` equal to `extreme` (a unit's zero keeps its sign)."""
    at = (values == extreme).to(torch.uint8).argmax()
    return values.index_select(0, at.view(1)).squeeze(0)
