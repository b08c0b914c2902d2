"""Many runs in one process keep file handles and memory flat; a failed run leaves nothing behind."""

from __future__ import annotations

import gc
import os
import threading

import h5py
import pytest

from probe.errors import ModelError
from probe.launch.run import run
from probe.testing.compose import make_cfg
from probe.testing.models import assert_no_hooks, built_models
from tests.helpers import cli

TINY = [
    "model=custom",
    "model.input_shape=[3,8,8]",
    "model.num_classes=10",
    "dataset.num_samples=6",
    "dataset.batch_size=2",
    "probes=everything",
]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def nothing_left_behind() -> None:
    gc.collect()
    kinds = h5py.h5f.OBJ_FILE | h5py.h5f.OBJ_DATASET | h5py.h5f.OBJ_GROUP | h5py.h5f.OBJ_ATTR
    assert h5py.h5f.get_obj_ids(types=kinds) == []  # no file, dataset, group or attribute open
    assert not [t for t in threading.enumerate() if t.name == "probe-writer"]
    for model in built_models():
        assert_no_hooks(model)


def test_a_thirty_run_sweep_keeps_handles_and_memory_flat(tmp_path):
    """`python -m probe -m seed=0,...,29`: Hydra's basic launcher runs the 30 jobs one after the
    other in one process; the model samples fds and RSS as each job starts."""
    log = tmp_path / "resources.txt"
    out = cli(
        *TINY,
        "model._target_=probe.testing.models.RecordsResources",
        f"+model.kwargs.log={log}",
        f"seed={','.join(map(str, range(30)))}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        "-m",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    samples = [tuple(map(int, line.split())) for line in log.read_text().splitlines()]
    assert len(samples) == 30
    assert len(list((tmp_path / "sweep").glob("*/probe.h5"))) == 30
    warm = samples[5:]  # after imports and allocator pools settle
    assert len({fds for fds, _ in warm}) == 1, samples
    growth_mib = (warm[-1][1] - warm[0][1]) / 1024
    assert growth_mib < 30, f"RSS grew {growth_mib:.1f} MiB over 25 jobs: {samples}"


@pytest.mark.parametrize("ok_calls", [0, 2], ids=["first-batch", "third-batch"])
def test_a_run_that_raises_leaves_no_hook_handle_or_thread(tmp_path, ok_calls):
    cfg = make_cfg(
        *TINY, "model._target_=probe.testing.models.Raises", f"+model.kwargs.ok_calls={ok_calls}"
    )
    fds = open_fds()
    with pytest.raises(ModelError, match="deliberate failure"):
        run(cfg, run_dir=tmp_path)
    nothing_left_behind()
    assert open_fds() == fds
    with h5py.File(tmp_path / "probe.h5") as f:
        assert int(f.attrs["num_samples"]) == 2 * ok_calls and not f.attrs["complete"]
