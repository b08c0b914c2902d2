"""A dataset's rows read in place: views of the file's own pages (mmap) instead of copies.

A read through h5py copies every byte out of the page cache before the statistics read it again; an
unfiltered dataset whose chunks hold whole rows lies in the file as plain arrays, so the summarizer
maps it and reduces the pages directly (one pass instead of two). Any other dataset gives None and
is read through h5py. A file truncated while mapped ends the process with SIGBUS: hence opt-in.
"""

from __future__ import annotations

import mmap
import os
import weakref
from collections.abc import Iterator

import h5py
import numpy as np


def mapped_slabs(ds: h5py.Dataset, rows: int, slab_bytes: int) -> Iterator[np.ndarray] | None:
    """Rows [0, rows) of ds as arrays over the file's pages, in slabs of chunks that follow one
    another in the file (up to slab_bytes, at least one row); None when ds cannot be mapped.
    The pages are mapped copy-on-write: writing to a slab never reaches the file. A slab holds
    its mapping (and a descriptor) until the last view of it is gone."""
    rows = min(rows, ds.shape[0]) if ds.ndim else 0
    spans = _row_spans(ds, rows)
    if spans is None:
        return None
    row_bytes = _row_bytes(ds)
    per_slab = max(1, slab_bytes // row_bytes)
    pieces = [  # a contiguous dataset or a chunk bigger than a slab, cut into slabs of rows
        (offset + i * row_bytes, min(per_slab, n - i))
        for offset, n in spans
        for i in range(0, n, per_slab)
    ]
    groups = _grouped(pieces, row_bytes, slab_bytes)
    fd = os.dup(ds.file.id.get_vfd_handle())  # this file, even if its name now names another
    slabs = _slabs(fd, groups, ds.dtype, ds.shape[1:])
    weakref.finalize(slabs, os.close, fd)
    return slabs


def _row_bytes(ds: h5py.Dataset) -> int:
    return int(np.prod(ds.shape[1:], dtype=np.int64)) * ds.dtype.itemsize


def _row_spans(ds: h5py.Dataset, rows: int) -> list[tuple[int, int]] | None:
    """(file offset, rows) of the stored pieces holding rows [0, rows), in row order."""
    if rows <= 0 or not hasattr(ds.id, "chunk_iter") or not _plain(ds):
        return None
    row_bytes = _row_bytes(ds)
    layout = ds.id.get_create_plist().get_layout()
    if layout == h5py.h5d.CONTIGUOUS:
        offset = ds.id.get_offset()
        if offset is None or ds.id.get_storage_size() < rows * row_bytes:
            return None
        spans = [(offset, rows)]
    elif layout == h5py.h5d.CHUNKED and tuple(ds.chunks[1:]) == tuple(ds.shape[1:]):
        step = ds.chunks[0]
        found: dict[int, int] = {}

        def keep(info) -> None:
            whole_rows = not any(info.chunk_offset[1:])
            if whole_rows and info.filter_mask == 0 and info.size == step * row_bytes:
                found[info.chunk_offset[0]] = info.byte_offset

        ds.id.chunk_iter(keep)
        starts = range(0, rows, step)
        if any(lo not in found for lo in starts):
            return None
        spans = [(found[lo], min(step, rows - lo)) for lo in starts]
    else:
        return None
    size = os.fstat(ds.file.id.get_vfd_handle()).st_size
    if any(offset % ds.dtype.itemsize for offset, _ in spans):
        return None  # a view of misaligned numbers
    if any(offset + n * row_bytes > size for offset, n in spans):
        return None  # a mapped page past the end would end the process (SIGBUS)
    return spans


def _plain(ds: h5py.Dataset) -> bool:
    """Whether ds's bytes lie in its file as a C array of numpy's own numbers (h5py may present a
    stored type as a numpy one it is not, e.g. a 16-bit precision int32, and convert on read)."""
    f = ds.file
    dcpl = ds.id.get_create_plist()
    return (
        f.driver == "sec2"
        and f.id.get_create_plist().get_userblock() == 0  # offsets below are from the file's start
        and ds.dtype.kind in "fiu"
        and ds.dtype.isnative
        and ds.id.get_type().equal(h5py.h5t.py_create(ds.dtype))
        and dcpl.get_nfilters() == 0
        and dcpl.get_external_count() == 0
        and ds.ndim >= 1
        and ds.size > 0
    )


def _grouped(pieces, row_bytes: int, slab_bytes: int) -> list[tuple[int, int]]:
    """Pieces (file offset, rows) joined into runs that lie back to back in the file (pieces
    come in row order, so a run's rows follow one another too), each run within slab_bytes."""
    groups: list[list[int]] = []
    for offset, n in pieces:
        if groups:
            start, count = groups[-1]
            if offset == start + count * row_bytes and (count + n) * row_bytes <= slab_bytes:
                groups[-1][1] += n
                continue
        groups.append([offset, n])
    return [(offset, n) for offset, n in groups]


def _slabs(fd: int, groups, dtype: np.dtype, row_shape) -> Iterator[np.ndarray]:
    """One mapping per slab, unmapped once the last view of it is gone; the next slab's pages
    are asked of the disk (MADV_WILLNEED) while the current one is reduced."""
    values = int(np.prod(row_shape, dtype=np.int64))
    following = _map(fd, groups[0][0], groups[0][1] * values * dtype.itemsize)
    for i, (_, n) in enumerate(groups):
        mm, start = following
        if i + 1 < len(groups):
            offset, rows = groups[i + 1]
            following = _map(fd, offset, rows * values * dtype.itemsize)
            if hasattr(mmap, "MADV_WILLNEED"):
                following[0].madvise(mmap.MADV_WILLNEED)
        yield np.frombuffer(mm, dtype, n * values, start).reshape(n, *row_shape)
        del mm


def _map(fd: int, offset: int, length: int) -> tuple[mmap.mmap, int]:
    """A private mapping of [offset, offset + length) and where that offset lies in it."""
    start = offset % mmap.ALLOCATIONGRANULARITY
    return mmap.mmap(fd, start + length, access=mmap.ACCESS_COPY, offset=offset - start), start
