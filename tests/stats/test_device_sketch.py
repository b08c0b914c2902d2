"""Statistics whose sketches are summed on their device (probe.stats.device_sketch) against the
host path, which reads every batch's whole packed result and merges it on the host: equal
counts, extremes, units and histograms, the moments within float64 rounding; and against numpy
for what it counts."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from probe.stats import torch_backend
from probe.stats.device_sketch import BatchSketches, DeviceHistogram
from probe.stats.running import LogHistogram, RunningStats
from probe.stats.stat_columns import SCALARS

KEY = ("layer", "output")


def _batches(dtype: torch.dtype) -> list[torch.Tensor]:
    """Three batches (rows, 4 units, 3 values), one with NaN, Inf, zeros of both signs."""
    gen = torch.Generator().manual_seed(0)
    out = [torch.randn(5, 4, 3, generator=gen) * 3 for _ in range(3)]
    out[1][0, 0, :] = torch.tensor([math.nan, math.inf, -0.0])
    out[1][2, 1, 0] = 0.0
    out[2] = out[2] + 40.0  # (buckets the others did not fill)
    return [x.to(dtype) for x in out]


def _sketched(x: torch.Tensor, bounds=None):
    sketches = BatchSketches()
    sketches.add(KEY, x, bounds, 1)
    return sketches.settle()[KEY]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["reference", "fused", "fused-slabs"])
def test_sketches_summed_on_the_device_equal_the_host_merge(dtype, reduction, monkeypatch):
    """fused-slabs: the fused reduction over slabs of 2 rows (a GPU's large batches): their
    histograms summed by the split, their rows read slab by slab."""
    monkeypatch.setattr(torch_backend, "_reduction", reduction.split("-")[0])
    if reduction == "fused-slabs":
        monkeypatch.setattr(torch_backend, "SLAB_DEVICE", 24)
    bounds = (-1.0, 1.0)  # (saturation tracked: the units' sixth row)
    host, device = RunningStats(bounds=bounds), RunningStats(bounds=bounds)
    batches = _batches(dtype)
    for x in batches:
        host.merge(torch_backend.batch_stats(x, bounds))
        device.merge(_sketched(x, bounds))
    assert isinstance(device.hist, DeviceHistogram) and device.hist.stale
    np.testing.assert_array_equal(device.hist.counts, host.hist.counts)
    assert not device.hist.stale  # (brought over once, kept until the next batch)
    for name in SCALARS:
        assert getattr(device, name) == pytest.approx(getattr(host, name), rel=1e-12), name
    np.testing.assert_array_equal(device.units.packed(), host.units.packed())
    values = torch.cat([x.reshape(-1) for x in batches]).double().numpy()
    finite = values[np.isfinite(values)]
    assert (device.n, device.nan_count, device.inf_count) == (len(finite), 1, 1)
    assert device.hist.counts.sum() == len(finite)
    assert device.max == finite.max() and device.min == finite.min()


def test_occupied_buckets_are_bounded_without_a_copy_then_exact():
    """What a batch may add to a /stats slot is known on the host from the batch's own copy (an
    upper bound of the running sketch's buckets); once brought over, the exact count."""
    s = RunningStats()
    for x in _batches(torch.float32):
        s.merge(_sketched(x))
    hist = s.hist
    assert isinstance(hist, DeviceHistogram)
    bound = hist.occupied()
    exact = int(np.count_nonzero(hist.counts))
    assert bound >= exact and hist.occupied() == exact


def test_a_resumed_sketch_continues_from_the_files_counts():
    """Statistics read back from a file hold a host histogram: the next device batch continues
    from its counts (the sum of all batches, as if never stopped)."""
    first, *rest = _batches(torch.float32)
    whole = RunningStats()
    for x in [first, *rest]:
        whole.merge(_sketched(x))
    resumed = RunningStats()
    resumed.merge(_sketched(first))
    resumed.hist = LogHistogram(resumed.hist.counts.copy())  # (as a file gives it back)
    for x in rest:
        resumed.merge(_sketched(x))
    assert isinstance(resumed.hist, DeviceHistogram)
    np.testing.assert_array_equal(resumed.hist.counts, whole.hist.counts)
