"""The statistics without numba, without torch's OpenMP team, and on a fresh install's first
run: the same values from every backend, real CLI runs in subprocesses."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

import probe
from tests.helpers import ROOT, cli

RUN = [
    "model=resnet18",
    "dataset.image_size=48",
    "dataset.num_samples=7",
    "dataset.batch_size=3",
    "probes=all_activations",
]
pytestmark = pytest.mark.skipif(
    __import__("importlib").util.find_spec("numba") is None, reason="compares with numba"
)


def _without_numba(tmp_path: Path) -> dict:
    """An environment whose Python cannot import numba (a sitecustomize blocks it)."""
    blocker = tmp_path / "no_numba"
    blocker.mkdir(exist_ok=True)
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['numba'] = None\n")
    return {"PYTHONPATH": os.pathsep.join([str(blocker), str(ROOT)])}


def _run(tmp_path: Path, name: str, *args: str, env: dict | None = None) -> Path:
    run_dir = tmp_path / name
    out = cli(*RUN, *args, f"hydra.run.dir={run_dir}", cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return run_dir


def _backend(run_dir: Path) -> str:
    with h5py.File(run_dir / "probe.h5", "r") as f:
        return str(f.attrs["stats_backend"])


def assert_same_statistics(a: Path, b: Path, rtol: float) -> int:
    """Equal counts, extremes (signed zeros too), histograms and per-unit counts; moments and
    sums within `rtol`. Returns how many datasets were compared."""
    with probe.open_run(a) as ra, probe.open_run(b) as rb:
        assert ra.keys == rb.keys
        for layer, site in ra.keys:
            x, y = ra.stats(layer, site), rb.stats(layer, site)
            label = f"{layer} {site}"
            for k in ("rows", "n", "zeros", "nan_count", "inf_count"):
                assert getattr(x, k) == getattr(y, k), (label, k)
            for k in ("min", "max"):
                assert np.array_equal(getattr(x, k), getattr(y, k)), (label, k)
                assert np.signbit(getattr(x, k)) == np.signbit(getattr(y, k)), (label, k)
            np.testing.assert_array_equal(x.hist.counts, y.hist.counts, err_msg=label)
            for k in ("count", "positive", "min", "max"):
                np.testing.assert_array_equal(getattr(x.units, k), getattr(y.units, k), label)
            for k in ("mean", "m2", "abs_sum", "l2_sum"):
                np.testing.assert_allclose(getattr(x, k), getattr(y, k), rtol=rtol, err_msg=k)
            scale = np.maximum(np.abs(x.units.min), np.abs(x.units.max)) * x.units.count
            np.testing.assert_allclose(
                x.units.sum, y.units.sum, rtol=rtol, atol=1e-12 * scale.max()
            )
        return len(ra.keys)


# a team to split across, however many cores the test has (every run compared with the
# compiled one runs its forward on as many threads: the activations are then bit for bit equal)
TWO_THREADS = {"OMP_NUM_THREADS": "2"}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Path:
    """A statistics-only run on numba's kernels, split across torch's OpenMP team of two."""
    root = tmp_path_factory.mktemp("compiled")
    return _run(root, "numba", "stats.backend=numba", "store.mode=stats", env=TWO_THREADS)


def test_without_numba_the_torch_backend_gives_numbas_values(tmp_path, compiled):
    no_numba = {**_without_numba(tmp_path), **TWO_THREADS}  # (the forward as the compiled run's)
    portable = _run(tmp_path, "torch", "store.mode=stats", env=no_numba)
    assert (_backend(compiled), _backend(portable)) == ("numba", "torch")
    assert assert_same_statistics(compiled, portable, rtol=1e-9) >= 9


def test_asking_for_numba_without_it_names_the_extra(tmp_path):
    out = cli(
        *RUN, "stats.backend=numba", f"hydra.run.dir={tmp_path}", env=_without_numba(tmp_path)
    )
    assert out.returncode == 2
    assert "stats.backend=numba needs numba" in out.stderr and ".[fast]" in out.stderr


def test_an_unknown_backend_is_named(tmp_path):
    out = cli(*RUN, "stats.backend=gpu", f"hydra.run.dir={tmp_path}")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "Invalid value 'gpu'" in out.stderr and "auto, torch, numba" in out.stderr


def test_without_torchs_openmp_team_the_values_are_the_same(tmp_path, compiled):
    alone = _run(tmp_path, "alone", "stats.backend=numba", "store.mode=stats",
                 env={**TWO_THREADS, "PROBE_OMP_TEAM": "0"})  # fmt: skip
    assert assert_same_statistics(compiled, alone, rtol=1e-12) >= 9


def test_importing_probe_compiles_and_imports_no_numba():
    code = (
        "import sys, probe, probe.launch.run, probe.read.summaries, probe.__main__, probe.read.runs\n"
        "print('numba' in sys.modules, 'probe.stats.kernels' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.stdout.split() == ["False", "False"], done.stderr
    helped = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "probe", "--help"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert helped.returncode == 0 and "stats" in helped.stdout
    assert " numba" not in helped.stderr  # -X importtime lists every module imported


def _session_machine_code(numba_cache: Path) -> None:
    """numba's machine code of the kernels, as this session compiled it (`compiled_kernels`),
    copied into an empty NUMBA_CACHE_DIR where numba looks for it there: a background warm-up
    then loads it in seconds instead of compiling for a minute on an idle core."""
    from numba.core import caching

    from probe.stats import kernel_cache

    listed = json.loads(kernel_cache.stamp_path().read_text())["index_files"]
    into = numba_cache / caching._CacheLocator.get_suitable_cache_subpath(
        str(kernel_cache.KERNELS / "__init__.py")
    )
    into.mkdir(parents=True)
    for index in map(Path, listed):
        for path in index.parent.glob(index.name.removesuffix(".nbi") + ".*"):
            shutil.copy2(path, into / path.name)


def test_a_fresh_install_runs_on_torch_while_the_kernels_compile(tmp_path):
    """Without a warm-up's stamp: the first run takes the torch backend and says so, a
    low-priority process readies the kernels under NUMBA_CACHE_DIR meanwhile (loading the
    machine code this session compiled: compiling it is `compiled_kernels`' work, from empty
    caches in a fresh clone), and the next run takes numba with the same values."""
    env = {"NUMBA_CACHE_DIR": str(tmp_path / "numba"), "PROBE_CACHE_DIR": str(tmp_path / "probe")}
    _session_machine_code(tmp_path / "numba")
    first = _run(tmp_path, "first", "store.mode=stats", env=env)
    assert _backend(first) == "torch"
    log = (first / "probe.log").read_text()
    assert "numba's faster kernels compile in the background" in log
    locks = tmp_path / "probe"
    deadline = time.monotonic() + 600
    while any(locks.glob("*.lock")) and time.monotonic() < deadline:
        time.sleep(0.2)
    stamps = list(locks.glob("kernels-*.json"))
    assert stamps, "the background compile wrote no stamp"
    listed = json.loads(stamps[0].read_text())["index_files"]
    assert listed and all(Path(p).is_relative_to(tmp_path / "numba") for p in listed)
    second = _run(tmp_path, "second", "store.mode=stats", env=env)
    assert _backend(second) == "numba"
    assert "compile in the background" not in (second / "probe.log").read_text()
    assert assert_same_statistics(first, second, rtol=1e-9) >= 9
