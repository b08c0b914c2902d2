"""The oracles the benchmark checks with (probe/testing/oracles.py), the block-wise batch
statistics and the batch-aligned chunks.

Values only: nothing here is timed.
"""

from __future__ import annotations

import shutil

import h5py
import numpy as np
import pytest
import torch

from probe.stats.backend import batch_stats
from probe.testing import oracles

BLOCK = 1 << 14  # sizes around a block boundary of the float64 accumulation

TINY = [
    "model=resnet18",
    "probes=all_convs",
    "dataset.image_size=32",
    "dataset.num_samples=5",
    "dataset.batch_size=2",
]


@pytest.fixture(scope="module")
def setup():
    return oracles.make_setup(TINY)


def test_bench_check_accepts_pipeline_files_and_rejects_a_changed_value(setup, tmp_path):
    reference = oracles.reference_values(setup)
    assert len(reference) == 20 and all(len(v) == 5 for v in reference.values())
    h5 = oracles.probe_case(setup)(tmp_path / "full")
    assert oracles.stored_values_match(h5, reference) == (True, "equal")

    changed = tmp_path / "changed.h5"
    shutil.copy(h5, changed)
    with h5py.File(changed, "r+") as f:
        f["layers/layer2.0.conv1/output"][4, 0, 0, 0] += 1e-3
    ok, why = oracles.stored_values_match(changed, reference)
    assert not ok and "layer2.0.conv1" in why


def test_bench_check_float16_and_gradients_equal_plain_hooks(setup, tmp_path):
    reference = oracles.reference_values(setup)
    h5 = oracles.probe_case(setup, dtype="float16")(tmp_path / "f16")
    assert oracles.stored_values_match(h5, reference, dtype="float16") == (True, "equal")
    # float16 storage is not the float32 reference: the check must notice
    assert not oracles.stored_values_match(h5, reference)[0]

    grads = oracles.reference_values(setup, grads=True)
    assert sum(site == "grad_output" for _, site in grads) == 20
    h5 = oracles.probe_case(setup, "probes=grads_all_convs")(tmp_path / "grads")
    sites = ("output", "grad_output")
    assert oracles.stored_values_match(h5, grads, sites=sites) == (True, "equal")


def test_bench_baselines_store_the_reference_values(setup, tmp_path):
    reference = oracles.reference_values(setup)
    for build in (oracles.hooks_h5py_sync, oracles.fx_extractor_h5py):
        assert oracles.stored_values_match(build(setup)(tmp_path), reference) == (True, "equal")
    saved = torch.load(oracles.naive_clone_torch_save(setup)(tmp_path), weights_only=True)
    for (layer, _), want in reference.items():
        np.testing.assert_array_equal(saved[layer].numpy(), want)


@pytest.mark.parametrize(
    "make",
    [
        lambda g: torch.relu(torch.randn(3, 2 * BLOCK + 7, generator=g)),  # rows split in blocks
        lambda g: torch.randn(BLOCK // 5 + 3, 9, generator=g),  # many rows per block
        lambda g: torch.randn(4, 3000, generator=g) * 0.01 + 1000,  # |mean| >> std
        lambda g: (torch.randn(2, BLOCK + 1, generator=g) * 0.01 + 1000).double(),
        lambda g: torch.randn(5, 7, generator=g).half(),
        lambda g: torch.randint(-3, 3, (6, 11), generator=g),
        lambda g: torch.tensor([[1.5, float("nan")], [float("inf"), 0.0], [-0.0, -2.0]]),
    ],
)
def test_batch_stats_equal_numpy_float64(make):
    x = make(torch.Generator().manual_seed(0))
    got, want = batch_stats(x), oracles.numpy_stats(x.numpy())
    for key, value in want.items():
        assert getattr(got, key) == pytest.approx(value, rel=2e-7, abs=1e-9), (
            key
        )  # test_stats bound


def test_chunks_hold_whole_batches(tmp_path):
    from tests.helpers import run_probe

    _, f = run_probe(tmp_path, *TINY, "dataset.num_samples=6", "store.chunk_bytes=65536")
    with f:
        for name in f["layers"]:
            ds = f[f"layers/{name}/output"]
            rows, row_bytes = ds.chunks[0], ds.dtype.itemsize * int(np.prod(ds.shape[1:]))
            assert rows % 2 == 0 or 2 % rows == 0, (name, rows)
            assert rows == 1 or rows * row_bytes <= 65536, (name, rows)
