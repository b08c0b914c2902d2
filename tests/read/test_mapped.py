"""Rows read in place from the file's pages: the same values h5py reads, or None where the
stored bytes are not a plain array (the summarizer then reads through h5py)."""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest

from probe.read.mapped import mapped_slabs
from probe.read.slabs import slabs
from probe.read.summaries import summarize_file

A = np.random.default_rng(0).standard_normal((23, 3, 5)).astype(np.float32)
ROW = 3 * 5 * 4  # bytes of a row


def concat(found) -> np.ndarray:
    return np.concatenate([s.copy() for s in found])


def test_chunks_back_to_back_in_the_file_come_as_slabs_of_the_stored_values(tmp_path):
    with h5py.File(tmp_path / "m.h5", "w") as f:
        ds = f.create_dataset(
            "x", shape=(0, 3, 5), dtype="f4", chunks=(2, 3, 5), maxshape=(None, 3, 5)
        )
        ds.resize(23, axis=0)
        ds[:] = A  # one write: chunks allocated in row order, back to back
        found = [s.copy() for s in mapped_slabs(ds, 21, slab_bytes=4 * ROW)]
        assert [len(s) for s in found] == [4, 4, 4, 4, 4, 1]
        np.testing.assert_array_equal(np.concatenate(found), A[:21])
        # chunks written in turn with another dataset's are not back to back: one slab each
        for name in ("a", "b"):
            f.create_dataset(
                name, shape=(0, 3, 5), dtype="f4", chunks=(2, 3, 5), maxshape=(None, 3, 5)
            )
        for lo in range(0, 23, 2):
            for name in ("a", "b"):
                f[name].resize(min(23, lo + 2), axis=0)
                f[name][lo : lo + 2] = A[lo : lo + 2]
        found = list(mapped_slabs(f["a"], 23, slab_bytes=1 << 20))
        assert [len(s) for s in found] == [2] * 11 + [1]
        np.testing.assert_array_equal(concat(found), A)


def test_contiguous_data_maps_and_writes_to_a_slab_never_reach_the_file(tmp_path):
    path = tmp_path / "c.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=A)  # contiguous layout
    with h5py.File(path, "r") as f:
        found = list(mapped_slabs(f["x"], 23, slab_bytes=1 << 20))
        assert len(found) == 1
        np.testing.assert_array_equal(found[0], A)
        found[0][:] = 0  # copy-on-write pages
        del found
        np.testing.assert_array_equal(f["x"][:], A)
        # memory stays bounded: a dataset stored in one piece comes in slabs of rows
        found = [s.copy() for s in mapped_slabs(f["x"], 22, slab_bytes=5 * ROW)]
        assert [len(s) for s in found] == [5, 5, 5, 5, 2]
        np.testing.assert_array_equal(np.concatenate(found), A[:22])


def test_stored_bytes_that_are_not_a_plain_array_fall_back_to_h5py(tmp_path):
    path = tmp_path / "f.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("gzip", data=A, chunks=(2, 3, 5), compression="gzip")
        f.create_dataset("split_rows", data=A, chunks=(2, 3, 1))  # a chunk holds part of rows
        f.create_dataset("big_endian", data=A.astype(">f4"), chunks=(2, 3, 5))
        sparse = f.create_dataset("sparse", shape=(23, 3, 5), dtype="f4", chunks=(2, 3, 5))
        sparse[:4] = A[:4]  # rows 4 on were never written: no chunks there
        for name in ("gzip", "split_rows", "big_endian", "sparse"):
            assert mapped_slabs(f[name], 23, 1 << 20) is None, name
            np.testing.assert_array_equal(concat(slabs(f[name], 23)), f[name][:])
        assert mapped_slabs(sparse, 4, 1 << 20) is not None  # the rows that were written


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "read"])
@pytest.mark.parametrize("row", [(4, 6, 6), (50,)], ids=["by_segment", "by_column"])
def test_summary_of_mapped_slabs_equals_numpy_float64(tmp_path, row, mapped, monkeypatch):
    """The summary of a plain dataset, reduced in place (`--mapped`) or read, equals numpy's."""
    from probe.read import slabs as slab_reads

    monkeypatch.setattr(slab_reads, "MAPPED", mapped)
    run = tmp_path / "run"
    run.mkdir()
    data = np.maximum(np.random.default_rng(1).standard_normal((37, *row)), 0).astype("f4")
    with h5py.File(run / "probe.h5", "w") as f:
        f.attrs.update(num_samples=37, complete=True)
        g = f.create_group("layers/relu")
        g.attrs["module_type"] = "ReLU"
        ds = g.create_dataset("output", shape=(40, *row), dtype="f4", chunks=(8, *row))
        ds[:37] = data
        assert mapped_slabs(ds, 37, 1 << 20) is not None
    row = summarize_file(run / "probe.h5").table.iloc[0]
    x = data.astype(np.float64)
    np.testing.assert_allclose(
        [row["rows"], row["mean"], row["std"], row["min"], row["max"], row["frac_zero"]],
        [37, x.mean(), x.std(), x.min(), x.max(), (x == 0).mean()],
        rtol=1e-9,
    )
    dead = (data.max(axis=(0, *range(2, data.ndim))) <= 0).mean()
    assert row["dead_frac"] == dead


def test_stored_types_numpy_would_misread_and_user_blocks_fall_back(tmp_path):
    path = tmp_path / "t.h5"
    narrow = h5py.h5t.STD_I32LE.copy()
    narrow.set_precision(16)  # h5py presents it as int32 and converts on read
    with h5py.File(path, "w", userblock_size=512) as f:
        f.create_dataset("x", data=A, chunks=(2, 3, 5))  # offsets would count from the user block
    with h5py.File(path, "r") as f:
        assert mapped_slabs(f["x"], 23, 1 << 20) is None
        np.testing.assert_array_equal(concat(slabs(f["x"], 23)), A)
    with h5py.File(path, "w") as f:
        ds = f.create_dataset("n", shape=(6, 4), dtype=narrow, chunks=(2, 4))
        ds[:] = np.arange(-12, 12).reshape(6, 4)
        assert ds.dtype == np.int32 and mapped_slabs(ds, 6, 1 << 20) is None
        np.testing.assert_array_equal(concat(slabs(ds, 6)), np.arange(-12, 12).reshape(6, 4))


def test_slabs_read_the_open_file_stop_at_its_rows_and_let_go_of_it(tmp_path):
    path = tmp_path / "o.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=A)
    fds = len(os.listdir("/proc/self/fd"))
    with h5py.File(path, "r") as f:
        found = mapped_slabs(f["x"], 99, slab_bytes=10 * ROW)  # 99 rows asked, 23 there
        with h5py.File(tmp_path / "other.h5", "w") as g:
            g.create_dataset("x", data=A + 1)
        os.replace(tmp_path / "other.h5", path)  # the name now names another file
        np.testing.assert_array_equal(concat(found), A)
        del found
    assert len(os.listdir("/proc/self/fd")) == fds  # every mapping and descriptor let go
