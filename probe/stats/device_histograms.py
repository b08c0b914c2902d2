"""Quantile sketches that stay on their device: a packed batch split into its histogram and the
rest, histograms summed where they lie, and their quantiles read there, so that what leaves the
device for a step's table is a few numbers per site instead of 65536 buckets.

A packed batch is `probe.stats.torch_backend.on_device`'s: the fused reduction's (a `Layout`
tells its blocks) or the reference's (the histogram at its end). `split` gives the histogram as
float32 buckets (float64 counts, NaN and Inf buckets cleared, as `LogHistogram` holds them) and
the rest with the reader of that rest (its statistics without a histogram). `quantile_points`
reads many histograms at once: the bucket midpoint holding each rank floor(q * (n - 1)) in value
order, as `LogHistogram.quantiles` does; the caller clips them to the values' min and max
(`probe.stats.running.PointQuantiles`), which the rest's statistics hold.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
import torch

from probe.stats import fused
from probe.stats.running import NEGATIVE, RunningStats
from probe.stats.stat_columns import PACKED_HEAD
from probe.stats.torch_backend import _CLEARED, BINS, UNIT_ROWS, unpack_without_histogram

Reader = Callable[[np.ndarray], RunningStats]


def split(packed: torch.Tensor, layout: fused.Layout | None, rows: int, unit_axis: int,
          width: int) -> tuple[torch.Tensor | None, torch.Tensor, Reader]:  # fmt: skip
    """(histogram (BINS,) float64 or None, the rest of the packed batch, the rest's reader) of
    one packed batch on its device; `layout` None: the reference's packing (of a batch whose
    units are `width`)."""
    if layout is None:  # (the reference cleared its NaN and Inf buckets)
        at = PACKED_HEAD + UNIT_ROWS * width
        return packed[at:], packed[:at], lambda p: unpack_without_histogram(p, rows, unit_axis)
    rest_layout = dataclasses.replace(layout, hist=False)
    if not layout.hist or packed.numel() == 0:
        return None, packed, rest_layout.unpack
    hists, rests = [], []
    at = 0
    for slab_rows in layout.slab_rows:
        size = layout._size(slab_rows)
        block = packed[at : at + size]
        at += size
        bins = fused._bins(layout.rows)
        keep = size - bins
        if layout.width:
            b = block.view(layout.rows, -1)
            cut = b.shape[1] - bins // layout.rows
            hists.append(b[:, cut:].reshape(-1)[:BINS])
            rests.append(b[:, :cut].reshape(-1))
        else:
            hists.append(block[keep:][:BINS])
            rests.append(block[:keep])
    hist = hists[0] if len(hists) == 1 else torch.stack(hists).sum(0)
    if layout.fmt.name == "float16":  # its patterns' counts into the float32 buckets they fall in
        index = _float16_buckets(layout.fmt, hist.device)
        hist = torch.zeros(BINS, dtype=hist.dtype, device=hist.device).index_add_(0, index, hist)
    for lo, hi in _CLEARED:  # (in place: the histogram's part of the pack is not read again)
        hist[lo:hi].zero_()
    return hist, torch.cat(rests) if len(rests) > 1 else rests[0], rest_layout.unpack


_FLOAT16_BUCKETS: dict[torch.device, torch.Tensor] = {}


def _float16_buckets(fmt: fused._Format, device: torch.device) -> torch.Tensor:
    """The float32 bucket of each float16 pattern on `device`, made once per device (on a GPU
    copied from pinned memory without waiting: a copy from pageable memory waits for it)."""
    found = _FLOAT16_BUCKETS.get(device)
    if found is None:
        buckets = fmt.buckets()
        if buckets is None:
            raise ValueError(f"{fmt.name} patterns are their own buckets")
        table = torch.from_numpy(buckets)
        if device.type == "cuda":
            table = table.pin_memory()
        found = _FLOAT16_BUCKETS[device] = table.to(device, non_blocking=True)
    return found


def quantile_points(hists: torch.Tensor, qs: Sequence[float]) -> torch.Tensor:
    """(S, len(qs)) float64 on the histograms' device: for each histogram (rows of `hists`,
    float32 buckets' counts) the midpoint of the bucket that holds each rank floor(q * (n - 1))
    in increasing value order (the negative buckets from the largest magnitude down, then the
    positive ones up); NaN where a histogram is empty. Not yet clipped to the values' extremes."""
    order = _order(hists.device)
    counts = hists.index_select(1, order)  # in value order
    cum = counts.cumsum(1)
    n = cum[:, -1:]
    q = torch.tensor(list(qs), dtype=torch.float64, device=hists.device)
    ranks = torch.floor(q[None, :] * (n - 1).clamp_min(0))
    found = torch.searchsorted(cum, ranks.contiguous(), right=True).clamp_max(BINS - 1)
    points = _midpoints(order.index_select(0, found.reshape(-1))).view(found.shape)
    return torch.where(n > 0, points, torch.nan)


def _order(device: torch.device) -> torch.Tensor:
    """The buckets in increasing value order: negatives from the largest magnitude down, then
    the positive ones up."""
    negative = torch.arange(BINS - 1, NEGATIVE - 1, -1, device=device)
    positive = torch.arange(0, NEGATIVE, device=device)
    return torch.cat([negative, positive])


def _midpoints(index: torch.Tensor) -> torch.Tensor:
    """`probe.stats.running.bucket_midpoints` on the device (float64; 0 for the zero bucket)."""
    negative = index >= NEGATIVE
    magnitude = torch.where(negative, index - NEGATIVE, index)
    lo = (magnitude << 16).to(torch.int32).view(torch.float32).double()
    hi = ((magnitude + 1) << 16).to(torch.int32).view(torch.float32).double()
    mid = torch.where(magnitude == 0, 0.0, (lo + hi) / 2)
    return torch.where(negative, -mid, mid)
