"""Many runs in one process keep file handles and memory flat; a failed run leaves nothing behind."""

from __future__ import annotations

import gc
import os
import threading

import h5py
import pytest

from probe.errors import ModelError
from probe.run import run
from tests.helpers import make_cfg
from tests.models_for_tests import assert_no_hooks, built_models

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


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def nothing_left_behind() -> None:
    gc.collect()
    kinds = h5py.h5f.OBJ_FILE | h5py.h5f.OBJ_DATASET | h5py.h5f.OBJ_GROUP | h5py.h5f.OBJ_ATTR
    assert h5py.h5f.get_obj_ids(types=kinds) == []  # no file, dataset, group or attribute open
    assert not [t for t in threading.enumerate() if t.name == "probe-writer"]
    for model in built_models():
        assert_no_hooks(model)


def test_thirty_runs_keep_handles_and_memory_flat(tmp_path):
    cfgs = [
        make_cfg(*TINY, "model._target_=tests.models_for_tests.TinyNet", f"seed={i}")
        for i in range(35)
    ]
    for i, cfg in enumerate(cfgs[:5]):  # warm-up: imports, allocator pools, thread-local caches
        run(cfg, run_dir=tmp_path / f"warm{i}")
    gc.collect()
    fds, rss = open_fds(), rss_mib()
    for i, cfg in enumerate(cfgs[5:]):
        run(cfg, run_dir=tmp_path / f"run{i}")
    gc.collect()
    assert open_fds() == fds
    assert rss_mib() - rss < 30, f"RSS grew from {rss:.0f} to {rss_mib():.0f} MiB over 30 runs"
    nothing_left_behind()


@pytest.mark.parametrize("ok_calls", [0, 2], ids=["first-batch", "third-batch"])
def test_a_run_that_raises_leaves_no_hook_handle_or_thread(tmp_path, ok_calls):
    cfg = make_cfg(
        *TINY, "model._target_=tests.models_for_tests.Raises", f"+model.kwargs.ok_calls={ok_calls}"
    )
    fds = open_fds()
    with pytest.raises(ModelError, match="deliberate failure"):
        run(cfg, run_dir=tmp_path)
    nothing_left_behind()
    assert open_fds() == fds
    with h5py.File(tmp_path / "probe.h5") as f:
        assert int(f.attrs["num_samples"]) == 2 * ok_calls and not f.attrs["complete"]
