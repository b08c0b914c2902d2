"""The device path (autocast on the CPU here; the GPU test runs where there is one) and the plan
logged before a run: bytes per sample and the projected file size against the real file."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest
import torch
from hydra.errors import ConfigCompositionException

from probe.data.batches import build_batches
from probe.hooks.record import Record
from probe.hooks.step_context import Outputs
from probe.launch.size_plan import log_transfer
from probe.models.build import build_model
from probe.plan import parse
from probe.stats.backend import DeviceStats
from probe.store.folds import StatsFold
from probe.testing.compose import make_cfg
from tests.helpers import cloned_outputs, run_probe

TINY = ["model=resnet18", "dataset.image_size=32", "dataset.num_samples=5", "dataset.batch_size=2"]
LAYERS = ["probes=all_convs", "probes.convs.layers=[conv1,layer2.*,layer4.1.conv2]"]


def outputs_per_batch(cfg, names, autocast=None) -> dict:
    """Each named module's output over the dataset from a plain forward per batch."""
    model = build_model(parse(cfg).model, cfg.seed).eval()
    batches = [b.inputs for b in build_batches(parse(cfg).data, parse(cfg).model, cfg.seed)]
    return cloned_outputs(model, names, batches, autocast)


def test_bf16_autocast_stores_what_an_autocast_forward_gives(tmp_path):
    lenet = ["model=lenet", "dataset.num_samples=5", "dataset.batch_size=2", "probes=all_convs"]
    _, f = run_probe(tmp_path, *lenet, "precision=bf16")
    names = sorted(f["layers"])
    assert names == ["conv1", "conv2"]
    ref = outputs_per_batch(make_cfg(*lenet), names, torch.bfloat16)
    for name in names:
        stored = f[f"layers/{name}/output"][:]
        assert stored.dtype == np.float32  # the probe's storage dtype
        np.testing.assert_allclose(stored, ref[name], rtol=1e-6, atol=1e-6)
        as_bf16 = torch.from_numpy(stored).to(torch.bfloat16).float().numpy()
        np.testing.assert_array_equal(stored, as_bf16)  # bf16 values, widened
    fp32 = outputs_per_batch(make_cfg(*lenet), ["conv1"])["conv1"]
    assert np.abs(f["layers/conv1/output"][:] - fp32).max() > 1e-4  # autocast did act


def test_unknown_precision_is_refused_as_the_config_composes(tmp_path):
    with pytest.raises(ConfigCompositionException, match=r"precision=fp8"):
        run_probe(tmp_path, *TINY, "precision=fp8")


@pytest.mark.cuda
def test_cuda_run_equals_the_cpu_run(tmp_path, monkeypatch):
    """With TF32 off (torch runs convolutions in TF32 on Ampere and later by default, about 1e-3
    off float32: docs/scaling.md), the GPU's captures equal the CPU's to float32 rounding."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    _, gpu = run_probe(tmp_path / "gpu", *TINY, *LAYERS, "device=cuda")
    _, cpu = run_probe(tmp_path / "cpu", *TINY, *LAYERS, "device=cpu")
    assert sorted(gpu["layers"]) == sorted(cpu["layers"])
    for name in cpu["layers"]:
        np.testing.assert_allclose(
            gpu[f"layers/{name}/output"][:], cpu[f"layers/{name}/output"][:], rtol=1e-4, atol=1e-5
        )


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["full", "stats"])
def test_statistics_reduced_on_the_gpu_equal_numpy_over_the_stored_values(tmp_path, caplog, mode):
    """stats.backend=auto on a GPU reduces there (the plan says what crosses to the host); its
    /stats equal numpy's over the values a full run stored from the same forward."""
    import probe

    caplog.set_level(logging.INFO, logger="probe")
    result, f = run_probe(tmp_path, *TINY, *LAYERS, "device=cuda", "store.compression=none")
    assert f.attrs["stats_backend"] == "torch"
    assert "statistics reduced on the GPU" in caplog.text
    with probe.open_run(tmp_path) as run:
        for layer, site in run.keys:
            a = f[f"layers/{layer}/{site}"][:].astype(np.float64)
            s = run.stats(layer, site)
            assert (s.n, s.min, s.max) == (a.size, a.min(), a.max())
            np.testing.assert_allclose(
                [s.mean, s.m2], [a.mean(), ((a - a.mean()) ** 2).sum()], 1e-9
            )
            top = (a.astype(np.float32).view(np.uint32) >> 16).ravel()
            np.testing.assert_array_equal(s.hist.counts, np.bincount(top, minlength=1 << 16))
    if mode == "stats":
        caplog.clear()
        run_probe(tmp_path / "stats", *TINY, *LAYERS, "device=cuda", "store=stats")
        assert "GPU -> host per batch: captures 0 B" in caplog.text


@pytest.mark.parametrize("mode", ["full", "stats"])
def test_plan_states_bytes_per_sample_and_the_file_size_before_the_run(tmp_path, caplog, mode):
    """The logged bytes per sample are the captured rows' bytes; the projection is within 5% of
    the real file (whole chunks included), and for a stats-only file (/model/output, each
    dataset's histogram and per-unit arrays, in two slots) an upper bound within 35%."""
    overrides = [
        *TINY,
        "dataset.num_samples=7",
        "probes=all_convs",
        "probes.convs.capture=[output,input]",
        f"store.mode={mode}",
    ]
    with caplog.at_level(logging.INFO, logger="probe"):
        result, f = run_probe(tmp_path, *overrides)
    messages = [r.getMessage() for r in caplog.records]
    plan_at = next(i for i, m in enumerate(messages) if "projected" in m)
    assert plan_at < next(i for i, m in enumerate(messages) if m.startswith("wrote"))
    projected = int(re.search(r"\((\d+) bytes\)", messages[plan_at]).group(1))
    row_bytes = sum(  # a stats-only file's /stats keep each dataset's shape and dtype
        np.dtype(str(g.attrs["dtype"])).itemsize * int(np.prod(g.attrs["shape"]))
        for layer in f["stats"].values()
        for g in layer.values()
    )
    assert f"{row_bytes / 1024:.1f} KiB per sample" in messages[plan_at]
    f.close()
    real = result.h5_path.stat().st_size
    if mode == "full":
        assert abs(projected - real) / real < 0.05, (projected, real)
        return
    # a stats-only file's histograms fill buckets as data comes (projected from the first
    # batch), in two slots once a second flush came: a short run's file has one, below the plan
    assert real <= projected < 1.35 * real, (projected, real)


def test_the_transfer_line_of_a_gpu_batch_counts_the_statistics_partials(caplog):
    """The plan's line of what a GPU batch moves to the host: the captures' copies, and the
    statistics part's packed partials, which the record carries in its folds."""
    packed = DeviceStats(torch.zeros(10, dtype=torch.float64), lambda a: None)
    record = Record(
        0, 2, 0, {("conv1", "output"): torch.zeros(2, 3)},
        outputs=Outputs(folds={StatsFold.name: {("conv1", "output"): packed}}),
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger="probe"):
        log_transfer(record)
    assert "captures 24 B, statistics 80 B (statistics reduced on the GPU)" in caplog.text
