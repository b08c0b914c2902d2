"""One run per run directory: a second run into a directory being written is refused before it
touches anything, default directories differ for jobs started in the same second, and a probe.h5
already there is only continued (resume=true) or replaced (overwrite=true).

Every file a run leaves is compared with an uninterrupted in-process run of the same config, and
a refused run must leave the files already there byte-identical.
"""

from __future__ import annotations

import logging
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

import probe
from probe.errors import ConfigError
from probe.launch.run import run
from probe.store import runlock
from probe.testing.compose import QUIET, make_cfg
from probe.testing.models import TinyNet
from tests.helpers import ROOT, assert_same_arrays, cli

TINY = [
    "model=custom",
    "model._target_=probe.testing.models.TinyNet",
    "model.input_shape=[3,8,8]",
    "model.num_classes=10",
    "probes=everything",
    "dataset.batch_size=3",
]
SLOW = [*TINY, "dataset.num_samples=30", "+model.kwargs.delay=0.4"]  # 10 batches, ~4 s
QUICK = [*TINY, "dataset.num_samples=6"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted in-process runs: the 30-sample config (seed 0) and the 6-sample one."""
    root = tmp_path_factory.mktemp("reference")
    run(make_cfg(*TINY, "dataset.num_samples=30"), run_dir=root / "slow")
    run(make_cfg(*QUICK), run_dir=root / "quick")
    run(make_cfg(*QUICK, "seed=1"), run_dir=root / "quick-seed1")
    return root


def env() -> dict:
    out = {**os.environ, "PYTHONPATH": str(ROOT)}
    out.pop("HYDRA_FULL_ERROR", None)
    return out


def start(*args: str, cwd: Path = ROOT) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "probe", *QUIET, *args],
        cwd=cwd,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def snapshot(run_dir: Path) -> dict[str, bytes]:
    """Every file of a run directory (Hydra's included), by its relative path."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}


def assert_equal_runs(got: Path, want: Path) -> None:
    """probe.h5 value for value and summary.csv byte for byte; the file is complete."""
    assert assert_same_arrays(got / "probe.h5", want / "probe.h5") > 0
    assert (got / "summary.csv").read_bytes() == (want / "summary.csv").read_bytes()
    assert not (got / runlock.LOCK_NAME).exists()  # released at the end


def test_a_second_run_into_a_directory_being_written_is_refused_and_changes_nothing(
    tmp_path, reference, cli_in_process
):
    run_dir = tmp_path / "run"
    first = start(*SLOW, f"hydra.run.dir={run_dir}")
    wait_for(run_dir / "probe.h5", first)
    mine = (run_dir / ".hydra" / "config.yaml").read_bytes()
    second = cli_in_process(*SLOW, "seed=1", f"hydra.run.dir={run_dir}")
    still_running = first.poll() is None
    out = first.communicate(timeout=300)[0]
    assert still_running, "the first run ended before the second one tried"
    assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr
    assert f"is being written by another run (pid {first.pid} on host " in second.stderr
    assert "wait for it to finish, or choose another directory (hydra.run.dir=PATH" in second.stderr
    assert first.returncode == 0, out
    assert_equal_runs(run_dir, reference / "slow")
    assert (run_dir / ".hydra" / "config.yaml").read_bytes() == mine
    assert yaml.safe_load(mine)["seed"] == 0
    assert "seed=1" not in (run_dir / ".hydra" / "overrides.yaml").read_text()
    assert "being written" not in (run_dir / "probe.log").read_text()
    assert runlock.holder(run_dir) is None


def test_holder_names_the_live_run_and_not_a_killed_one(tmp_path, reference, cli_in_process):
    """While a run writes, holder() names it; after SIGKILL its lock file is left but holds
    nothing, a rerun without resume refuses and changes no byte, and resume=true finishes the
    file as the uninterrupted run wrote it."""
    run_dir = tmp_path / "run"
    first = start(*SLOW, "hydra.verbose=probe", f"hydra.run.dir={run_dir}")
    for line in first.stdout:
        if "flushed batch 1 " in line:
            who = runlock.holder(run_dir)
            first.send_signal(signal.SIGKILL)
            break
    first.communicate(timeout=120)
    assert re.fullmatch(rf"pid {first.pid} on host \S+ since \d{{4}}-\d\d-\d\d [\d:]{{8}}", who)
    assert (run_dir / runlock.LOCK_NAME).exists() and runlock.holder(run_dir) is None
    before = snapshot(run_dir)
    del before[runlock.LOCK_NAME]  # the rerun takes the stale lock and removes it on release

    again = cli_in_process(*SLOW, f"hydra.run.dir={run_dir}")
    assert again.returncode == 2 and "Traceback" not in again.stderr, again.stderr
    assert re.search(
        r"already holds probe\.h5 \(partial, \d+ of 30 samples\); continue it with resume=true "
        r"or replace it with overwrite=true, or choose a new hydra\.run\.dir",
        again.stderr,
    ), again.stderr
    assert snapshot(run_dir) == before

    run(make_cfg(*SLOW, "resume=true"), run_dir=run_dir)
    assert_equal_runs(run_dir, reference / "slow")


def test_a_rerun_refuses_a_complete_file_and_overwrite_replaces_it(
    tmp_path, reference, cli_in_process
):
    run_dir = tmp_path / "run"
    assert cli(*QUICK, f"hydra.run.dir={run_dir}", cwd=tmp_path).returncode == 0
    assert_equal_runs(run_dir, reference / "quick")
    before = snapshot(run_dir)

    refused = cli_in_process(*QUICK, "seed=1", f"hydra.run.dir={run_dir}")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "already holds probe.h5 (complete, 6 samples); continue it with resume=true" in (
        refused.stderr
    )
    assert snapshot(run_dir) == before  # probe.h5, .hydra/ and the log, byte for byte

    both = cli_in_process(*QUICK, "resume=true", "overwrite=true", f"hydra.run.dir={run_dir}")
    assert both.returncode == 2 and "ask for opposite things" in both.stderr
    assert snapshot(run_dir) == before

    replaced = cli(*QUICK, "seed=1", "overwrite=true", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert replaced.returncode == 0, replaced.stderr
    assert_equal_runs(run_dir, reference / "quick-seed1")
    assert yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())["seed"] == 1


def test_an_in_process_run_refuses_an_existing_file_too(tmp_path, reference):
    """probe.launch.run.run (multirun jobs, scripts) checks under the lock, before the writer."""
    run(make_cfg(*QUICK), run_dir=tmp_path)
    before = snapshot(tmp_path)
    with pytest.raises(ConfigError, match=r"already holds probe\.h5 \(complete, 6 samples\)"):
        run(make_cfg(*QUICK, "seed=1"), run_dir=tmp_path)
    assert snapshot(tmp_path) == before
    run(make_cfg(*QUICK, "seed=1", "overwrite=true"), run_dir=tmp_path)
    assert_equal_runs(tmp_path, reference / "quick-seed1")


SAME_SECOND = """
import sys, time
from probe.__main__ import main
at = float(sys.argv[1])
time.sleep(max(0.0, at - time.time()))
sys.argv = ["probe", *sys.argv[2:]]
main()
"""


def test_default_directories_of_jobs_started_in_the_same_second_differ(tmp_path, reference):
    """Both processes import first, then start their job at the same instant (a whole second
    plus 20 ms), with hydra.run.dir at its default under their working directory."""
    for attempt in range(3):
        cwd = tmp_path / str(attempt)
        cwd.mkdir()
        at = math.ceil(time.time()) + 4.02
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", SAME_SECOND, str(at), *QUIET, *QUICK],
                cwd=cwd,
                env=env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for _ in range(2)
        ]
        outs = [p.communicate(timeout=300)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs
        dirs = sorted(p.parent for p in cwd.glob("outputs/*/*/probe.h5"))
        assert len(dirs) == 2
        names = [re.fullmatch(r"(\d\d-\d\d-\d\d)\.(\d{6})-(\d+)", d.name) for d in dirs]
        assert all(names), dirs
        assert {int(m[3]) for m in names} == {p.pid for p in procs}
        for d in dirs:
            assert_equal_runs(d, reference / "quick")
            assert (d / ".hydra" / "config.yaml").is_file()
        if names[0][1] == names[1][1]:  # the same second: the case this test is about
            return
    pytest.fail("the two jobs never started in the same second")


def test_run_and_sweep_directories_resolve_once_per_config():
    """`${run_suffix:}` is cached per config like `${now:...}`: the directory the lock is taken in
    is the job's; both carry this process's id."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from probe.config import config_dir

    with initialize_config_dir(version_base="1.3", config_dir=config_dir()):
        cfg = compose("config", return_hydra_config=True)
    for key in ("hydra.run.dir", "hydra.sweep.dir"):
        first = OmegaConf.select(cfg, key)
        assert OmegaConf.select(cfg, key) == first
        assert re.search(rf"/\d\d-\d\d-\d\d\.\d{{6}}-{os.getpid()}$", first), first


def _main_here(monkeypatch, *args: str) -> int:
    """The console entry point in this process; its exit code."""
    from probe.__main__ import main

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(sys, "argv", ["probe", *QUIET, *args])
    try:
        main()
        return 0
    except SystemExit as e:
        return e.code
    finally:
        for handler in logging.root.handlers[:]:
            logging.root.removeHandler(handler)
            handler.close()


def test_the_cli_in_one_process_claims_its_own_lock_and_refuses_a_held_one(
    tmp_path, reference, monkeypatch, capfd
):
    """The callback's lock is claimed by the job (no deadlock) and released at exit; a directory
    locked by another run of this process is refused before Hydra writes .hydra/ into it."""
    run_dir = tmp_path / "run"
    assert _main_here(monkeypatch, *QUICK, f"hydra.run.dir={run_dir}") == 0
    assert_equal_runs(run_dir, reference / "quick")
    assert runlock._HELD == {}

    other = tmp_path / "other"
    with runlock.reserve(other):
        assert runlock.holder(other).startswith(f"pid {os.getpid()} (this process) on host ")
        capfd.readouterr()
        assert _main_here(monkeypatch, *QUICK, f"hydra.run.dir={other}") == 2
        err = capfd.readouterr().err
        assert f"is being written by another run (pid {os.getpid()} (this process)" in err
        assert sorted(p.name for p in other.iterdir()) == [runlock.LOCK_NAME]
    assert not other.exists()  # made for the lock alone: removed with it
    assert runlock._HELD == {}


def test_the_python_api_refuses_a_second_run_into_a_directory_in_use(tmp_path):
    """Two probe.launch.run calls into one `out` in one process: the second is refused while the first
    runs, which then finishes with the values of a run alone; a later call refuses the finished
    run unless overwrite=True, which replaces it."""
    torch.manual_seed(0)
    batches = [torch.randn(3, 3, 8, 8) for _ in range(6)]
    model = TinyNet()
    probe.run(model, batches, "everything", out=tmp_path / "alone", progress=False).close()

    out = tmp_path / "out"
    model.delay = 0.3
    failure: list[BaseException] = []

    def first() -> None:
        try:
            probe.run(model, batches, "everything", out=out, progress=False).close()
        except BaseException as e:  # shown by the assertion below
            failure.append(e)

    thread = threading.Thread(target=first)
    thread.start()
    deadline = time.monotonic() + 60
    while runlock.holder(out) is None and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(runlock.RunDirBusy, match=r"\(pid \d+ \(this process\) on host"):
        probe.run(TinyNet(), batches, "everything", out=out, progress=False)
    assert thread.is_alive()
    thread.join(timeout=120)
    model.delay = 0.0
    assert not failure, failure
    assert_same_arrays(out / "probe.h5", tmp_path / "alone" / "probe.h5")
    assert not (out / runlock.LOCK_NAME).exists()

    before = snapshot(out)
    with pytest.raises(ConfigError, match=r"already holds a run \(probe\.h5: complete, 18 samp"):
        probe.run(model, batches[:2], "everything", out=out, progress=False)
    assert snapshot(out) == before
    probe.run(model, batches[:2], "everything", out=out, overwrite=True, progress=False).close()
    probe.run(model, batches[:2], "everything", out=tmp_path / "two", progress=False).close()
    assert_same_arrays(out / "probe.h5", tmp_path / "two" / "probe.h5")


def test_the_lock_file_fallback_without_fcntl(tmp_path, monkeypatch):
    """Where fcntl is missing: an O_EXCL lock file; a live pid holds it, a dead one's is stale."""
    monkeypatch.setattr(runlock, "fcntl", None)
    with runlock.reserve(tmp_path):
        assert runlock.holder(tmp_path).startswith(f"pid {os.getpid()} (this process)")
        with pytest.raises(runlock.RunDirBusy, match="being written by another run"):
            runlock.acquire(tmp_path)
    assert not (tmp_path / runlock.LOCK_NAME).exists()

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    info = f'{{"pid": {gone.pid}, "host": "{socket.gethostname()}", "since": "then"}}'
    (tmp_path / runlock.LOCK_NAME).write_text(info)
    assert runlock.holder(tmp_path) is None
    with runlock.hold(tmp_path):
        assert runlock.holder(tmp_path).startswith(f"pid {os.getpid()}")
    assert runlock.holder(tmp_path) is None
