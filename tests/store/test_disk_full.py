"""A full disk at any moment loses nothing flushed: at the space guard, while the file closes, when
another process fills the disk mid-run, and on a small tmpfs. Every stop exits 2 with a message
(no traceback, no signal), the file opens with the reference run's first rows, and resume=true
finishes it equal to the uninterrupted run (arrays and decoded statistics).

A file size limit (RLIMIT_FSIZE) stands for the full disk: writes past it fail as on a full disk.
Each run goes through the console entry point in a child forked from a server that imported probe
once (multiprocessing's forkserver): every run needs its own limit, and a fresh interpreter per
run would spend seconds importing torch. A "blind" child's guard sees unlimited space, as when the
disk fills between its check and the write, so the write fails inside HDF5.
"""

from __future__ import annotations

import multiprocessing
import os
import resource
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from probe.launch.run import run
from probe.store.fileformat import read_progress
from probe.store.runfile import open_probe_file
from probe.testing.arrays import h5_arrays
from probe.testing.compose import QUIET, make_cfg
from tests.helpers import assert_same_arrays

TINY = [
    "model=custom",
    "model._target_=probe.testing.models.TinyNet",
    "model.input_shape=[3,8,8]",
    "model.num_classes=10",
    "probes=everything",
]
SMALL = [*TINY, "dataset.num_samples=30", "dataset.batch_size=3"]  # a 0.25 MB file
LARGE = [*TINY, "dataset.num_samples=2000", "dataset.batch_size=100", "store.chunk_bytes=65536"]
STATS = ["store=stats", "store.flush_seconds=0"]  # statistics flushed with every batch
DELAY = "+model.kwargs.delay=0.1"  # slows each forward so the limit lands between batches
SERVER = multiprocessing.get_context("forkserver")


def _child(args: list[str], log: str, limit: int | None, blind: bool) -> None:
    """`python -m probe ARGS` in this forked process, its output into `log`."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.pop("HYDRA_FULL_ERROR", None)
    torch.set_num_threads(1)  # tiny models; runs go side by side
    if limit is not None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    if blind:
        from probe.store import diskspace

        diskspace.free_bytes = lambda path: 1 << 50
    sys.argv = ["probe", *QUIET, *args]
    code = 1
    try:
        from probe.__main__ import main

        main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - printed for the test to see
        traceback.print_exc()
    raise SystemExit(code)  # multiprocessing's exit: its finalizers release tqdm's semaphores


@pytest.fixture(scope="module")
def server():
    SERVER.set_forkserver_preload(["probe.launch.run", "probe.__main__", __name__])


class Run:
    """A CLI run in a forked child: `wait()` gives (exit code, output); a signal gives -signum."""

    def __init__(self, run_dir: Path, *args: str, limit=None, blind=False, log=None):
        self.dir, self.log = run_dir, log or run_dir.with_name(f"{run_dir.name}.log")
        argv = [*args, f"hydra.run.dir={run_dir}"]
        self.proc = SERVER.Process(target=_child, args=(argv, str(self.log), limit, blind))
        self.proc.start()

    def output(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def wait(self) -> tuple[int, str]:
        self.proc.join(timeout=120)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
            pytest.fail(f"the run hung:\n{self.output()}")
        return self.proc.exitcode, self.output()


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """probe.h5 of the uninterrupted run of each config, in this process, made once."""
    made: dict[tuple[str, ...], Path] = {}

    def get(*args: str) -> Path:
        if args not in made:
            d = tmp_path_factory.mktemp("reference")
            made[args] = run(make_cfg(*args), run_dir=d).h5_path
        return made[args]

    return get


def assert_stopped_cleanly(code: int, out: str, *words: str) -> None:
    assert code == 2, f"exit {code}:\n{out}"
    assert "Traceback" not in out and "Exception ignored" not in out, out
    for w in ("probe: error:", "resume=true", *words):
        assert w in out, f"{w!r} not in:\n{out}"


def assert_prefix(path: Path, reference: Path) -> int:
    """The file opens (plainly too); the rows /progress counts are the reference's first rows.
    Returns how many."""
    with open_probe_file(path) as f:
        n = read_progress(f).samples
    h5py.File(path, "r").close()  # plain HDF5 tools open it too: nothing is left marked open
    ref = {k: v for k, v in h5_arrays(reference).items() if not k.startswith("stats/")}
    got = {k: v for k, v in h5_arrays(path).items() if not k.startswith("stats/")}
    if n:
        assert set(got) == set(ref)
    for name, a in got.items():
        assert len(a) >= n, name
        np.testing.assert_array_equal(a[:n], ref[name][:n], err_msg=name)
    return n


def resume(run_dir: Path, *args: str) -> Run:
    """resume=true of the run in `run_dir`, with no limit (started)."""
    log = run_dir.with_name(f"{run_dir.name}.resume.log")
    return Run(run_dir, *args, "resume=true", log=log)


def assert_resumed(r: Run, reference: Path) -> None:
    """The resumed run exits 0 and leaves the uninterrupted run's file."""
    code, out = r.wait()
    assert code == 0, out
    with open_probe_file(r.dir / "probe.h5") as f:
        assert read_progress(f).complete
    assert_same_arrays(r.dir / "probe.h5", reference)


def assert_resumes_to(run_dir: Path, reference: Path, *args: str) -> None:
    assert_resumed(resume(run_dir, *args), reference)


def test_the_guard_stops_before_the_limit_and_resume_finishes(server, references, tmp_path):
    """(1) A limit below the final size: the guard refuses a batch mid-run."""
    reference = references(*LARGE)
    limit = reference.stat().st_size * 3 // 5
    code, out = Run(tmp_path / "run", *LARGE, limit=limit).wait()
    assert_stopped_cleanly(code, out, "is full", "MiB")
    n = assert_prefix(tmp_path / "run" / "probe.h5", reference)
    assert 0 < n < 2000 and f"holds the {n} samples" in out
    assert_resumes_to(tmp_path / "run", reference, *LARGE)


@pytest.mark.parametrize("store", [[], STATS], ids=["full", "stats"])
@pytest.mark.parametrize("blind", [False, True], ids=["guard", "blind-guard"])
def test_a_limit_at_the_final_size_succeeds_or_stops_cleanly(
    server, references, tmp_path, store, blind
):
    """(2) Limits a few bytes and KB around the uninterrupted run's final size: the last batches
    and closing (its statistics, the final counts) land on the limit. Blind, the write that
    crosses it fails inside HDF5."""
    reference = references(*SMALL, *store)
    size = reference.stat().st_size
    offsets = (-4096, -1, 0, 1, 4096) if blind else (-4096, 0, 4096)  # the guard: batch 0
    runs = [  # side by side, one thread each
        Run(tmp_path / f"at{o}", *SMALL, *store, limit=size + o, blind=blind) for o in offsets
    ]
    outcomes, resumed = [], []
    for r in runs:
        code, out = r.wait()
        outcomes.append(code)
        if code == 0:
            assert_same_arrays(r.dir / "probe.h5", reference)
            continue
        assert_stopped_cleanly(code, out, "is full" if not blind else "failed")
        assert_prefix(r.dir / "probe.h5", reference)
        resumed.append(resume(r.dir, *SMALL, *store))
    for r in resumed:
        assert_resumed(r, reference)
    assert set(outcomes) <= {0, 2}


@pytest.mark.skipif(not hasattr(resource, "prlimit"), reason="prlimit is Linux's")
@pytest.mark.parametrize("blind", [False, True], ids=["guard-sees-it", "write-fails"])
def test_another_process_filling_the_disk_mid_run_loses_no_flushed_batch(
    server, references, tmp_path, blind
):
    """(3) After three flushed batches the run's file size limit drops, from outside, to just above
    its file's size. The guard refuses the next batch (and finds no room to close: the file is
    closed as its last flush left it), or, blind, the next batch's write fails inside HDF5. (Should
    this process be so late that the next batch is being written already, the guard's variant
    fails inside HDF5 too: the same outcome, the other message.)"""
    reference = references(*LARGE)
    d = tmp_path / "run"
    r = Run(d, *LARGE, DELAY, "hydra.verbose=probe", blind=blind)
    deadline = time.monotonic() + 60
    while "flushed batch 2 " not in r.output():
        assert r.proc.is_alive() and time.monotonic() < deadline, r.output()
        time.sleep(0.005)
    limit = (d / "probe.h5").stat().st_size + 512
    resource.prlimit(r.proc.pid, resource.RLIMIT_FSIZE, (limit, limit))
    code, out = r.wait()
    assert_stopped_cleanly(code, out)
    messages = ["failed"] if blind else ["is full", "failed"]
    assert any(m in out for m in messages), out
    n = assert_prefix(d / "probe.h5", reference)
    assert 300 <= n < 2000 and f"holds the {n} samples" in out
    assert_resumes_to(d, reference, *LARGE, DELAY)


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs (root on Linux)."""
    d = tmp_path / "disk"
    d.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(d)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except OSError as e:
        pytest.skip(f"cannot mount a tmpfs ({e}): needs Linux and root")
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs ({done.stderr.strip()}): needs Linux and root")
    yield d
    subprocess.run(["umount", str(d)], check=False, timeout=30)


def test_a_small_tmpfs_stops_cleanly_and_resumes_elsewhere(
    server, references, tmp_path, small_disk
):
    """(4) A real full disk: a full run (5 MB) and a stats-only run into a 2 MiB tmpfs each exit 0
    or stop cleanly; a stopped one, moved to a roomy disk, resumes to the reference."""
    outcomes = {}
    for name, store in (("full", []), ("stats", STATS)):
        reference = references(*LARGE, *store)
        d = small_disk / name
        code, out = Run(d, *LARGE, *store, log=tmp_path / f"{name}.log").wait()
        outcomes[name] = code
        roomy = tmp_path / name
        shutil.move(d, roomy)
        if code == 0:
            assert_same_arrays(roomy / "probe.h5", reference)
            continue
        assert_stopped_cleanly(code, out, "is full")
        assert_prefix(roomy / "probe.h5", reference)
        assert_resumes_to(roomy, reference, *LARGE, *store)
    assert outcomes["full"] == 2  # 5 MB cannot fit
