"""Streaming statistics against numpy float64 on the same arrays."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from probe.stats import backend
from probe.stats.backend import batch_stats, fold
from probe.stats.running import (
    QUANTILE_REL_ERROR,
    BucketSpans,
    LogHistogram,
    RunningStats,
    counts_agree,
)
from probe.stats.running import ranges as bucket_spans_of
from probe.store.fileformat import read_progress
from probe.testing.models import DEAD, SATURATED
from tests.helpers import run_probe

CUTS = [0, 1, 6, 7, 30, 61]  # uneven batches, one of a single row


@pytest.fixture(params=["numba", "torch"], autouse=True)
def stats_backend(request, monkeypatch):
    """Every test here holds for both backends (`probe.stats.backend`)."""
    if request.param == "numba":
        pytest.importorskip("numba")
    monkeypatch.setattr(backend, "_cpu", request.param)
    return request.param


NUMBA_ONLY = pytest.mark.parametrize("stats_backend", ["numba"], indirect=True)  # its own paths


def _stream(a: np.ndarray, bounds=None) -> RunningStats:
    s = RunningStats(bounds=bounds)
    for lo, hi in zip(CUTS, CUTS[1:] + [len(a)], strict=True):
        fold(s, torch.from_numpy(a[lo:hi]))
    return s


def _arrays():
    rng = np.random.default_rng(0)
    shape = (75, 4, 4, 5)
    narrow = (1000 + rng.uniform(-0.01, 0.01, shape)).astype(np.float32)
    normal = rng.standard_normal(shape).astype(np.float32)
    relu = np.maximum(normal, 0)
    holes = normal.copy()
    holes[3, 1, 0, 0] = np.nan
    holes[40, 2, 1, 1] = np.inf
    holes[70, 0, 3, 4] = -np.inf
    holes[5, 0, 0, :] = np.nan
    flat = rng.standard_normal((75, 9)).astype(np.float32) * 1e-3 - 5
    wide = np.where(normal < -1, -0.0, normal).astype(np.float64)  # int64 keys, signed zeros
    # segments of 20 values in batches of 3 rows or more (and flat's single values) are reduced
    # by column, the batch of a single row and these segments of 40 by segment
    long = rng.standard_normal((75, 2, 40)).astype(np.float32)
    long[[3, 9, 9], [1, 0, 0], [0, 5, 39]] = [np.nan, np.inf, -np.inf]
    # 100 units of 49 values: 4900 columns, reduced by column in blocks of 4096 (unit 83 lies
    # across the two) in batches of 7 rows or more
    across = rng.standard_normal((75, 100, 7, 7)).astype(np.float32)
    across[[2, 30, 30], [83, 83, 99], [6, 0, 3], [6, 0, 3]] = [np.nan, np.inf, -np.inf]
    return {
        "narrow": narrow,
        "normal": normal,
        "relu": relu,
        "holes": holes,
        "flat": flat,
        "float64": wide,
        "narrow_long": (1000 + rng.uniform(-0.01, 0.01, (75, 2, 40))).astype(np.float32),
        "holes_long": long,
        "across_blocks": across,
    }


def _numpy_row(a: np.ndarray) -> dict:
    """The table's scalar statistics of `a` in numpy float64."""
    finite = np.isfinite(a)
    f = a[finite].astype(np.float64)
    clean = np.where(finite, a, 0).astype(np.float64).reshape(len(a), -1)
    return {
        "rows": len(a),
        "n": f.size,
        "mean": f.mean(),
        "std": f.std(),
        "min": f.min(),
        "max": f.max(),
        "abs_mean": np.abs(f).mean(),
        "rms": np.sqrt((f**2).mean()),
        "frac_zero": (a == 0).mean(),
        "nan_count": np.isnan(a).sum(),
        "inf_count": np.isinf(a).sum(),
        "l2_mean": np.linalg.norm(clean, axis=1).mean(),
    }


@pytest.mark.parametrize("name", list(_arrays()))
def test_streaming_stats_equal_numpy_float64(name):
    a = _arrays()[name]
    row = _stream(a).as_row()
    for key, value in _numpy_row(a).items():
        np.testing.assert_allclose(row[key], value, rtol=2e-7, atol=0, err_msg=key)
    if name == "narrow":  # naive float32 E[x^2]-E[x]^2 collapses here
        a32 = torch.from_numpy(a)
        naive = float((a32 * a32).mean() - a32.mean() ** 2)
        variance = a.astype(np.float64).var()
        assert abs(naive - variance) > variance  # not even its magnitude survives


@pytest.mark.parametrize("name", list(_arrays()))
def test_per_unit_stats_equal_numpy(name):
    a = _arrays()[name]
    units = _stream(a).units
    finite = np.isfinite(a)
    axes = (0, *range(2, a.ndim))
    count = finite.sum(axis=axes)
    np.testing.assert_array_equal(units.count, count)
    total = np.where(finite, a, 0).astype(np.float64).sum(axis=axes)
    scale = np.abs(np.where(finite, a, 0)).max()  # partial sums run in float32 along the last axes
    np.testing.assert_allclose(units.sum / count, total / count, rtol=1e-6, atol=1e-7 * scale)
    np.testing.assert_array_equal(units.min, np.where(finite, a, np.inf).min(axis=axes))
    np.testing.assert_array_equal(units.max, np.where(finite, a, -np.inf).max(axis=axes))
    np.testing.assert_array_equal(units.positive, (np.where(finite, a, 0) > 0).sum(axis=axes))


@pytest.mark.parametrize("shape", [(75,), (75, 1)])
def test_one_value_per_row_equals_numpy(shape):
    """Rows of one value are reduced as one segment; each row's L2 norm is its |v|."""
    a = np.random.default_rng(3).standard_normal(75).astype(np.float32) * 3 + 1000
    a[[4, 40, 41]] = [np.nan, np.inf, -np.inf]
    a = a.reshape(shape)
    s = _stream(a)
    row = s.as_row()
    for key, value in _numpy_row(a).items():
        np.testing.assert_allclose(row[key], value, rtol=2e-7, atol=0, err_msg=key)
    if len(shape) == 2:
        finite = a[np.isfinite(a)]
        assert (s.units.count[0], s.units.min[0], s.units.max[0]) == (
            72,
            finite.min(),
            finite.max(),
        )


@pytest.mark.parametrize("dist", ["lognormal", "signed", "relu", "tiny_and_huge"])
def test_quantiles_within_the_documented_bound(dist):
    rng = np.random.default_rng(1)
    values = {
        "lognormal": rng.lognormal(0, 2, 100_000),
        "signed": rng.standard_normal(100_000) * 3 - 1,
        "relu": np.maximum(rng.standard_normal(100_000), 0),
        "tiny_and_huge": rng.choice([-1, 1], 100_000) * 10.0 ** rng.uniform(-30, 30, 100_000),
    }[dist].astype(np.float32)
    s = RunningStats()
    for chunk in np.array_split(values, 7):
        fold(s, torch.from_numpy(chunk))
    row = s.as_row()
    exact = values.astype(np.float64)
    for key, q in (("p01", 0.01), ("p50", 0.5), ("p99", 0.99)):
        truth = np.quantile(exact, q, method="lower")
        assert abs(row[key] - truth) <= QUANTILE_REL_ERROR * abs(truth), (key, row[key], truth)


def _spans(values: np.ndarray) -> BucketSpans:
    """A batch's histogram as the ranges its min and max give (what the numba backend returns),
    counted here with numpy: a value's bucket is the top 16 bits of its float32 pattern."""
    counts = np.bincount(values.view(np.uint32) >> 16, minlength=LogHistogram.BINS)
    heads = np.array(bucket_spans_of(float(values.min()), float(values.max())), dtype=np.int64)
    spans = [counts[start : start + length] for start, length in heads]
    return BucketSpans(heads.reshape(-1, 2), np.concatenate(spans).astype(np.int64))


PAIRS = ("signed", "positive_apart", "negative_and_signed", "zeros")


def _batch_pair(pair: str) -> tuple[np.ndarray, np.ndarray]:
    """Two micro-batches' values: of either sign, positive far apart, negative beside tiny
    non-negative ones, or zeros of both signs beside one value."""
    rng = np.random.default_rng(3)
    normal = rng.standard_normal(5_000).astype(np.float32)
    return {
        "signed": (normal, 100 * rng.standard_normal(3_000).astype(np.float32)),
        "positive_apart": (np.abs(normal) + 1e-3, np.abs(normal[:700]) * 1e6 + 5e5),
        "negative_and_signed": (-np.abs(normal), np.maximum(normal, 0) * 1e-20),
        "zeros": (np.zeros(40, np.float32), np.array([-0.0, 0.0, 2.5], np.float32)),
    }[pair]


@pytest.mark.parametrize("pair", PAIRS)
def test_two_batches_ranges_merge_as_the_whole_histogram(pair):
    """A step's two micro-batches merged as the union of their ranges (probe.train.step_stats)
    hold the counts of the whole histogram and read the same quantiles, to the bit."""
    a, b = _batch_pair(pair)
    union = _spans(a).union(_spans(b))
    whole = LogHistogram()
    _spans(a).add_to(whole.counts)
    _spans(b).add_to(whole.counts)
    assert np.array_equal(union.whole().counts, whole.counts)
    assert len(union.heads) <= 2  # (one range per sign: what quantiles read)
    lo, hi = float(min(a.min(), b.min())), float(max(a.max(), b.max()))
    qs = (0.0, 0.01, 0.25, 0.5, 0.75, 0.99, 1.0)
    assert [repr(q) for q in union.quantiles(qs, lo, hi)] == [
        repr(q) for q in whole.quantiles(qs, lo, hi)
    ]


def _float_counts(spans: BucketSpans) -> BucketSpans:
    """The same ranges with their counts as float64 integers (as the compiled pass packs them)."""
    return BucketSpans(spans.heads, spans.spans.astype(np.float64))


@pytest.mark.parametrize("pair", PAIRS)
def test_float64_bucket_counts_read_as_int64_ones(pair):
    """Ranges holding float64 counts (the numba backend hands the pass's packed counts over
    without an int64 copy) merge, fill a histogram and read quantiles as int64 counts do: the
    union's ranges and counts, the whole histogram (still int64) and the quantiles, to the bit;
    alone, with each other and mixed."""
    a, b = _batch_pair(pair)
    ints = _spans(a).union(_spans(b))
    lo, hi = float(min(a.min(), b.min())), float(max(a.max(), b.max()))
    qs = (0.0, 0.01, 0.25, 0.5, 0.75, 0.99, 1.0)
    for first, second in (
        (_float_counts(_spans(a)), _float_counts(_spans(b))),
        (_float_counts(_spans(a)), _spans(b)),
        (_spans(a), _float_counts(_spans(b))),
    ):
        union = first.union(second)
        assert union.spans.dtype == np.float64
        assert np.array_equal(union.heads, ints.heads)
        assert np.array_equal(union.spans, ints.spans)
        whole = LogHistogram()
        first.add_to(whole.counts)
        second.add_to(whole.counts)
        assert whole.counts.dtype == np.int64
        assert np.array_equal(whole.counts, ints.whole().counts)
        assert np.array_equal(union.whole().counts, ints.whole().counts)
        expected = [repr(q) for q in ints.quantiles(qs, lo, hi)]
        assert [repr(q) for q in union.quantiles(qs, lo, hi)] == expected
        assert [repr(q) for q in whole.quantiles(qs, lo, hi)] == expected
        assert [repr(q) for q in first.quantiles(qs, lo, hi)] == [
            repr(q) for q in _spans(a).quantiles(qs, lo, hi)
        ]


def test_merge_of_two_streams_equals_one_stream():
    a = _arrays()["holes"]
    whole = RunningStats()  # the same two batches folded into one running state
    fold(whole, torch.from_numpy(a[:20]))
    fold(whole, torch.from_numpy(a[20:]))
    left, right = RunningStats(), RunningStats()
    fold(left, torch.from_numpy(a[:20]))
    fold(right, torch.from_numpy(a[20:]))
    left.merge(right)
    for key, value in whole.as_row().items():
        np.testing.assert_allclose(left.as_row()[key], value, rtol=1e-12, err_msg=key)
    assert np.array_equal(left.hist.counts, whole.hist.counts)


def test_saved_state_round_trips():
    s = _stream(_arrays()["normal"], bounds=(-1.0, 1.0))
    back = RunningStats.from_saved(s.state(), s.arrays())
    assert back.as_row() == pytest.approx(s.as_row(), nan_ok=True)
    assert batch_stats(torch.zeros(0, 3)).n == 0


def test_dead_and_saturated_units_of_a_real_run(tmp_path):
    """Channel DEAD is forced negative before a ReLU, channel SATURATED deep into tanh's bound."""
    result, f = run_probe(
        tmp_path,
        "model=custom",
        "model._target_=probe.testing.models.DeadChannel",
        "model.input_shape=[3,8,8]",
        "model.num_classes=10",
        "dataset.num_samples=6",
        "dataset.batch_size=4",
        "probes=all_activations",
    )
    rows = result.summary.set_index("layer")
    assert rows.loc["relu", "dead_frac"] == 0.25  # exactly one channel of four
    assert rows.loc["tanh", "saturated_frac"] == 0.25
    relu = f["layers/relu/output"][:]
    dead = (relu <= 0).all(axis=(0, 2, 3))
    assert list(np.flatnonzero(dead)) == [DEAD]
    slot = read_progress(f).stats_slot  # the labelled per-unit fields of the whole slot
    positive = f["stats/relu/output/units"][slot]["positive"]
    assert list(np.flatnonzero(positive == 0)) == [DEAD]
    tanh = f["layers/tanh/output"][:]
    saturated = (np.abs(tanh) >= 0.98).all(axis=(0, 2, 3))
    assert list(np.flatnonzero(saturated)) == [SATURATED]
    sat_counts = f["stats/tanh/output/units"][slot]["saturated"]
    np.testing.assert_array_equal(sat_counts, (np.abs(tanh) >= 0.98).sum(axis=(0, 2, 3)))


@NUMBA_ONLY
def test_a_batch_split_across_threads_gives_the_same_statistics(monkeypatch):
    """Rows split across helper threads (each with its own histogram lane) equal one thread."""
    import probe.stats.numba_backend as stats_module
    from probe.stats import team
    from probe.stats.parallel import Threads

    monkeypatch.setattr(team, "entry", lambda: (0, 0))  # the pool of our own threads, not torch's

    rng = np.random.default_rng(1)
    a = rng.standard_normal((6, 8, 128 * 64)).astype(np.float32)  # above PARALLEL_MIN_VALUES
    a[2, 3, 5] = np.nan
    results = {}
    for n in (1, 3):
        monkeypatch.setattr(stats_module, "threads", Threads(n))
        s = RunningStats()
        fold(s, a)
        fold(s, a[:1])
        results[n] = s
    one, three = results[1], results[3]
    np.testing.assert_array_equal(one.hist.counts, three.hist.counts)
    for key, value in one.as_row().items():
        np.testing.assert_allclose(three.as_row()[key], value, rtol=1e-12, err_msg=key)
    for field in ("count", "sum", "min", "max", "positive"):
        np.testing.assert_allclose(getattr(three.units, field), getattr(one.units, field))
    finite = a[np.isfinite(a)].astype(np.float64)
    assert (three.n, three.max, three.nan_count) == (finite.size + a[0].size, finite.max(), 1)


def test_a_unit_that_starts_with_nan_keeps_its_variance():
    a = np.concatenate([[np.nan], 1e6 + 0.001 * np.arange(1000)]).reshape(1, 1, -1)
    s = RunningStats()
    fold(s, a)
    row = s.as_row()
    finite = a[np.isfinite(a)]
    np.testing.assert_allclose(row["std"], finite.std(), rtol=1e-9)
    np.testing.assert_allclose(row["mean"], finite.mean(), rtol=1e-15)


@pytest.mark.parametrize("shape", [(64,), (64, 8), (64, 8, 4), (64, 8, 40)])
def test_a_unit_whose_first_row_is_nan_keeps_its_variance(shape):
    """Sums are taken about a unit's first finite value, in whichever row it is."""
    rng = np.random.default_rng(4)
    a = 1e4 + rng.uniform(-0.01, 0.01, shape)
    a[0] = np.nan
    s = RunningStats()
    fold(s, a)  # one batch, whose row 0 gives no unit a value
    finite = a[np.isfinite(a)]
    np.testing.assert_allclose(s.as_row()["std"], finite.std(), rtol=1e-9)


@pytest.mark.parametrize("size", [31, 32, 3136])
def test_row_norms_beside_a_huge_first_row(size):
    """A row's norm is its own sum of squares, not one rebuilt from sums about the unit's
    shift (1e8 here), which cancels."""
    a = np.random.default_rng(5).uniform(0.5, 1.5, (4, 2, size)).astype(np.float32)
    a[0] = 1e8
    s = RunningStats()
    fold(s, torch.from_numpy(a))  # one batch (split in two by rows at most): row 1 with row 0
    norms = np.linalg.norm(a.astype(np.float64).reshape(4, -1), axis=1)
    # the small rows' norms are 1e-8 of the total: an error of one in them shows at 1e-12
    np.testing.assert_allclose(s.as_row()["l2_mean"], norms.mean(), rtol=1e-12)


def test_float64_beyond_float32_range_keeps_quantiles_finite():
    s = RunningStats()
    fold(s, np.array([[1e39, 1e39, 1e39], [2.0, 3.0, 1e39]]))
    row = s.as_row()
    assert (row["nan_count"], row["inf_count"], row["max"]) == (0, 0, 1e39)
    assert np.isfinite([row["p01"], row["p50"], row["p99"]]).all()


def test_statistics_saved_one_attribute_per_scalar_still_read():
    """Files written before the packed `state` layout: one attribute per scalar, unit_* arrays."""
    s = _stream(_arrays()["normal"])
    attrs = {k: getattr(s, k) for k in ("rows", "n", "mean", "m2", "min", "max", "abs_sum")}
    attrs.update(zeros=s.zeros, nan_count=s.nan_count, inf_count=s.inf_count, l2_sum=s.l2_sum)
    index, count = s.hist.sparse()
    arrays = {"hist_index": index, "hist_count": count}
    arrays.update({f"unit_{f}": getattr(s.units, f) for f in ("count", "sum", "min", "max")})
    arrays["unit_positive"] = s.units.positive
    back = RunningStats.from_saved(attrs, arrays)
    assert back.as_row() == pytest.approx(s.as_row(), nan_ok=True)
    np.testing.assert_array_equal(back.units.positive, s.units.positive)


@NUMBA_ONLY
def test_bucket_ranges_hold_every_float32_between_the_extremes():
    from probe.stats.kernels.histogram import bucket_ranges

    rng = np.random.default_rng(7)
    for trial in range(400):
        scale = np.float32(10.0 ** rng.integers(-40, 38))
        x = (rng.standard_normal(64) * scale).astype(np.float32)
        x = [x, np.abs(x), -np.abs(x), np.concatenate([x, [0.0, -0.0, 1e-45]])][trial % 4]
        x = np.asarray(x, dtype=np.float32)
        smallest = float(np.abs(x).min())
        for ranges in (
            bucket_ranges(float(x.min()), float(x.max())),
            bucket_ranges(float(x.min()), float(x.max()), smallest),
        ):
            buckets = x.view(np.uint32) >> 16
            assert all(any(a <= b < c for a, c in ranges) for b in buckets), (x.min(), x.max())
    assert bucket_ranges(-0.0, 0.0) == [(0, 1), (0x8000, 0x8001)]
    assert bucket_ranges(-4.0, 2.0, 1.0) == [(0x3F80, 0x4001), (0xBF80, 0xC081)]


@NUMBA_ONLY
def test_every_kernel_is_cached_against_every_module_of_the_kernels():
    """A caller's cached code holds its callees' compiled in, so each kernel's numba cache is
    checked against the whole package (`kernels.locator`), not its own file only; and the
    warm-up's stamp lists the index files of the kernels of every module."""
    import importlib

    from probe.stats import kernel_cache
    from probe.stats.kernels import locator

    cached = {}
    for path in kernel_cache.kernel_files():
        module = importlib.import_module(f"probe.stats.kernels.{path.stem}")
        for name, value in vars(module).items():
            func = getattr(value, "py_func", None) or getattr(
                value, "_pyfunc", None
            )  # or a cfunc's
            if hasattr(value, "_cache") and getattr(func, "__module__", "") == module.__name__:
                cached[f"{path.stem}.{name}"] = value._cache
    assert {k.split(".")[0] for k in cached} >= {"segments", "columns", "rows", "packing", "gomp"}
    for name, cache in cached.items():
        assert hasattr(cache, "_impl"), f"{name} is compiled without cache=True"
        assert isinstance(cache._impl.locator, locator._WholePackage), name
        assert cache._cache_file._source_stamp == locator.package_stamp(), name
    listed = {os.path.basename(p).split("-")[0] for p in kernel_cache._index_files()}
    assert listed == set(cached)


def test_the_warm_up_stamp_changes_with_any_kernels_module(tmp_path, monkeypatch):
    from probe.stats import kernel_cache

    copy = tmp_path / "kernels"
    copy.mkdir()
    for path in kernel_cache.kernel_files():
        (copy / path.name).write_bytes(path.read_bytes())
    monkeypatch.setattr(kernel_cache, "KERNELS", copy)
    keys = {kernel_cache._key()}
    for path in sorted(copy.glob("*.py")):
        path.write_text(path.read_text() + "\n")
        keys.add(kernel_cache._key())
    assert len(keys) == 1 + len(kernel_cache.kernel_files())


def test_a_batch_histogram_equals_counting_into_a_running_one():
    """Counted into the scratch and copied out as ranges, or counted into a running histogram:
    the same counts, and the scratch is left empty for the next batch."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((5, 4, 300)).astype(np.float32) * 3
    a[1, 2, 7], a[3, 0, 0] = np.nan, -np.inf
    running = RunningStats()
    fold(running, a)
    for _ in range(2):
        counted = LogHistogram()
        counted.merge(batch_stats(a).hist)
        np.testing.assert_array_equal(counted.counts, running.hist.counts)


def test_zeros_of_either_sign_at_the_extremes_are_all_counted():
    """ReLU gives -0.0 for -0.0 and +0.0 for negatives: a batch whose min is a zero of either
    sign keeps every value in its histogram, and leaves nothing behind for the next batch."""
    a = np.array([[[0.0, 1.0], [-0.0, 1.0]], [[-0.0, 2.0], [0.0, 3.0]]], dtype=np.float32)
    for x in (a, -a, np.abs(a), np.array([[[-0.0, 0.0]]], dtype=np.float32)):
        s = batch_stats(x)
        counted = LogHistogram()
        counted.merge(s.hist)
        assert counted.counts.sum() == s.n == x.size
    after = batch_stats(np.ones((1, 1, 3), dtype=np.float32))
    counted = LogHistogram()
    counted.merge(after.hist)
    assert counted.counts.sum() == 3


def test_saved_statistics_mixing_two_flushes_are_told_apart():
    """The scalars of one flush beside the arrays of the next (a kill while /stats is rewritten)
    do not add up, and are not used."""
    a = _arrays()["holes"]
    early, late = RunningStats(), RunningStats()
    fold(early, a[:20])
    fold(late, a[:20])
    fold(late, a[20:])
    assert counts_agree(early, "float32") and counts_agree(late, "float32")
    mixed = RunningStats.from_saved(early.state(), late.arrays())
    assert not counts_agree(mixed, "float32")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_negative_zero_is_the_minimum_below_positive_zero(dtype):
    """Order keys put -0.0 just below +0.0, for 32- and 64-bit keys alike."""
    normal = _arrays()["normal"]
    a = np.where(normal < 0, -0.0, normal).astype(dtype)
    s = RunningStats()
    fold(s, a)
    assert s.min == 0 and np.signbit(s.min)
    assert np.signbit(s.units.min).all() and (s.units.min == 0).all()
    assert s.as_row()["frac_zero"] == (a == 0).mean()


@pytest.mark.parametrize("dtype", ["<f4", ">f4", "<f8", ">f8"])
def test_either_byte_order_gives_the_same_statistics(dtype):
    """Arrays read from a file written on a machine of the other byte order (h5py keeps it)."""
    x = np.random.default_rng(5).standard_normal((6, 3, 40))
    x[2, 1, 5] = np.nan
    native = batch_stats(x.astype(np.dtype(dtype).newbyteorder("=")))
    other = batch_stats(x.astype(dtype))
    assert (other.n, other.nan_count, other.min, other.max) == (
        native.n, native.nan_count, native.min, native.max,
    )  # fmt: skip
    assert (other.mean, other.m2) == (native.mean, native.m2)
    assert np.array_equal(other.units.sum, native.units.sum)
