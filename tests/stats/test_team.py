"""Statistics split across torch's OpenMP threads equal one thread's and numpy's."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from probe.stats import backend, team
from probe.stats import numba_backend as stats
from probe.stats.numba_backend import batch_stats
from probe.stats.parallel import Threads
from probe.stats.running import LogHistogram, RunningStats

pytestmark = pytest.mark.skipif(
    "OpenMP" not in torch.__config__.parallel_info(), reason="torch runs without OpenMP here"
)


@pytest.fixture(autouse=True)
def numba_backend(monkeypatch):
    """RunningStats.update reduces with the numba backend, whose split these tests check."""
    monkeypatch.setattr(backend, "_cpu", "numba")


def _batches() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    shape = (16, 8, 40, 40)  # above TEAM_MIN_VALUES, so the split is used
    narrow = (1000 + rng.uniform(-0.01, 0.01, shape)).astype(np.float32)
    holes = rng.standard_normal(shape).astype(np.float32)
    holes[2, 3, 0, :7] = np.nan
    holes[11, 0, 5, 5] = np.inf
    holes[15, 7, 1, 1] = -np.inf
    relu = np.maximum(rng.standard_normal(shape), 0).astype(np.float32)
    # segments of an odd 1601 values, above AHEAD_MIN: the prefetching loop's last, odd block
    odd = np.maximum(rng.standard_normal((16, 8, 1601)), 0).astype(np.float32)
    return {"narrow": narrow, "holes": holes, "relu": relu, "odd": odd}


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _one_thread(monkeypatch, x) -> RunningStats:
    with monkeypatch.context() as m:
        m.setattr(team, "entry", lambda: (0, 0))
        m.setattr(stats.threads, "total", 1)
        return batch_stats(torch.from_numpy(x))


def _counts(s: RunningStats) -> np.ndarray:
    h = LogHistogram()
    s.hist.add_to(h.counts)
    return h.counts


@pytest.mark.parametrize("name", list(_batches()))
def test_split_on_torch_threads_equals_one_thread_and_numpy(name, monkeypatch, two_threads):
    x = _batches()[name]
    y = x.reshape(16, x.shape[1], -1)
    width, entry = team.entry()
    assert width == 2 and entry and stats._split(y) == (2, entry)
    split, alone = batch_stats(torch.from_numpy(x)), _one_thread(monkeypatch, x)
    assert not stats._scratch.hist._rows.any()  # left clean
    assert np.array_equal(_counts(split), _counts(alone))
    for f in ("count", "positive"):
        assert np.array_equal(getattr(split.units, f), getattr(alone.units, f))
    for f in ("min", "max", "sum"):
        np.testing.assert_allclose(getattr(split.units, f), getattr(alone.units, f), rtol=1e-12)
    finite = x[np.isfinite(x)].astype(np.float64)
    running = RunningStats()
    running.merge(split)
    row = running.as_row()
    assert (row["n"], row["nan_count"], row["inf_count"]) == (
        finite.size,
        int(np.isnan(x).sum()),
        int(np.isinf(x).sum()),
    )
    np.testing.assert_allclose(row["mean"], finite.mean(), rtol=1e-12)
    np.testing.assert_allclose(row["std"], finite.std(), rtol=1e-9)
    assert (row["min"], row["max"]) == (finite.min(), finite.max())
    assert _counts(split).sum() == finite.size  # NaN and Inf are counted apart
    for u in range(x.shape[1]):  # per-unit extremes over finite values
        unit = x[:, u][np.isfinite(x[:, u])]
        assert (split.units.min[u], split.units.max[u]) == (unit.min(), unit.max())


@pytest.mark.parametrize("name", list(_batches()))
def test_hook_statistics_folded_in_equal_numpy(name, two_threads):
    """HookStats' packed results (two halves of a batch, as two batches), folded straight into
    running statistics, against numpy: scalars, the histogram and every unit's fields."""
    x = _batches()[name]
    hook = stats.HookStats()
    hook.begin()
    s = RunningStats()
    for half in (x[:7], x[7:]):
        pending = hook(torch.from_numpy(half))
        assert type(pending) is stats.Pending
        s.merge(pending)
    assert not stats._scratch.hist._rows.any()  # left clean
    ok = np.isfinite(x)
    finite = x[ok].astype(np.float64)
    assert (s.n, s.rows, s.nan_count, s.inf_count) == (
        finite.size,
        16,
        np.isnan(x).sum(),
        np.isinf(x).sum(),
    )
    np.testing.assert_allclose([s.mean, s.m2 / s.n], [finite.mean(), finite.var()], rtol=1e-9)
    assert (s.min, s.max, s.zeros) == (finite.min(), finite.max(), (finite == 0).sum())
    buckets = np.bincount(x[ok].view(np.uint32) >> 16, minlength=1 << 16)
    assert np.array_equal(s.hist.counts, buckets)
    values = np.where(ok, x, np.nan).astype(np.float64)
    rows = values.reshape(16, -1)
    norms = np.sqrt(np.nansum(rows * rows, axis=1))
    np.testing.assert_allclose(
        [s.abs_sum, s.l2_sum], [np.abs(finite).sum(), norms.sum()], rtol=1e-9
    )
    rest = tuple(a for a in range(x.ndim) if a != 1)
    assert np.array_equal(s.units.count, ok.sum(axis=rest))
    assert np.array_equal(s.units.positive, (values > 0).sum(axis=rest))
    np.testing.assert_allclose(s.units.sum, np.nansum(values, axis=rest), rtol=1e-9)
    assert np.array_equal(s.units.min, np.nanmin(values, axis=rest))
    assert np.array_equal(s.units.max, np.nanmax(values, axis=rest))


def test_running_histogram_of_split_batches_equals_numpy(two_threads):
    """RunningStats.update counts into its own int64 histogram from every thread of the team."""
    batches = _batches()
    s = RunningStats()
    for x in batches.values():
        backend.fold(s, torch.from_numpy(x))
    every = np.concatenate([x.ravel() for x in batches.values()])
    finite = every[np.isfinite(every)].astype(np.float64)
    assert s.hist.counts.sum() == finite.size
    np.testing.assert_allclose(s.mean, finite.mean(), rtol=1e-12)
    buckets = np.bincount(every[np.isfinite(every)].view(np.uint32) >> 16, minlength=1 << 16)
    assert np.array_equal(s.hist.counts, buckets)


def test_only_the_thread_that_runs_the_forward_uses_the_team():
    """Another thread (the writer) would get a team of new threads competing with the forward."""
    seen = []
    t = threading.Thread(target=lambda: seen.append(team.entry()[0]))
    t.start()
    t.join()
    assert seen == [0]
    assert team.entry()[0] == torch.get_num_threads()


def _in_forked_child(work) -> str:
    """What work() returns in a forked child; fails (killing it) if it does not finish."""
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(writer, work().encode())
        finally:
            os._exit(0)
    os.close(writer)
    try:
        ready, _, _ = select.select([reader], [], [], 60)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            pytest.fail("the forked child hung")
        with os.fdopen(reader) as r:
            return r.read()
    finally:
        os.waitpid(pid, 0)


def test_a_forked_child_does_not_use_its_parents_team(two_threads):
    """libgomp's threads do not survive fork: a child would wait for them forever."""
    x = _batches()["holes"]
    batch_stats(torch.from_numpy(x))  # the parent has used the team
    got = _in_forked_child(lambda: f"{team.entry()[0]} {batch_stats(torch.from_numpy(x)).n}")
    assert got == f"0 {int(np.isfinite(x).sum())}"


def test_a_forked_child_splits_without_its_parents_thread_pool(monkeypatch):
    """The pool's threads do not survive fork either: the child does every part itself."""
    monkeypatch.setattr(stats, "threads", Threads(3))
    monkeypatch.setattr(team, "entry", lambda: (0, 0))
    x = np.random.default_rng(2).standard_normal((6, 8, 128 * 64)).astype(np.float32)
    assert batch_stats(x).n == x.size  # the parent uses its pool
    assert _in_forked_child(lambda: str(batch_stats(x).n)) == str(x.size)


def test_the_team_entry_needs_torchs_runtime():
    """Without torch's OpenMP runtime in the process there is no address to call: no team (not a
    jump to address 0), and the statistics are taken on our own threads."""
    code = (
        "import sys, numpy as np\n"
        "from probe.stats import team\n"
        "from probe.stats.numba_backend import batch_stats\n"
        "x = np.random.default_rng(0).standard_normal((16, 8, 4096)).astype(np.float32)\n"
        "print(team.entry(), 'torch' in sys.modules, batch_stats(x).mean - x.astype(float).mean())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    entry, torch_loaded, error = done.stdout.rsplit(" ", 2)
    assert (entry, torch_loaded) == ("(0, 0)", "False"), done.stdout + done.stderr
    assert abs(float(error)) < 1e-12
