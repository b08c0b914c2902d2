"""What a run's statistics move to the host per batch on the path a GPU's values take (here on
the CPU: `stats.backend=torch`, which reduces CPU values on that path too), and that the file it
writes is the host path's.

Each site's 65,536-bucket quantile sketch and its units' rows stay on its device, merged there
across batches (probe.stats.device_sketch, all of a batch's sites together); per batch, one copy
for all sites (counted through the one function that makes it, probe.hooks.device.copy_to_host)
of a dozen numbers a site, whatever its units and parameters, and no value read into Python
(`aten._local_scalar_dense`); the sketches and units come over where /stats is written. The
statistics, histograms and summary equal those the host computes from the stored rows, and a
stopped run resumed equals one that was not stopped.
"""

from __future__ import annotations

import h5py
import numpy as np
import pandas as pd
import pytest
import torch

from probe.launch import batch as batch_module
from probe.launch import run as run_module
from probe.launch.parts.statistics import Statistics
from probe.launch.run import run
from probe.stats import device_fetch, device_sketch, torch_backend
from probe.stats.batched_read import HEAD
from probe.stats.stat_columns import SCALARS
from probe.stats.torch_backend import BINS
from probe.testing.arrays import file_arrays
from probe.testing.compose import make_cfg
from tests.helpers import run_interrupted
from tests.train.test_step_transfers import Reads

TINY = [
    "model=custom",
    "model._target_=probe.testing.models.SignalsItself",
    "model.input_shape=[3,8,8]",
    "model.num_classes=10",
    "probes=param_grads",
    "probes.params.capture=[output,grad_output,param_grad]",
    "dataset.num_samples=10",
    "dataset.batch_size=3",
]
DEVICE_PATH = ["stats.backend=torch"]
BATCHES = 4  # (10 samples, 3 a batch)


@pytest.fixture(params=["reference", "fused"])
def reduction(request, monkeypatch):
    """The torch backend's reduction on the CPU (its own), and the one a GPU takes."""
    monkeypatch.setattr(torch_backend, "_reduction", request.param)
    return request.param


def _arrays(path) -> dict:
    with h5py.File(path) as f:
        return file_arrays(f)


def _same_statistics(got: dict, want: dict) -> None:
    """/stats equal: counts, extremes, histograms and units exactly, the float sums (moments)
    within float64 rounding: relative, and for the mean also against the values' magnitudes (the
    device sums a site's units in another order than numpy: a gradient's mean near 0 carries
    its sum's rounding, about 1e-16 of the mean magnitude)."""
    stats = [k for k in want if k.startswith("stats/")]
    assert stats and sorted(k for k in got if k.startswith("stats/")) == sorted(stats)
    at = {name: i for i, name in enumerate(SCALARS)}
    for name in stats:
        if name.endswith("/scalars"):
            a, b = np.asarray(got[name], dtype=np.float64), np.asarray(want[name], np.float64)
            magnitude = b[..., at["abs_sum"]] / np.maximum(b[..., at["n"]], 1)
            atol = np.zeros_like(b)
            atol[..., at["mean"]] = 1e-12 * magnitude
            assert (np.abs(a - b) <= atol + 1e-12 * np.abs(b)).all(), (name, a, b)
        else:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_the_device_path_writes_the_statistics_the_host_computes(tmp_path, reduction):
    """A stats-only run on the device path against a full run whose statistics the host
    computes at the close from its stored rows, batch by batch (stats.during=close): the same
    /stats (histograms bucket for bucket) and summary.csv."""
    device = run(make_cfg(*TINY, *DEVICE_PATH, "store.mode=stats"), run_dir=tmp_path / "device")
    host = run(make_cfg(*TINY, *DEVICE_PATH, "stats.during=close"), run_dir=tmp_path / "host")
    _same_statistics(_arrays(device.h5_path), _arrays(host.h5_path))
    pd.testing.assert_frame_equal(device.summary, host.summary, check_exact=False, rtol=1e-12)
    assert {"output", "grad_output", "param_grad.weight"} <= set(device.summary.site)


@pytest.mark.parametrize(
    "store",
    [["store.mode=stats", "store.flush_seconds=0"], ["store.mode=full"]],
    ids=["stats-flush-every-batch", "full"],
)
def test_a_stopped_device_path_run_resumed_equals_one_not_stopped(tmp_path, store):
    """A SIGINT in the 3rd forward (its batch kept); the sketches of the written batches reach the file as it
    closes (and at every flush, flush_seconds=0), and the resumed run, whose sketches start
    from the file's, writes the file of a run that was never stopped."""
    args = [*TINY, *DEVICE_PATH, *store]
    whole = run(make_cfg(*args), run_dir=tmp_path / "whole")
    run_interrupted(tmp_path / "run", 2, *args)
    with h5py.File(tmp_path / "run" / "probe.h5") as f:
        assert int(f.attrs["num_samples"]) == 9 and not f.attrs["complete"]
    resumed = run(make_cfg(*args, "resume=true"), run_dir=tmp_path / "run")
    pd.testing.assert_frame_equal(resumed.summary, whole.summary, check_exact=True)
    got, want = _arrays(resumed.h5_path), _arrays(whole.h5_path)
    assert got.keys() == want.keys()
    for name, a in want.items():
        np.testing.assert_array_equal(got[name], a, err_msg=name)


def _counted_copies(monkeypatch) -> list[tuple[bool, int]]:
    """Each copy the statistics ask of probe.hooks.device.copy_to_host: (made to write /stats,
    values): a batch's from probe.stats.device_sketch, the sketches' and units' from
    probe.stats.device_fetch."""
    copies: list[tuple[bool, int]] = []

    def counted(module, fetching: bool) -> None:
        real = module.copy_to_host

        def copy(t):
            copies.append((fetching, t.numel()))
            return real(t)

        monkeypatch.setattr(module, "copy_to_host", copy)

    counted(device_sketch, False)
    counted(device_fetch, True)
    return copies


def test_one_small_copy_per_batch_and_the_sketches_once_at_the_end(tmp_path, monkeypatch):
    """Per batch, one copy for all its sites, of their accumulators alone (the batch's scalars
    and its sketch's bucket count: 88 bytes a site, where a sketch alone is 512 KiB and the
    units' rows were most of the 29 KB a resnet18 convolution moved), and no value read into
    Python in the statistics' per-batch path (reduction, batched read, one copy, fold into the
    running statistics); the sketches and units of every site in one copy when the file is
    written."""
    monkeypatch.setattr(torch_backend, "_reduction", "fused")  # (the reduction a GPU takes)
    copies = _counted_copies(monkeypatch)
    reads = Reads()

    def reading(method):
        def wrapped(*args, **kwargs):
            with reads:
                return method(*args, **kwargs)

        return wrapped

    for name in ("took", "after_forward"):
        monkeypatch.setattr(Statistics, name, reading(getattr(Statistics, name)))
    put = run_module.Sink.put
    monkeypatch.setattr(run_module.Sink, "put", reading(put))  # (a stats-only CPU batch folds)
    args = [*TINY, *DEVICE_PATH, "store.mode=stats", "store.flush_seconds=3600"]  # (one flush)
    result = run(make_cfg(*args), run_dir=tmp_path)
    sites = len(result.summary)
    per_batch = [n for written, n in copies if not written]
    at_the_end = [n for written, n in copies if written]
    assert per_batch == [sites * (HEAD + 1)] * BATCHES, copies
    with h5py.File(result.h5_path) as f:
        units = sum(g["units"].shape[1] for g in _stats_groups(f) if "units" in g)
    assert units > 0
    assert at_the_end == [sites * BINS + 6 * units], copies  # every site's sketch and units
    assert reads.reads == 0


def _stats_groups(f: h5py.File) -> list:
    return [f["stats"][layer][site] for layer in f["stats"] for site in f["stats"][layer]]


def test_a_stats_only_batch_moves_the_same_bytes_whatever_the_parameter_count(
    tmp_path, monkeypatch
):
    """The parameter gradients of a stats-only run are reduced where they lie, into the batch's
    one copy: what a batch hands to the host (the tensors given to probe.hooks.device.to_host,
    which copies a GPU's, and the statistics' copy_to_host) is the same for an MLP of 4x
    the weights and units (its statistics, equal to the host path's, are
    test_the_device_path_writes_the_statistics_the_host_computes's)."""
    monkeypatch.setattr(torch_backend, "_reduction", "fused")
    copies = _counted_copies(monkeypatch)
    handed: list[int] = []
    real = batch_module.devices.to_host

    def to_host(*groups):
        handed.append(sum(t.numel() * t.element_size() for g in groups for t in g.values()))
        return real(*groups)

    monkeypatch.setattr(batch_module.devices, "to_host", to_host)
    per_batch = {}
    for width in (16, 64):  # (the first layer's weight: width x 192)
        copies.clear()
        handed.clear()
        args = ["model=mlp", f"model.width={width}", "model.depth=2", "probes=param_grads",
                "dataset.num_samples=10", "dataset.batch_size=3", *DEVICE_PATH,
                "store.mode=stats"]  # fmt: skip
        run(make_cfg(*args), run_dir=tmp_path / str(width))
        per_batch[width] = (list(handed), [n for written, n in copies if not written])
    assert per_batch[16] == per_batch[64]
    handed_bytes, values = per_batch[64]
    assert len(handed_bytes) == len(values) == BATCHES
    assert values == [6 * (HEAD + 1)] * BATCHES  # (3 layers, a weight and a bias each)
    assert max(handed_bytes) < 16 * 192 * 4  # (the smaller model's first gradient alone)


@pytest.mark.cuda
def test_a_device_path_run_on_a_gpu_makes_no_synchronising_call(tmp_path, monkeypatch):
    """On a GPU a batch's forward, backward, statistics and hand-over to the writer make no
    synchronising call (CUDA's sync debug mode raises on each) after the first batch (which
    the size plan reads), and the file counts what the CPU's counts."""
    from probe.launch import batch as batch_module

    real = batch_module.run_batch
    seen = []

    def strict(setup, parts, capture, batch, index):
        if not seen:
            seen.append(index)
            return real(setup, parts, capture, batch, index)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return real(setup, parts, capture, batch, index)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(run_module, "run_batch", strict)
    args = [*TINY, "store.mode=stats"]
    gpu = run(make_cfg(*args, "device=cuda"), run_dir=tmp_path / "gpu")
    monkeypatch.setattr(run_module, "run_batch", real)
    cpu = run(make_cfg(*args, *DEVICE_PATH), run_dir=tmp_path / "cpu")
    got, want = _arrays(gpu.h5_path), _arrays(cpu.h5_path)
    scalars = [k for k in want if k.endswith("/scalars")]
    assert scalars and sorted(k for k in got if k.endswith("/scalars")) == sorted(scalars)
    for name in scalars:  # rows, finite values: as the CPU's; the sketch counts every one
        np.testing.assert_array_equal(got[name][:2], want[name][:2], err_msg=name)
        hist = name.replace("/scalars", "/hist")
        assert got[hist][1].sum() == want[hist][1].sum(), hist
