"""Rows of one HDF5 chunk read straight from the file into the training buffer's scratch array.

An uncompressed, unfiltered chunk lies in the file as plain rows: one positioned OS read at its
byte offset fetches them, where h5py's `read_direct` spends about 0.17 ms a call building
selections (measured on 1 MB chunks in the page cache: 256 chunks read and scattered in 0.086 s
against 0.13 s). Anything else (compressed or filtered chunks, virtual datasets, a chunk not yet
allocated, a file that cannot be opened plainly) is read by h5py: the portable path, which tests
compare this one with (`PLAIN_READS = False`).
"""

from __future__ import annotations

import os

import h5py
import numpy as np

PLAIN_READS = True  # False: always read through h5py (the reference path)


def open_plain(path: str):
    """The file opened for positioned reads (unbuffered), or None where it cannot be."""
    try:
        return open(path, "rb", buffering=0)  # noqa: SIM115 (closed by the stream's pass)
    except OSError:
        return None


class ChunkReader:
    """Copies rows [lo, hi) of one chunk of `ds` into `dest[into]` (only `pick` among them),
    through `scratch`."""

    def __init__(self, ds: h5py.Dataset, plain_file):
        self.ds, self.file = ds, plain_file
        self.row_bytes = int(np.prod(ds.shape[1:], dtype=np.int64)) * ds.dtype.itemsize
        self.plain = PLAIN_READS and plain_file is not None and _plain(ds)

    def scatter(self, lo: int, hi: int, dest: np.ndarray, into, pick, scratch: np.ndarray) -> None:
        rows = scratch[: hi - lo]
        one_chunk = self.plain and lo // self.ds.chunks[0] == (hi - 1) // self.ds.chunks[0]
        offset = self._offset(lo) if one_chunk else None  # (labels may be chunked otherwise)
        if offset is None or not _read_at(self.file, offset, rows.data.cast("B")):
            self.ds.read_direct(rows, np.s_[lo:hi], np.s_[: hi - lo])
        dest[into] = rows if pick is None else rows[pick]

    def _offset(self, lo: int) -> int | None:
        """The file offset of row `lo`, where its chunk is allocated and unfiltered."""
        first = lo - lo % self.ds.chunks[0]
        info = self.ds.id.get_chunk_info_by_coord((first,) + (0,) * (self.ds.ndim - 1))
        if info.byte_offset is None or info.filter_mask:
            return None
        return info.byte_offset + (lo - first) * self.row_bytes


def _read_at(file, offset: int, view: memoryview) -> bool:
    """Fill `view` from `offset`; False where the file ends first."""
    while view.nbytes:
        if hasattr(os, "preadv"):
            got = os.preadv(file.fileno(), [view], offset)
        else:  # (no positioned reads here: seek, then read)
            file.seek(offset)
            got = file.readinto(view)
        if not got:
            return False
        view, offset = view[got:], offset + got
    return True


def _plain(ds: h5py.Dataset) -> bool:
    """Whether its chunks hold plain rows: chunked over whole rows, no filter, numbers in the
    machine's byte order."""
    return (
        ds.chunks is not None
        and tuple(ds.chunks[1:]) == tuple(ds.shape[1:])
        and not ds.is_virtual
        and ds.id.get_create_plist().get_nfilters() == 0
        and ds.dtype.kind in "biuf"
        and ds.dtype.isnative
    )
