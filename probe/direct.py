"""Chunk writes that bypass the page cache (O_DIRECT), into space HDF5 allocated for them.

A buffered write copies every byte into the page cache, and on a virtual machine fresh page-cache
pages are costly to obtain: measured here, 10-100 ms of CPU per 40 MB, taken from the forward pass
the writer runs beside. With O_DIRECT the disk reads the capture's own memory and the writer thread
needs about 1.5 ms of CPU per 40 MB, so writing truly overlaps the forward.

HDF5 stays in charge of the layout: a dataset eligible for this path is created with its chunks
allocated as it grows (`ALLOC_TIME_EARLY`, never filled), the file aligns large allocations to
ALIGN, and each whole chunk is written at the file offset HDF5 reports for it. O_DIRECT needs the
memory, the offset and the length aligned: captures are copied into ALIGN-aligned tensors
(`aligned_empty`), and a chunk qualifies when its byte size is a multiple of ALIGN. Anything else,
or a file system without O_DIRECT, takes HDF5's own write path.
"""

from __future__ import annotations

import errno
import logging
import os

import h5py
import numpy as np
import torch

ALIGN = 4096  # the block size O_DIRECT requires on common file systems (512 would do on some)
log = logging.getLogger("probe")


def aligned_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor whose memory starts on an ALIGN boundary."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    start = -raw.data_ptr() % ALIGN
    return raw[start : start + nbytes].view(dtype).view(shape)


class AlignedPool:
    """Aligned buffers for captures, reused once their batch is written: fresh memory for every
    batch costs page faults (on a virtual machine, pages obtained from the host) in the forward's
    thread. It holds at most the buffers of the batches in flight, as allocating them would."""

    def __init__(self):
        self.free: dict[tuple, list[torch.Tensor]] = {}

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        stack = self.free.get((tuple(shape), dtype))
        return stack.pop() if stack else aligned_empty(shape, dtype)

    def give(self, buffers: list[torch.Tensor]) -> None:
        """Called by the writer thread once it wrote them (list operations are atomic)."""
        for t in buffers:
            self.free.setdefault((tuple(t.shape), t.dtype), []).append(t)


def open_direct(path) -> int | None:
    """A write-only O_DIRECT descriptor of `path`, or None where the OS or file system has none."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_WRONLY | flag)
    except OSError as e:
        log.debug("no O_DIRECT for %s (%s); writing through HDF5", path, e)
        return None


def creation_plist(chunk_bytes: int) -> h5py.h5p.PropDCID | None:
    """Dataset creation properties that let `write_chunks` fill the chunks: space allocated as the
    dataset grows and never pre-filled. None when chunks of `chunk_bytes` cannot go direct."""
    if chunk_bytes % ALIGN:
        return None
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    return dcpl


def write_chunks(fd: int, ds: h5py.Dataset, a: np.ndarray, lo: int, rows: int) -> bool:
    """Write `a` (whole chunks of `rows` rows starting at row `lo` of `ds`, which was created
    with `creation_plist` and resized over them) with one O_DIRECT pwrite per chunk; False, with
    nothing written, when the memory or the chunks do not meet O_DIRECT's alignment."""
    chunk_bytes = a[:rows].nbytes
    if chunk_bytes % ALIGN or a.ctypes.data % ALIGN:
        return False
    origin = (0,) * (a.ndim - 1)
    chunks = [ds.id.get_chunk_info_by_coord((lo + r, *origin)) for r in range(0, len(a), rows)]
    if any(c.byte_offset is None or c.byte_offset % ALIGN or c.size != chunk_bytes for c in chunks):
        return False  # unallocated, unaligned, or not the size of these rows
    view = memoryview(a.reshape(-1).view(np.uint8))
    for i, (first, end) in enumerate(_runs([c.byte_offset for c in chunks], chunk_bytes)):
        part = view[first * chunk_bytes : end * chunk_bytes]
        offset = chunks[first].byte_offset
        try:
            written = os.pwrite(fd, part, offset)
        except OSError as e:
            if e.errno == errno.EINVAL and i == 0:  # this file system refuses O_DIRECT here
                return False
            raise
        if written != len(part):
            raise OSError(errno.EIO, f"short write: {written} of {len(part)} bytes at {offset}")
    return True


def _runs(offsets: list[int], size: int) -> list[tuple[int, int]]:
    """[first, end) of each run of chunks of `size` bytes that lie back to back in the file:
    HDF5 allocates a batch's chunks together, so a batch is usually one write, not one per
    chunk."""
    runs = []
    first = 0
    for i in range(1, len(offsets) + 1):
        if i == len(offsets) or offsets[i] != offsets[i - 1] + size:
            runs.append((first, i))
            first = i
    return runs
