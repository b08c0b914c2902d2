"""A batch's sites read together on their device (probe.stats.batched_read) against each site's
packed batch read alone on the host (the fused reduction's `Layout.unpack`, the reference's
`unpack`): every unit's count, sum, extremes, positive and saturated counts and every histogram
bucket equal, the batch accumulators within float64 rounding; and the device merge of units
(probe.stats.device_units) against `UnitStats.merge`."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from probe.stats import torch_backend
from probe.stats.batched_read import HEAD, UNIT_ORDER, PackedSite, read
from probe.stats.device_units import DeviceUnits, merge_batch
from probe.stats.running import UnitStats
from probe.stats.stat_columns import BATCH_AT, BATCH_NAMES


def _values() -> list[tuple[torch.Tensor, tuple[float, float] | None, int]]:
    """(value, saturation bounds, unit axis) of sites of every kind a batch may hold."""
    gen = torch.Generator().manual_seed(3)
    conv = torch.randn(6, 5, 3, 3, generator=gen) * 2
    conv[0, 0, 0, :] = torch.tensor([math.nan, math.inf, -math.inf])
    conv[1, 1] = -0.0  # (a unit of negative zeros: its extremes keep their sign)
    conv[:, 2] = conv[:, 2].clamp_min(0.0)
    tanh = torch.tanh(torch.randn(7, 4, generator=gen) * 3)  # (saturation counted)
    tokens = torch.randn(2, 5, 6, generator=gen).to(torch.bfloat16)  # (units on the last axis)
    half = (torch.randn(4, 3, 2, generator=gen) * 100).to(torch.float16)
    flat = torch.randn(9, generator=gen) - 5  # (no units: one value a row)
    grad = torch.randn(1, 8, 3, generator=gen) * 1e-3 + 1e-9  # (a parameter's gradient row)
    empty = torch.zeros(0, 4)
    return [(conv, None, 1), (tanh, (-1.0, 1.0), 1), (tokens, None, -1), (half, None, 1),
            (flat, None, 1), (grad, None, 1), (empty, None, 1)]  # fmt: skip


def _site(x, bounds, axis) -> PackedSite:
    packed, layout, width = torch_backend.packed_on_device(x, bounds, axis)
    tracked = layout.tracked if layout is not None else bounds is not None and width > 0
    return PackedSite(packed, layout, width, tracked, x.numel() == 0)


@pytest.mark.parametrize("reduction", ["fused", "fused-slabs", "reference"])
def test_a_batch_read_together_equals_each_site_read_on_the_host(reduction, monkeypatch):
    """fused-slabs: slabs of a few rows (a GPU's large batches): each unit's slabs merged as the
    host merges them, the histograms summed."""
    monkeypatch.setattr(torch_backend, "_reduction", reduction.split("-")[0])
    if reduction == "fused-slabs":
        monkeypatch.setattr(torch_backend, "SLAB_DEVICE", 30)
    values = _values()
    sites = [_site(*v) for v in values]
    got = read(sites)
    heads = got.heads.numpy()
    units = None if got.units is None else got.units.numpy()
    for (x, bounds, axis), site, row, at in zip(values, sites, got.row, got.unit_at, strict=True):
        want = torch_backend.batch_stats(x, bounds, axis)  # (the whole pack read on the host)
        if x.numel() == 0:
            assert row is None and at is None
            continue
        assert row is not None
        head = dict(zip(BATCH_NAMES, heads[row], strict=True))
        for name in BATCH_NAMES:
            expected = getattr(want, name)
            tol = 1e-12 * abs(expected) + (1e-14 * want.abs_sum / max(want.n, 1))
            assert abs(head[name] - expected) <= tol, (name, head[name], expected)
        assert math.copysign(1, head["min"]) == math.copysign(1, want.min)
        hist = got.hists[row].numpy()
        np.testing.assert_array_equal(hist, want.hist.counts)
        assert got.buckets[row] == np.count_nonzero(want.hist.counts)
        if want.units is None:
            assert at is None
            continue
        assert at is not None and units is not None
        mine = units[:, at : at + site.width]
        by = dict(zip(UNIT_ORDER, mine, strict=True))
        w = want.units
        for name, expected in [("count", w.count), ("sum", w.sum), ("positive", w.positive),
                               ("min", w.min)]:  # fmt: skip
            np.testing.assert_array_equal(by[name], expected, err_msg=name)
            np.testing.assert_array_equal(np.signbit(by[name]), np.signbit(expected))
        np.testing.assert_array_equal(-by["-max"], w.max)
        np.testing.assert_array_equal(np.signbit(-by["-max"]), np.signbit(w.max))
        saturated = w.saturated if w.saturated is not None else np.zeros(site.width)
        np.testing.assert_array_equal(by["saturated"], saturated)
    assert heads.shape == (sum(v[0].numel() > 0 for v in values), HEAD)
    assert heads[got.row[1], BATCH_AT["n"]] == 28


def test_units_merged_on_the_device_equal_the_host_merge():
    """Three batches of two sites merged by `merge_batch` (from units that merge into anything
    unchanged, then from a host copy, as a resumed run's): the host's `UnitStats.merge`, zeros'
    signs included."""
    gen = torch.Generator().manual_seed(5)

    def batch(width: int) -> UnitStats:
        low = torch.randn(width, generator=gen, dtype=torch.float64).numpy()
        low[0] = -0.0
        high = low + 1.0
        high[1] = 0.0
        count = np.arange(width, dtype=np.int64) + 1
        return UnitStats(count, low * 3, low, high, count // 2, count % 2)

    def rows(u: UnitStats) -> torch.Tensor:
        return torch.from_numpy(np.stack([u.count, u.sum, u.positive, u.saturated, u.min, -u.max]).astype(np.float64))  # fmt: skip

    widths = (3, 5)
    batches = [[batch(w) for w in widths] for _ in range(3)]
    host = [UnitStats(**{k: np.copy(v) for k, v in vars(b).items()}) for b in batches[0]]
    device = [DeviceUnits.empty_on(w, True, torch.device("cpu"), None) for w in widths]
    for i, sites in enumerate(batches):
        if i:
            for h, b in zip(host, sites, strict=True):
                h.merge(b)
        if i == 1:  # (a resumed run: its units so far come back from the host)
            device = [DeviceUnits.from_host(d, torch.device("cpu"), None) for d in device]
        merge_batch(device, torch.cat([rows(b) for b in sites], 1))
    for h, d in zip(host, device, strict=True):
        for name in ("count", "sum", "min", "max", "positive", "saturated"):
            np.testing.assert_array_equal(getattr(d, name), getattr(h, name), err_msg=name)
            assert (np.signbit(getattr(d, name)) == np.signbit(getattr(h, name))).all(), name


def test_a_lone_site_packed_in_inference_mode_reads_outside_it_and_its_pack_stays_as_it_was():
    """A batch of one site (its histogram a view of the pack itself, no `cat` in between),
    packed under torch.inference_mode as a run's forward is and read outside it as the batch's
    end is: the histogram equals the host's read, and the pack is not written (its NaN and Inf
    buckets are cleared in the histogram, not in the pack)."""
    x = torch.randn(6, 5, 3, 3, generator=torch.Generator().manual_seed(7))
    x[0, 0, 0, 0] = math.nan
    with torch.inference_mode():
        site = _site(x, None, 1)
    before = site.packed.clone()
    got = read([site])
    np.testing.assert_array_equal(got.hists[0].numpy(), torch_backend.batch_stats(x).hist.counts)
    assert torch.equal(site.packed.nan_to_num(), before.nan_to_num())
