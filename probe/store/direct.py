"""Chunk writes that bypass the page cache (O_DIRECT), into space HDF5 allocated for them.

On a virtual machine a buffered write's fresh page-cache pages cost far more CPU than O_DIRECT,
and that CPU is taken from the forward pass the writer runs beside; with O_DIRECT the disk reads
the capture's own memory. HDF5 stays in charge of the layout: each whole, aligned chunk is written
at the offset HDF5 reports for it; anything else takes HDF5's own writes, of the same values.
"""

from __future__ import annotations

import errno
import logging
import os

import h5py
import numpy as np

from probe.hooks.buffers import ALIGN

ALIGN_FROM = 64 << 10  # allocations this large are aligned; smaller ones (metadata) packed
log = logging.getLogger("probe")


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


def write_chunks(fd: int, pieces: list[tuple[h5py.Dataset, np.ndarray, int, int]]) -> list[bool]:
    """Write each piece (ds, a, lo, rows): `a` holds whole chunks of `rows` rows from row `lo` of
    `ds`, which was created with `creation_plist` and resized over them. Chunks that lie back to
    back in the file, within a piece and across pieces (HDF5 allocates a batch's chunks one
    after the other), go in one O_DIRECT pwritev: per write the kernel pins pages and builds
    requests for about 100 us of CPU, so a batch's 20 datasets cost one write, not 20. A piece
    is False, with nothing of it written, when its memory or chunks do not meet O_DIRECT's
    alignment; every piece is False when the file system refuses O_DIRECT."""
    done = [False] * len(pieces)
    blocks = []  # (file offset, memory) of each chunk
    for i, (ds, a, lo, rows) in enumerate(pieces):
        chunk_bytes = a[:rows].nbytes
        if chunk_bytes % ALIGN or a.ctypes.data % ALIGN:
            continue
        origin = (0,) * (a.ndim - 1)
        chunks = [ds.id.get_chunk_info_by_coord((lo + r, *origin)) for r in range(0, len(a), rows)]
        if any(
            c.byte_offset is None or c.byte_offset % ALIGN or c.size != chunk_bytes for c in chunks
        ):
            continue  # unallocated, unaligned, or not the size of these rows
        view = a.reshape(-1).view(np.uint8).data  # (a memoryview of its bytes)
        blocks += [
            (c.byte_offset, view[j * chunk_bytes : (j + 1) * chunk_bytes])
            for j, c in enumerate(chunks)
        ]
        done[i] = True
    for n, run in enumerate(_runs(sorted(blocks, key=lambda b: b[0]))):
        offset, size = run[0][0], sum(len(m) for _, m in run)
        try:
            written = os.pwritev(fd, [m for _, m in run], offset)
        except OSError as e:
            if e.errno == errno.EINVAL and n == 0:  # this file system refuses O_DIRECT here
                return [False] * len(pieces)
            raise
        if written != size:
            raise OSError(errno.EIO, f"short write: {written} of {size} bytes at {offset}")
    return done


RUN_BYTES = 1 << 30  # Linux writes at most 2 GiB - 4 KiB in one call


def _runs(blocks: list[tuple[int, memoryview]]) -> list[list[tuple[int, memoryview]]]:
    """Blocks sorted by offset, grouped into runs that lie back to back in the file (at most
    IOV_MAX blocks and RUN_BYTES bytes each, unless one block is bigger)."""
    limit = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
    runs: list[list[tuple[int, memoryview]]] = []
    size = 0
    for offset, memory in blocks:
        last = runs[-1][-1] if runs else None
        if (
            last is not None
            and last[0] + len(last[1]) == offset
            and len(runs[-1]) < limit
            and size + len(memory) <= RUN_BYTES
        ):
            runs[-1].append((offset, memory))
            size += len(memory)
        else:
            runs.append([(offset, memory)])
            size = len(memory)
    return runs
