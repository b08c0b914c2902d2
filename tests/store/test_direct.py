"""Chunks written with O_DIRECT into space HDF5 allocated: the file holds the plain hooks' values,
and memory or chunks O_DIRECT cannot take go through HDF5 instead."""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest
import torch
from torchvision.models.feature_extraction import create_feature_extractor

from probe.hooks import buffers as host_buffers
from probe.hooks.capture import keep
from probe.hooks.module_select import Selection
from probe.hooks.record import Record
from probe.plan import StoreSpec
from probe.store import direct
from probe.store.chunks import chunk_rows
from probe.testing.compose import make_cfg
from tests.helpers import assert_same_arrays, run_probe, sink_of
from tests.hooks.test_forward_values import _model_and_inputs

RESNET = [
    "model=resnet18",
    "dataset.image_size=64",
    "dataset.num_samples=12",
    "dataset.batch_size=4",
    "probes=all_convs",
    "store.queue_batches=1",  # capture buffers go back to the pool, and are reused, quickly
]


def test_whole_chunks_go_to_disk_directly_with_the_values_of_plain_hooks(tmp_path, monkeypatch):
    if direct.open_direct(__file__) is None:
        pytest.skip("this file system has no O_DIRECT")
    calls = []

    def spy(fd, pieces):
        done = real(fd, pieces)
        calls.extend((ds.name, written) for (ds, *_), written in zip(pieces, done, strict=True))
        return done

    real = direct.write_chunks
    monkeypatch.setattr(direct, "write_chunks", spy)
    _, f = run_probe(tmp_path, *RESNET)
    model, inputs, _ = _model_and_inputs(make_cfg(*RESNET))
    convs = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Conv2d)]
    with torch.no_grad():
        ref = create_feature_extractor(model, {n: n for n in convs})(inputs)
    direct_names = {name for name, done in calls if done}
    for name in convs:
        ds = f[f"layers/{name}/output"]
        np.testing.assert_allclose(ds[:], ref[name].numpy(), rtol=1e-5, atol=1e-5)
        assert ds.id.get_create_plist().get_alloc_time() == h5py.h5d.ALLOC_TIME_EARLY
        one_batch_per_chunk = ds.chunks[0] == 4
        assert (ds.name in direct_names) == one_batch_per_chunk, ds.name
    assert "/layers/conv1/output" in direct_names  # 4 rows of 256 KiB: one chunk per batch
    assert "/layers/layer4.1.conv2/output" not in direct_names  # 32 KiB batches share chunks
    assert all(done for _, done in calls)  # every whole chunk met O_DIRECT's alignment


def test_memory_o_direct_cannot_take_is_written_through_hdf5(tmp_path):
    rows = np.arange(2 * 1024 * 2, dtype=np.float32).reshape(2, 1024, 2)  # 8 KiB per row
    unaligned = np.empty(rows.nbytes + 4, np.uint8)[4:].view(np.float32).reshape(rows.shape)
    unaligned[...] = rows
    if unaligned.ctypes.data % direct.ALIGN == 0:  # pragma: no cover - numpy aligns to 16 bytes
        unaligned = np.empty(rows.nbytes + 8, np.uint8)[8:].view(np.float32).reshape(rows.shape)
        unaligned[...] = rows
    path = tmp_path / "probe.h5"
    writer = sink_of(path, StoreSpec(chunk_bytes=rows.nbytes), module_types={"lin": "Linear"})
    for start in (0, 2):
        writer.put(Record(start, 2, start // 2, {("lin", "output"): torch.from_numpy(unaligned)}))
    writer.close(complete=True)
    with h5py.File(path) as f:
        ds = f["layers/lin/output"]
        np.testing.assert_array_equal(ds[:], np.concatenate([rows, rows]))
        fd = direct.open_direct(path)
        if fd is not None:
            try:
                assert direct.write_chunks(fd, [(ds, unaligned, 0, ds.chunks[0])]) == [False]
            finally:
                os.close(fd)


def test_aligned_chunks_written_directly_read_back_through_hdf5(tmp_path):
    path = tmp_path / "d.h5"
    shape = (4, 16, 8, 8)  # 4 KiB per row
    batches = [np.random.default_rng(i).standard_normal(shape).astype(np.float32) for i in range(3)]
    with h5py.File(
        path, "w", alignment_threshold=direct.ALIGN, alignment_interval=direct.ALIGN
    ) as f:
        ds = _two_row_chunks(f, "x", shape)
        fd = direct.open_direct(path)
        if fd is None:
            pytest.skip("this file system has no O_DIRECT")
        buffer = host_buffers.aligned_empty(shape, torch.float32).numpy()
        try:
            for i, b in enumerate(batches):
                ds.resize((i + 1) * 4, axis=0)
                buffer[...] = b
                assert direct.write_chunks(fd, [(ds, buffer, i * 4, 2)]) == [True]  # two chunks
        finally:
            os.close(fd)
    with h5py.File(path) as f:
        np.testing.assert_array_equal(f["x"][:], np.concatenate(batches))


@pytest.mark.parametrize(
    ("batch", "row_bytes", "rows"),
    [
        (16, 800 << 10, 1),  # a row near the chunk size: one row per chunk
        (16, 50 << 10, 16),  # 800 KiB batches: one batch per chunk
        (16, 32 << 10, 16),  # 512 KiB batches: still one (two would be written twice each)
        (16, 1 << 10, 16 * 64),  # 16 KiB batches: 64 to a chunk
        (6, 300 << 10, 3),  # the largest divisor of the batch that fits
    ],
)
def test_chunks_hold_whole_batches(batch, row_bytes, rows):
    assert chunk_rows(batch, row_bytes, 1 << 20) == rows


def test_only_page_aligned_copies_are_lent_from_the_pool_and_reused():
    """Copies come from the pool, aligned, with the capture's values, and are reused once given
    back; reduced captures and uncopied views are never lent (the pool would keep them)."""
    conv = torch.nn.Conv2d(3, 4, 3)
    t = torch.randn(2, 4, 6, 6)
    pool, lent = host_buffers.AlignedPool(), []
    full = Selection("conv", conv, ("output",), "none", "float32", "p")
    mean = Selection("conv", conv, ("output",), "spatial_mean", "float32", "p")
    copy, _ = keep(t, full, 2, ("conv", "output"), True, pool, lent)
    assert lent == [copy] and copy.data_ptr() % direct.ALIGN == 0
    torch.testing.assert_close(copy, t, rtol=0, atol=0)
    keep(t, mean, 2, ("conv", "output"), True, pool, lent)
    keep(t, full, 2, ("conv", "output"), False, pool, lent)
    assert len(lent) == 1
    pool.give(lent)
    again, _ = keep(t * 2, full, 2, ("conv", "output"), True, pool, [])
    assert again.data_ptr() == copy.data_ptr()
    torch.testing.assert_close(again, t * 2, rtol=0, atol=0)


def test_chunks_back_to_back_across_datasets_go_in_one_write(tmp_path, monkeypatch):
    path = tmp_path / "d.h5"
    shape = (4, 16, 8, 8)  # 4 KiB per row, two chunks of 2 rows per batch
    rng = np.random.default_rng(3)
    with h5py.File(
        path, "w", alignment_threshold=direct.ALIGN, alignment_interval=direct.ALIGN
    ) as f:
        names = ["a", "b", "c"]
        for name in names:
            _two_row_chunks(f, name, shape)
        fd = direct.open_direct(path)
        if fd is None:
            pytest.skip("this file system has no O_DIRECT")
        writes = []
        real = os.pwritev
        monkeypatch.setattr(os, "pwritev", lambda *a: writes.append(a[2]) or real(*a))
        values = {n: rng.standard_normal(shape).astype(np.float32) for n in names}
        buffers = {}
        for name in names:
            f[name].resize(4, axis=0)
            buffers[name] = host_buffers.aligned_empty(shape, torch.float32).numpy()
            buffers[name][...] = values[name]
        unaligned = np.empty(shape[0] * 4096 + 4, np.uint8)[4:].view(np.float32).reshape(shape)
        unaligned[...] = values["b"]
        try:
            pieces = [(f["a"], buffers["a"], 0, 2), (f["b"], unaligned, 0, 2)]
            pieces.append((f["c"], buffers["c"], 0, 2))
            assert direct.write_chunks(fd, pieces) == [True, False, True]
        finally:
            os.close(fd)
        offsets = sorted(
            f[n].id.get_chunk_info_by_coord((r, 0, 0, 0)).byte_offset
            for n in ("a", "c")
            for r in (0, 2)
        )
        gaps = sum(b - a != 2 * 4096 for a, b in zip(offsets, offsets[1:], strict=False))
        assert len(writes) == 1 + gaps < len(offsets)  # one write per run of adjacent chunks
    with h5py.File(path) as f:
        np.testing.assert_array_equal(f["a"][:], values["a"])
        np.testing.assert_array_equal(f["c"][:], values["c"])


def _two_row_chunks(f: h5py.File, name: str, shape: tuple) -> h5py.Dataset:
    """An empty float32 dataset of chunks of 2 rows (of 4 KiB each) that O_DIRECT can fill."""
    return f.create_dataset(
        name,
        shape=(0, *shape[1:]),
        maxshape=(None, *shape[1:]),
        dtype="f4",
        chunks=(2, *shape[1:]),
        dcpl=direct.creation_plist(2 * 4096),
    )


def test_runs_of_adjacent_chunks_stay_under_the_write_size_limit(monkeypatch):
    monkeypatch.setattr(direct, "RUN_BYTES", 3 * 4096)
    page = memoryview(bytearray(4096))
    blocks = [(i * 4096, page) for i in (0, 1, 2, 3, 4, 6)]
    runs = direct._runs(blocks)
    assert [[offset for offset, _ in run] for run in runs] == [
        [0, 4096, 8192],
        [12288, 16384],
        [24576],
    ]


def test_store_direct_io_false_writes_the_same_file_through_hdf5_alone(tmp_path, monkeypatch):
    """The portable path, asked for: no O_DIRECT descriptor, every value as with it."""
    opened = []
    real = direct.open_direct
    monkeypatch.setattr(direct, "open_direct", lambda p: opened.append(p) or real(p))
    run_probe(tmp_path / "direct", *RESNET)
    run_probe(tmp_path / "hdf5", *RESNET, "store.direct_io=false")
    assert len(opened) == 1  # the default run's only
    assert assert_same_arrays(tmp_path / "direct" / "probe.h5", tmp_path / "hdf5" / "probe.h5") > 20
