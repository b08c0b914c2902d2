"""A dataset's rows in slabs of bounded size, for the summarizer: read through h5py into two
reused buffers while the caller reduces the previous slab, or (opt-in) mapped in place.

Opt-in (`--mapped`, PROBE_MAPPED_READS=1): reduce plain datasets in the file's own pages
(`probe.read.mapped`), faster, but a file truncated while it is mapped ends the process (SIGBUS); the
default reads check the file's size after each slab and raise a DataError instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import h5py
import numpy as np

from probe.errors import DataError
from probe.read.mapped import mapped_slabs

SLAB_BYTES = 16 << 20
MAPPED = os.environ.get("PROBE_MAPPED_READS") == "1"


def slabs(ds: h5py.Dataset, rows: int, slab_bytes: int = SLAB_BYTES) -> Iterator[np.ndarray]:
    """Rows [0, rows) in slabs of at most about slab_bytes: copies of whole chunks read through
    h5py, or with MAPPED views of the file's pages where the dataset is stored plain. A slab is
    valid until the next one is asked for."""
    mapped = mapped_slabs(ds, rows, slab_bytes) if MAPPED else None
    return mapped or read_slabs(ds, rows, slab_bytes)


def read_slabs(ds: h5py.Dataset, rows: int, slab_bytes: int = SLAB_BYTES) -> Iterator[np.ndarray]:
    """Rows [0, rows) in slabs of whole chunks; the next slab is read while the caller works,
    into the other of two buffers (fresh memory for every slab costs a page fault per 4 KiB).
    A slab is valid until the next one is asked for.

    The read runs in a helper thread: do not call this from inside a lazy h5py iteration
    (`group.items()`), which holds h5py's lock and would keep that thread waiting."""
    if rows <= 0:
        return
    chunk_rows = ds.chunks[0] if ds.chunks else 1
    row_bytes = max(1, int(np.prod(ds.shape[1:], dtype=np.int64)) * ds.dtype.itemsize)
    step = min(rows, max(1, slab_bytes // (row_bytes * chunk_rows)) * chunk_rows)
    buffers = [np.empty((step, *ds.shape[1:]), ds.dtype) for _ in range(2 if step < rows else 1)]

    size = file_size(ds)

    def read(lo: int, into: np.ndarray) -> np.ndarray:
        n = min(step, rows - lo)
        ds.read_direct(into, np.s_[lo : lo + n], np.s_[0:n])
        now = file_size(ds)  # HDF5 reads what lies past the end as zeros: check it did not shrink
        if now is not None and size is not None and now < size:
            raise DataError(
                f"{ds.file.filename!r} was cut from {size} to {now} bytes while it was read; "
                "summarize it again once whatever truncated it is done"
            )
        return into[:n]

    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(read, 0, buffers[0])
        for i, lo in enumerate(range(0, rows, step)):
            slab = pending.result()
            nxt = lo + step
            if nxt < rows:
                pending = pool.submit(read, nxt, buffers[(i + 1) % len(buffers)])
            yield slab


def file_size(ds: h5py.Dataset) -> int | None:
    """The size of the file ds is read from, through HDF5's own descriptor (None where the
    driver has none)."""
    try:
        return os.fstat(ds.file.id.get_vfd_handle()).st_size
    except (OSError, TypeError, ValueError, RuntimeError):
        return None
