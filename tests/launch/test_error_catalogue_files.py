"""docs/errors.md entries about files: a group set to null, another tool's HDF5 file, a file whose
writer has not flushed yet, and Ctrl-C as the last batch ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import h5py
import numpy as np
import pytest

import probe
from probe.launch.run import run
from probe.read.summaries import summarize_file
from probe.store.runfile import NothingFlushed, open_probe_file
from probe.testing.compose import QUIET, make_cfg
from probe.testing.models import SignalsItself
from tests.helpers import ROOT

TINY = [
    "model=custom",
    "model._target_=probe.testing.models.TinyNet",
    "model.input_shape=[3,8,8]",
    "model.num_classes=10",
    "dataset.num_samples=6",
    "dataset.batch_size=2",
]


@pytest.mark.parametrize("arg", ["probes=null", "probes={}", "model=null"])
def test_a_config_group_set_to_nothing_is_named(tmp_path, arg):
    out = subprocess.run(
        [sys.executable, "-m", "probe", *QUIET, arg, f"hydra.run.dir={tmp_path / 'run'}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"{arg} names no option of the config group" in out.stderr
    assert "--help lists them" in out.stderr and not (tmp_path / "run").exists()


def test_another_tools_hdf5_file_is_not_called_partial(tmp_path):
    path = tmp_path / "probe.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.arange(3)
    s = summarize_file(path)
    assert s.state == "corrupt" and "not one written by probe" in s.message
    with pytest.raises(probe.DataError, match="not one written by probe"):
        probe.open_run(path)


def test_a_file_whose_writer_has_not_flushed_says_so(tmp_path):
    """A writer still in its plain phase (before its first batch): in progress while its lock is
    held; without a lock file (not a run's directory) no batch can be read, and the way to clear
    the mark is named; never "damaged"."""
    path = tmp_path / "probe.h5"
    writer = subprocess.Popen(  # another process holds it open for writing, not yet in SWMR mode
        [sys.executable, "-c", WRITER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert writer.stdout.readline().strip() == "ready"
        with pytest.raises(NothingFlushed, match="no batch can be read.*probe.store.swmr") as e:
            open_probe_file(path)
        assert not e.value.in_progress
        assert summarize_file(path).state == "partial"
        from probe.store import runlock

        with runlock.hold(tmp_path):
            with pytest.raises(NothingFlushed, match="is in progress") as e:
                open_probe_file(path)
            assert e.value.in_progress and summarize_file(path).state == "in progress"
    finally:
        writer.communicate("", timeout=60)


WRITER = """
import sys, h5py
from probe.store.fileformat import Progress, write_progress
f = h5py.File(sys.argv[1], "w", libver=("v110", "v110"), locking=False)
f.attrs["format_version"] = 2
write_progress(f, Progress())
f.flush()
print("ready", flush=True)
sys.stdin.read()
f.close()
"""


def test_ctrl_c_during_the_last_batch_leaves_a_complete_run(tmp_path):
    """The signal arrives in the last forward: every batch is written, so the run finishes as
    complete, with its summary, instead of calling itself interrupted."""
    SignalsItself.at_call = 2  # the third and last batch (calls count from 0)
    SignalsItself.signal = signal.SIGINT
    try:
        result = run(
            make_cfg(*TINY, "model._target_=probe.testing.models.SignalsItself"),
            run_dir=tmp_path,
        )
    finally:
        SignalsItself.at_call = None
    assert result.num_samples == 6 and (tmp_path / "summary.csv").is_file()
    with h5py.File(result.h5_path) as f:
        assert f.attrs["complete"] and int(f.attrs["num_samples"]) == 6


def test_the_python_api_refuses_an_oversized_seed_before_torch_does(tmp_path):
    import torch

    with pytest.raises(probe.ConfigError, match="seed=100000000000000000000 is out of range"):
        probe.run(torch.nn.Linear(3, 2), [torch.randn(2, 3)], "all_linear", out=tmp_path / "r",
                  seed=10**20)  # fmt: skip
    assert not (tmp_path / "r" / "probe.h5").exists()
