"""The torch backend of batch statistics (`probe.stats.torch_backend`) against the numba kernels and
against numpy float64 computed directly from the data.

Counts, extremes (bit for bit, signed zeros included) and histograms must be equal. Sums (mean,
m2, abs_sum, l2_sum, unit sums) must agree within RTOL = 1e-9: float64 rounding of sums over
these few thousand values, in whatever order each backend adds them, is below n * 2**-53 ~ 1e-12
relative to the sum of magnitudes; any float32 accumulation would be off by 1e-7 or more. Sums
that cancel (a mean near 0, a unit sum) are held to 1e-12 of their sum of magnitudes instead.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from probe.stats import torch_backend as torch_stats
from probe.stats.running import SATURATION_TOL, RunningStats
from probe.stats.stat_columns import PACKED_HEAD

RTOL = 1e-9
CANCEL = 1e-12  # absolute tolerance of a signed sum, relative to its sum of magnitudes
CUTS = [0, 1, 4, 5, 11]  # uneven batches of rows, two of a single row


def numba_stats(x, bounds=None, unit_axis=1):
    """The reference backend: the compiled passes."""
    pytest.importorskip("numba")
    from probe.stats.numba_backend import batch_stats

    return batch_stats(x, bounds, unit_axis=unit_axis)


def _cases() -> dict:
    """name -> (tensor, bounds, unit_axis)."""
    rng = np.random.default_rng(7)

    def normal(*shape, dtype=np.float32):
        return rng.standard_normal(shape).astype(dtype)

    specials = normal(9, 5, 6)
    specials[0, 0, :3] = [np.nan, np.inf, -np.inf]
    specials[4, 2, 5] = np.nan
    specials[2, 3, 1] = -np.inf
    specials[:, 1] = np.nan  # a unit without a finite value
    specials[:, 2] = np.where(specials[:, 2] > 0, 0.0, -0.0)  # signed zeros only
    specials[:, 4] = -0.0  # a unit of -0.0 alone
    specials[5, 0, :4] = [1e-40, -1e-45, 5e-41, -0.0]  # denormals, two below 2**-133
    specials[6, 3, :] = [0.0, -0.0, 0.0, 1e-39, -1e-39, 0.0]
    wide = normal(10, 3, 8, dtype=np.float64) * 1e3
    wide[1, 0, :4] = [1e39, -3e40, 1e-50, -1e-320]  # beyond float32's range, above and below
    wide[7, 2, 2] = np.nan
    mostly_zero = np.maximum(normal(16, 8, 6, 6) - 0.8, 0)
    halves = (normal(8, 4, 5) * 100).astype(np.float16)
    halves[3, 1, :5] = [np.nan, -0.0, np.inf, 1e-6, -np.inf]  # 1e-6: a subnormal
    bounded = normal(12, 5, 4, 4)
    bounded[3, 2, 1, :3] = [np.nan, np.inf, -np.inf]  # (+-1 after tanh: saturated)
    sigmoid = 1 / (1 + np.exp(-8 * normal(12, 5, 4, 4)))
    sigmoid[2, 1, 0, :2] = [np.nan, np.inf]  # not finite: never saturated
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    return {
        "normal": (t(normal(12, 6, 5, 7)), None, 1),
        "all_zero": (torch.zeros(5, 4, 3), None, 1),
        "specials": (t(specials), None, 1),
        "float16": (t(halves), None, 1),
        "bfloat16": (t(normal(8, 4, 5) * 100).bfloat16(), None, 1),
        "float64": (t(wide), None, 1),
        "int32": (torch.arange(-30, 30, dtype=torch.int32).reshape(6, 5, 2), None, 1),
        "one_row": (t(normal(1, 8, 5, 5)), None, 1),
        "one_unit": (t(normal(10, 1, 4, 4)), None, 1),
        "nchw": (t(normal(6, 8, 5, 5)), None, 1),
        "nchw_axis2": (t(normal(4, 3, 5, 6)), None, 2),
        "ntc": (t(normal(4, 7, 16)), None, -1),
        "nc": (t(normal(20, 9)), None, 1),
        "n": (t(normal(50)), None, 1),
        "scalar": (torch.tensor(-2.5), None, 1),
        "relu": (t(mostly_zero), None, 1),
        "narrow": (t((1000 + rng.uniform(-0.01, 0.01, (20, 3, 10))).astype(np.float32)), None, 1),
        "sigmoid": (t(sigmoid.astype(np.float32)), (0.0, 1.0), 1),
        "tanh": (torch.tanh(t(bounded) * 3), (-1.0, 1.0), 1),
        "tanh_tokens": (torch.tanh(t(normal(5, 6, 7)) * 3), (-1.0, 1.0), -1),
    }


CASES = _cases()
CUDA = pytest.mark.cuda
# cpu: the host paths; slabs: many slabs per batch, merged; nosync: the path taken off the
# host (masking, no bincount), run on the CPU; sorted: with the sorted histogram of big slabs
VARIANTS = ["cpu", "cpu-slabs", "cpu-nosync", "cpu-nosync-sorted", pytest.param("cuda", marks=CUDA),
            pytest.param("cuda-slabs", marks=CUDA)]  # fmt: skip


@pytest.fixture
def device(request, monkeypatch):
    variant = request.param
    if variant.endswith("slabs"):
        monkeypatch.setattr(torch_stats, "SLAB_HOST", 40)
        monkeypatch.setattr(torch_stats, "SLAB_DEVICE", 40)
    if variant.startswith("cpu-nosync"):
        monkeypatch.setattr(torch_stats, "_host", lambda device: False)
    if variant.endswith("sorted"):  # the sorted histogram of big GPU slabs, for every slab
        monkeypatch.setattr(torch_stats, "SORTED_HISTOGRAM", 1)
    return variant.split("-")[0]


def _widened(x: torch.Tensor) -> np.ndarray:
    """The values the statistics are over: float32 unless float32 or float64."""
    if x.dtype not in (torch.float32, torch.float64):
        x = x.float()
    return x.numpy()


def _by_unit(a: np.ndarray, unit_axis: int) -> np.ndarray:
    """(units, values) of a batch with units along unit_axis (axis 1 of a 2-D batch)."""
    axis = 1 if a.ndim == 2 else unit_axis % a.ndim
    moved = np.moveaxis(a, axis, 0)
    return moved.reshape(moved.shape[0], -1)


def _order_extremes(u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of u the min and max of its finite values in the order of their bits (-0.0 below
    +0.0); +inf and -inf where there is none."""
    ints, low = (np.int32, 0x7FFFFFFF) if u.dtype == np.float32 else (np.int64, (1 << 63) - 1)
    bits = u.view(ints)
    keys = bits ^ ((bits >> (8 * u.itemsize - 1)) & low)
    finite = np.isfinite(u)
    top, bottom = np.iinfo(ints).max, np.iinfo(ints).min
    lo = np.where(finite, keys, top).min(axis=1)
    hi = np.where(finite, keys, bottom).max(axis=1)

    def value(k):
        return (k ^ ((k >> (8 * u.itemsize - 1)) & low)).astype(ints).view(u.dtype).astype(float)

    count = finite.sum(axis=1)
    return np.where(count > 0, value(lo), np.inf), np.where(count > 0, value(hi), -np.inf)


def _reference(x: torch.Tensor, bounds, unit_axis) -> dict:
    """The statistics of x from numpy float64, one reduction at a time (two-pass m2)."""
    a = _widened(x)
    finite = np.isfinite(a)
    f = a[finite].astype(np.float64)
    rows = len(a) if a.ndim else 1
    clean = np.where(finite, a, 0).astype(np.float64).reshape(rows, -1)
    with np.errstate(over="ignore"):
        top = a.astype(np.float32).reshape(-1).view(np.uint32) >> 16
    hist = np.bincount(top, minlength=1 << 16)
    hist[0x7F80:0x8000] = hist[0xFF80:] = 0
    out = {
        "rows": rows,
        "n": f.size,
        "mean": f.mean() if f.size else 0.0,
        "m2": ((f - f.mean()) ** 2).sum() if f.size else 0.0,
        "abs_sum": np.abs(f).sum(),
        "zeros": int((f == 0).sum()),
        "nan_count": int(np.isnan(a).sum()),
        "inf_count": int(np.isinf(a).sum()),
        "l2_sum": np.sqrt((clean**2).sum(axis=1)).sum(),
        "hist": hist,
        "units": None,
    }
    if a.ndim >= 2:
        u = _by_unit(a, unit_axis)
        fin = np.isfinite(u)
        v = np.where(fin, u, 0).astype(np.float64)
        lows, highs = _order_extremes(u)
        out["units"] = {
            "count": fin.sum(axis=1),
            "sum": v.sum(axis=1),
            "magnitude": np.abs(v).sum(axis=1),
            "min": lows,
            "max": highs,
            "positive": (v > 0).sum(axis=1),
            "saturated": None,
        }
        if bounds is not None:
            lo, hi = bounds
            tol = SATURATION_TOL * (hi - lo)
            near = ((u <= lo + tol) | (u >= hi - tol)) & fin  # in u's own dtype, as numpy does
            out["units"]["saturated"] = near.sum(axis=1)
    return out


def _dense(hist) -> np.ndarray:
    counts = np.zeros(1 << 16, np.int64)
    if hist is not None:
        hist.add_to(counts)
    return counts


def _same_bits(a, b) -> bool:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return np.array_equal(a, b) and np.array_equal(np.signbit(a), np.signbit(b))


def _close(actual, expected, magnitude=0.0, what=""):
    """|actual - expected| <= RTOL |expected| + CANCEL * magnitude, elementwise."""
    actual, expected = np.asarray(actual, dtype=float), np.asarray(expected, dtype=float)
    error = np.abs(actual - expected)
    bound = RTOL * np.abs(expected) + CANCEL * np.asarray(magnitude)
    ok = (error <= bound) | (actual == expected)  # (equal infinities)
    assert ok.all(), f"{what}: {actual} vs {expected}, error {error} above {bound}"


def _check_against(s: RunningStats, ref: RunningStats) -> None:
    """s equals another backend's result: exactly where it counts or compares, else to RTOL."""
    for key in ("rows", "n", "zeros", "nan_count", "inf_count", "unit_axis"):
        assert getattr(s, key) == getattr(ref, key), key
    extremes = (s.min, s.max, ref.min, ref.max)
    assert _same_bits(extremes[:2], extremes[2:]), extremes
    np.testing.assert_array_equal(_dense(s.hist), _dense(ref.hist))
    _close(s.mean, ref.mean, s.abs_sum / max(s.n, 1), "mean")
    for key in ("m2", "abs_sum", "l2_sum"):
        _close(getattr(s, key), getattr(ref, key), what=key)
    assert (s.units is None) == (ref.units is None)
    if s.units is not None:
        for key in ("count", "positive"):
            np.testing.assert_array_equal(getattr(s.units, key), getattr(ref.units, key), key)
        assert (s.units.saturated is None) == (ref.units.saturated is None)
        if s.units.saturated is not None:
            np.testing.assert_array_equal(s.units.saturated, ref.units.saturated)
        assert _same_bits(s.units.min, ref.units.min) and _same_bits(s.units.max, ref.units.max)
        _close(s.units.sum, ref.units.sum, np.abs(ref.units.sum).max(), "unit sums")


def _check_numpy(s: RunningStats, ref: dict) -> None:
    """s equals numpy's float64 statistics of the same values."""
    for key in ("rows", "n", "zeros", "nan_count", "inf_count"):
        assert getattr(s, key) == ref[key], key
    np.testing.assert_array_equal(_dense(s.hist), ref["hist"])
    _close(s.mean, ref["mean"], ref["abs_sum"] / max(ref["n"], 1), "mean")
    for key in ("m2", "abs_sum", "l2_sum"):
        _close(getattr(s, key), ref[key], what=key)
    u = ref["units"]
    if u is None:
        assert s.units is None
        return
    for key in ("count", "positive"):
        np.testing.assert_array_equal(getattr(s.units, key), u[key], key)
    if u["saturated"] is None:
        assert s.units.saturated is None
    else:
        np.testing.assert_array_equal(s.units.saturated, u["saturated"])
    assert _same_bits(s.units.min, u["min"]) and _same_bits(s.units.max, u["max"])
    _close(s.units.sum, u["sum"], u["magnitude"], "unit sums")
    # the scalar extremes are the units' (their values; the sign of a zero is checked above)
    assert s.min == (u["min"].min() if len(u["min"]) else np.inf)
    assert s.max == (u["max"].max() if len(u["max"]) else -np.inf)


@pytest.mark.parametrize("device", VARIANTS, indirect=True)
@pytest.mark.parametrize("name", list(CASES))
def test_torch_backend_equals_numba_and_numpy(name, device):
    x, bounds, unit_axis = CASES[name]
    s = torch_stats.batch_stats(x.to(device), bounds, unit_axis)
    _check_against(s, numba_stats(x, bounds, unit_axis))
    _check_numpy(s, _reference(x, bounds, unit_axis))


@pytest.mark.parametrize("device", VARIANTS, indirect=True)
@pytest.mark.parametrize("name", ["specials", "float64", "relu", "tanh", "ntc", "narrow"])
def test_streamed_batches_merge_into_one(name, device):
    """Batches of uneven row cuts merged with RunningStats.merge equal one batch of them all, and
    equal the numba backend's batches merged the same way (bit for bit in the extremes)."""
    x, bounds, unit_axis = CASES[name]
    streamed, reference = RunningStats(unit_axis=unit_axis), RunningStats(unit_axis=unit_axis)
    for lo, hi in zip(CUTS, CUTS[1:] + [len(x)], strict=True):
        streamed.merge(torch_stats.batch_stats(x[lo:hi].to(device), bounds, unit_axis))
        reference.merge(numba_stats(x[lo:hi], bounds, unit_axis))
    _check_against(streamed, reference)
    whole = torch_stats.batch_stats(x.to(device), bounds, unit_axis)
    for key in ("rows", "n", "zeros", "nan_count", "inf_count", "min", "max"):
        assert getattr(streamed, key) == getattr(whole, key), key  # (zeros' signs may differ)
    np.testing.assert_array_equal(_dense(streamed.hist), _dense(whole.hist))
    _close(streamed.mean, whole.mean, whole.abs_sum / whole.n, "mean")
    for key in ("m2", "abs_sum", "l2_sum"):
        _close(getattr(streamed, key), getattr(whole, key), what=key)
    for key in ("count", "positive", "saturated", "min", "max"):
        np.testing.assert_array_equal(getattr(streamed.units, key), getattr(whole.units, key))
    _close(streamed.units.sum, whole.units.sum, np.abs(whole.units.sum).max(), "unit sums")


@pytest.mark.parametrize("name", ["specials", "sigmoid", "n", "ntc"])
def test_unpacked_stats_round_trip_through_saved_form(name):
    x, bounds, unit_axis = CASES[name]
    s = torch_stats.batch_stats(x, bounds, unit_axis)
    back = RunningStats.from_saved(s.state(), s.arrays())
    for key in ("rows", "n", "mean", "m2", "abs_sum", "zeros", "nan_count", "inf_count", "l2_sum"):
        assert getattr(back, key) == getattr(s, key), key
    assert _same_bits(back.min, s.min) and _same_bits(back.max, s.max)
    np.testing.assert_array_equal(_dense(back.hist), _dense(s.hist))
    assert (back.units is None) == (s.units is None)
    if s.units is not None:
        np.testing.assert_array_equal(back.units.packed(), s.units.packed())
        assert (back.units.saturated is None) == (s.units.saturated is None)


def test_packed_layout():
    """The packed vector's head and unit rows, read by position."""
    x = torch.tensor([[[-1.0, 0.0], [2.0, 0.5]], [[3.0, -0.0], [float("nan"), 4.0]]])
    p = torch_stats.reduce(x, bounds=(0.0, 4.0)).numpy()
    assert len(p) == PACKED_HEAD + 6 * 2 + (1 << 16)
    width, tracked, n, mean, m2, lo, hi, abs_sum, zeros, nans, infs, l2, pad = p[:13]
    assert (width, tracked, n, nans, infs, zeros, pad) == (2, 1, 7, 1, 0, 2, 0)
    assert (lo, hi, abs_sum, mean) == (-1.0, 4.0, 10.5, 8.5 / 7)
    assert m2 == pytest.approx(((np.array([-1, 0, 2, 0.5, 3, 0, 4]) - 8.5 / 7) ** 2).sum())
    assert l2 == pytest.approx(np.sqrt(1 + 4 + 0.25) + np.sqrt(9 + 16))
    units = p[13 : 13 + 12].reshape(6, 2)  # count, sum, min, max, positive, saturated
    np.testing.assert_array_equal(units, [[4, 3], [2, 6.5], [-1, 0.5], [3, 4], [1, 3], [3, 1]])
    assert p[13 + 12 :].sum() == 7  # the NaN's bucket is cleared
    # per unit -0.0 lies below +0.0; the scalar extremes are the first unit's among equal floats
    # (the kernels compare the units' as floats), so unit 0's +0.0 here, unit 0's -0.0 swapped
    for x, lo, lows in (
        ([[0.0, -0.0], [0.0, 0.0]], 0.0, [0.0, -0.0]),
        ([[-0.0, 0.0], [0.0, 0.0]], -0.0, [-0.0, 0.0]),
    ):
        q = torch_stats.reduce(torch.tensor(x)).numpy()
        assert _same_bits(q[[5, 6]], [lo, 0.0]) and _same_bits(q[17:21], [*lows, 0.0, 0.0])
        reference = numba_stats(torch.tensor(x))
        assert _same_bits([reference.min, reference.max], q[[5, 6]])


def test_empty_and_numpy_inputs():
    empty = torch_stats.batch_stats(torch.zeros(0, 3))
    assert empty == RunningStats(rows=0, hist=None) == numba_stats(torch.zeros(0, 3))
    p = torch_stats.reduce(torch.zeros(0, 3))
    assert torch_stats.unpack(p.numpy(), 0) == empty and p[5] == np.inf and p[6] == -np.inf
    x, bounds, _ = CASES["tanh"]
    swapped = x.numpy().astype(">f4")  # a file of the other byte order
    _check_against(torch_stats.batch_stats(swapped, bounds), numba_stats(swapped, bounds))
    halves = x.numpy().astype(np.float16)
    _check_against(torch_stats.batch_stats(halves), numba_stats(halves))


@CUDA
def test_reduce_does_not_synchronise_on_cuda():
    x = CASES["specials"][0].cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        packed = torch_stats.reduce(x, (0.0, 1.0))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert packed.device == x.device


@pytest.mark.parametrize("shape", [(3,), (3, 1)])
def test_rows_of_one_value_take_their_magnitude(shape):
    """A row of a single value has |v| as its L2 norm, as in the kernels, where sqrt(v*v) would
    overflow (float64 beyond 1e154)."""
    x = torch.tensor([1e160, -2.0, 3.0], dtype=torch.float64).reshape(shape)
    s, reference = torch_stats.batch_stats(x), numba_stats(x)
    assert s.l2_sum == pytest.approx(1e160 + 5, rel=RTOL)
    assert reference.l2_sum == pytest.approx(1e160 + 5, rel=RTOL)
    assert np.isinf(s.m2)  # (the kernels' shifted sums give NaN: inf - inf)


def test_batches_inside_and_outside_inference_mode_share_the_scratch_buffers():
    """A run's hooks reduce under torch.inference_mode; the summarizer, a notebook or the next
    test in the same thread outside it: the reused buffers must serve both, with equal results."""
    x = torch.randn(6, 4, 50, dtype=torch.float32) + 1000
    torch_stats._scratch.buffers.clear()  # made afresh, inside inference mode
    with torch.inference_mode():
        inside = torch_stats.batch_stats(x.clone())
    outside = torch_stats.batch_stats(x)
    assert (inside.n, inside.mean, inside.m2) == (outside.n, outside.mean, outside.m2)
    np.testing.assert_array_equal(inside.hist.counts, outside.hist.counts)
