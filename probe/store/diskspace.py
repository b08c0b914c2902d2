"""Refuse a batch the disk cannot hold before HDF5 starts writing it.

A write that fails half-way leaves HDF5 holding half a batch it must never flush (probe.store.livefile
then closes the file without writing: it keeps its last flush, and the run's statistics are
recomputed on resume). So the sink checks, before each batch, that the free space (and the
process's file size limit, RLIMIT_FSIZE) covers every chunk the batch can allocate, a margin for
metadata and what closing the file writes, and stops cleanly otherwise; at the end it checks that
closing fits again (another process may have taken the space since).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from types import ModuleType

import numpy as np

from probe.errors import WriteError
from probe.store.chunks import allocated_bytes
from probe.store.fileformat import layer_path

resource: ModuleType | None
try:
    import resource
except ImportError:  # not on Windows
    resource = None

METADATA_MARGIN = 1 << 20
CLOSING_MARGIN = 64 << 10  # metadata closing rewrites: histogram chunk indexes, /progress


def free_bytes(path: Path) -> int:
    """Bytes the file at `path` can still grow by: free disk space, capped by RLIMIT_FSIZE."""
    st = os.statvfs(path.parent)
    free = st.f_bavail * st.f_frsize
    if resource is not None:
        soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
        if soft != resource.RLIM_INFINITY:
            free = min(free, soft - path.stat().st_size)
    return free


def bytes_needed(sink, record) -> int:
    """What writing `record` can add to the file: the chunks it allocates plus a metadata margin."""
    need, rows = METADATA_MARGIN, sink.rows
    arrays = [(name, t, record.start, "sample") for name, t in record.outputs.samples.items()]
    if rows.mode == "full":
        for key, t in record.values.items():
            if key in record.unstored:
                continue
            by_token = key in record.token_keys
            at, kind = (rows.num_tokens, "token") if by_token else (record.start, "sample")
            arrays.append((layer_path(*key), t, at, kind))
        for k, t in record.per_batch.items():
            arrays.append((layer_path(*k), t, record.batch_index, "batch"))
        arrays.append(("samples/index", np.zeros(record.size, np.int64), record.start, "sample"))
        if record.targets is not None:
            arrays.append(("samples/target", record.targets, record.start, "sample"))
        if record.tokens is not None:  # their rows are tokens, after the rows' num_tokens
            arrays += [(name, a, rows.num_tokens, "token") for name, a in record.tokens.items()]
    return need + sum(_allocates(rows, *entry) for entry in arrays)


def _allocates(rows, name: str, a, lo: int, kind: str) -> int:
    """Bytes appending `a` at row `lo` of dataset `name` allocates, chunked as the rows make
    (or made) it."""
    row_bytes = int(a[0].nbytes) if len(a) else 1
    per_chunk = chunking(rows, name) or rows.chunking.rows(kind, len(a), row_bytes)
    return allocated_bytes(lo, len(a), row_bytes, per_chunk)


def chunking(rows, name: str) -> int | None:
    """Rows per chunk of an existing dataset, which keeps the chunking it was created with; read
    from the open datasets (asking HDF5 for each dataset every batch held the GIL for
    milliseconds), else from the file once per name (a resumed run's datasets; a stats-only run
    appends its model outputs only at a flush, until which they are in neither)."""
    target = rows.chunked.get(name)
    if target is not None and target.rows:
        return target.rows
    if name not in rows.file_chunking:
        ds = rows.file.get(name)
        rows.file_chunking[name] = ds.chunks[0] if ds is not None and ds.chunks else None
    return rows.file_chunking[name]


def check_space(sink, record) -> None:
    """WriteError naming the numbers when the next batch would not fit, with what closing the
    file then needs (its folds, the summary tables)."""
    need = bytes_needed(sink, record) + closing_need(sink)
    need += sum(fold.batch_bytes(record) for fold in sink.folds)  # what this batch may add
    free = free_bytes(sink.path)
    if free < need:
        # closing publishes the batches taken since the last flush when it fits, else not
        kept = sink.num_samples if free >= closing_need(sink) else sink.progress.samples
        raise WriteError(
            f"the disk holding {str(sink.path)!r} is full: {free / 2**20:.1f} MiB can still be "
            f"written but the next batch needs about {need / 2**20:.1f} MiB. The file holds the "
            f"{kept} samples before it; {RESUME}"
        )


RESUME = (
    "free some space and continue with resume=true and the same hydra.run.dir (or start again "
    "elsewhere with hydra.run.dir=PATH)"
)


def closing_need(sink) -> int:
    """Bytes closing the file can add: the folds' (statistics), the outputs a stats-only run
    holds until its flush, metadata."""
    rows = sink.rows
    held = sum(_allocates(rows, name, a, lo, "sample") for name, a, lo, _ in rows.held)
    folds = sum(fold.closing_bytes(sink) for fold in sink.folds)
    return folds + CLOSING_MARGIN + held


def check_closing(sink) -> WriteError | None:
    """A WriteError when closing would not fit (the space the guard kept was taken meanwhile):
    the file is then closed as its last flush left it, statistics of a full run recomputed by
    resume=true."""
    need, free = closing_need(sink), free_bytes(sink.path)
    if free >= need:
        return None
    return WriteError(
        f"the disk holding {str(sink.path)!r} is full: {free / 2**20:.2f} MiB can still be "
        f"written but closing the file needs about {need / 2**20:.2f} MiB. The file holds the "
        f"{sink.progress.samples} samples flushed before; {RESUME}"
    )


def failure(e: BaseException) -> str:
    """A failed write's cause in one line: the OS error HDF5 names inside its long message."""
    text = str(e)
    found = re.search(r"errno = (\d+), error message = '([^']*)'", text)
    if found:
        return f"{found.group(2)} (errno {found.group(1)})"
    return text.splitlines()[0] if text else type(e).__name__
