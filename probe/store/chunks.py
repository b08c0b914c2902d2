"""Chunked, resizable datasets of probe.h5: their chunk layout, their dimension names, and the
appends the writer makes to them.

A chunk holds whole batches where it can, so a batch's write fills whole chunks; no chunk holds
more rows than the run will write (a tiny run's file stays near its data's size). A compressed
chunk is written once, whole, and never again: a kill while HDF5 rewrote one could leave it
undecodable, flushed rows included, so compressed chunks never span batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import h5py
import numpy as np

from probe.store import direct
from probe.store.fileformat import axis_names

PLAIN_SITES = ("output", "grad_output")  # their axes are the layer's; others' are prefixed


# Compressed chunks hold one batch (written once, whole); scripts/bench.py sets this to time the
# earlier layout, in which they spanned batches and were rewritten at each flush.
COMPRESSED_CHUNKS_SPAN = False


def chunk_rows(
    batch: int, row_bytes: int, chunk_bytes: int, total: int | None = None, spans: bool = True
) -> int:
    """Rows per chunk, aligned to the batch so that a batch's write fills whole chunks: the
    largest divisor of the batch that fits in `chunk_bytes` (at least one row); when a whole batch
    fits, the batch, or (with `spans`) several batches when one is under a quarter of
    `chunk_bytes`, but never more than `total`, the rows the run will write (rounded up to whole
    batches)."""
    batch = max(1, batch)
    if batch * row_bytes <= chunk_bytes:
        batches = chunk_bytes // (batch * row_bytes) if spans else 1
        batches = batches if batches >= 4 else 1
        if total is not None:
            batches = max(1, min(batches, -(-total // batch)))
        return batch * batches
    fits = max(1, chunk_bytes // row_bytes)
    return max(d for d in range(1, min(batch, fits) + 1) if batch % d == 0)


@dataclass(frozen=True)
class Chunking:
    """The chunk layout of one file's datasets, in one place: the writer creates datasets by it,
    the disk-space guard and the size plan count the bytes it allocates. A dataset's rows are
    samples, batches (parameter gradients, per-batch rows) or tokens (`rows: tokens` layers,
    /tokens/*), whose count is unknown until they come, so their chunks hold one batch's."""

    chunk_bytes: int
    compressed: bool = False
    samples: int | None = None  # rows of the file's per-sample datasets
    batch_size: int | None = None

    def rows(self, kind: str, per_write: int, row_bytes: int) -> int:
        """Rows per chunk of a dataset of `kind` written `per_write` rows at a time."""
        spans = not self.compressed or COMPRESSED_CHUNKS_SPAN
        total = None
        if kind == "sample":
            total = self.samples
        elif kind == "batch" and self.samples and self.batch_size:
            total = -(-self.samples // self.batch_size)
        elif kind == "token":
            spans = False
        return chunk_rows(per_write, row_bytes, self.chunk_bytes, total, spans)


def row_kind(per_batch: bool, rows: str = "samples") -> str:
    """What one row of a captured dataset is: a batch's, a token's or a sample's."""
    return "batch" if per_batch else "token" if rows == "tokens" else "sample"


def allocated_bytes(existing_rows: int, new_rows: int, row_bytes: int, rows_per_chunk: int) -> int:
    """Bytes of the chunks of `rows_per_chunk` rows that appending `new_rows` allocates (HDF5
    allocates a chunk whole)."""
    chunks = math.ceil((existing_rows + new_rows) / rows_per_chunk) - math.ceil(
        existing_rows / rows_per_chunk
    )
    return chunks * rows_per_chunk * row_bytes


def row_bytes(a: np.ndarray) -> int:
    """Bytes of one row of `a` (a string is counted as its reference)."""
    return max(1, int(np.prod(a.shape[1:], dtype=np.int64)) * a.itemsize)


def make_dataset(
    file: h5py.File,
    name: str,
    a: np.ndarray,
    rows: int,
    compression: str | None,
    compression_opts,
    plist=None,
) -> h5py.Dataset:
    """An empty, resizable dataset for rows like `a`'s, `rows` rows per chunk. Floating-point
    rows never written (a module that did not run for them) read as NaN, not as zeros."""
    chunk_bytes = rows * row_bytes(a)
    fill = np.nan if a.dtype.kind == "f" and plist is None else None
    return file.create_dataset(
        name,
        dcpl=plist,
        shape=(0, *a.shape[1:]),
        maxshape=(None, *a.shape[1:]),
        dtype=h5py.string_dtype() if a.dtype.kind in "OU" else a.dtype,
        chunks=(rows, *a.shape[1:]),
        compression=compression,
        compression_opts=compression_opts,
        fillvalue=fill,
        rdcc_nbytes=max(2 * chunk_bytes, 1 << 20),
        rdcc_w0=1.0,
    )


def row_scale(file: h5py.File, name: str, total: int | None = None) -> h5py.Dataset:
    """The root dimension `name` (sample, token or batch). `sample` is `/samples/index` itself
    (a second link to it): the dataset-wide index of each row is its coordinate."""
    ds = file.get(name)
    if ds is not None:
        return ds
    rows = max(1, min(1024, total or 1024))
    if name == "sample":
        ds = file.create_dataset(name, shape=(0,), maxshape=(None,), dtype="<i8", chunks=(rows,))
        file.require_group("samples")["index"] = ds
        ds.make_scale(name)
        return ds
    ds = file.create_dataset(name, shape=(0,), maxshape=(None,), dtype="<f4", chunks=(rows,))
    ds.make_scale(f"This is a netCDF dimension but not a netCDF variable.{0:10d}")
    return ds


def name_axes(
    file: h5py.File,
    ds: h5py.Dataset,
    unit_axis: int,
    rows: str,
    per_batch: bool,
    total: int | None = None,
) -> None:
    """Attach dimension scales to `ds` so that xarray (h5netcdf) sees named dimensions: the root
    row dimension, then one per further axis in the layer's group, named by what the axis is and
    prefixed with the site when another site of the layer has that name with another size."""
    site = ds.name.rsplit("/", 1)[-1]
    names = axis_names(ds.shape, unit_axis, rows, per_batch, site)
    ds.dims[0].attach_scale(row_scale(file, names[0], total))
    group = ds.parent
    prefix = "" if site in PLAIN_SITES else f"{site}_"
    for i, name in enumerate(names[1:], start=1):
        size = ds.shape[i]
        name = prefix + name
        scale = group.get(name)
        if scale is not None and scale.shape != (size,):
            name = f"{site}_{names[i]}"
            scale = group.get(name)
        if scale is None:
            scale = group.create_dataset(name, shape=(size,), dtype="<f4")
            scale.make_scale(f"This is a netCDF dimension but not a netCDF variable.{size:10d}")
        ds.dims[i].attach_scale(scale)
        ds.dims[i].label = name


class ChunkedDataset:
    """One dataset being appended to, with what its writes depend on read once: asking HDF5 for
    a dataset's properties holds the GIL, which the forward pass is waiting for."""

    def __init__(self, ds: h5py.Dataset):
        plist = ds.id.get_create_plist()
        self.ds, self.dtype, self.row_shape = ds, ds.dtype, ds.shape[1:]
        self.rows = ds.chunks[0] if ds.chunks else 0
        # whole batches of rows can be whole chunks, written straight from the array's memory
        self.by_chunk = (
            bool(self.rows)
            and not plist.get_nfilters()
            and ds.chunks[1:] == ds.shape[1:]
            and ds.dtype.kind != "O"  # variable-length strings: HDF5 writes their heap objects
        )
        self.allocated_early = plist.get_alloc_time() == h5py.h5d.ALLOC_TIME_EARLY

    @property
    def end(self) -> int:
        return self.ds.id.shape[0]

    def append(self, a: np.ndarray, lo: int, hi: int, direct_writes: list | None = None) -> None:
        """Rows [lo, hi): whole uncompressed chunks (the usual case: chunks hold whole batches)
        are added to `direct_writes` for O_DIRECT when it is given and they can go there, else
        written with HDF5's direct chunk writes; anything else goes through the chunk cache."""
        ds, rows = self.ds, self.rows
        ds.id.set_extent((hi, *self.row_shape))  # what ds.resize does, without its checks
        whole = (
            self.by_chunk
            and lo % rows == 0
            and (hi - lo) % rows == 0
            and a.dtype == self.dtype
            and a.shape[1:] == self.row_shape
            and a.flags.c_contiguous
        )
        if not whole:
            ds[lo:hi] = a
            return
        if direct_writes is not None and self.allocated_early:
            direct_writes.append((self, a, lo))
            return
        self.write_direct_chunks(a, lo)

    def fill(self, lo: int, hi: int) -> None:
        """Rows [lo, hi) that no capture reached: NaN for floating point, else the type's zero
        (the coverage datasets say which rows they are)."""
        self.ds.id.set_extent((hi, *self.row_shape))
        blank = np.full((hi - lo, *self.row_shape), np.nan if self.dtype.kind == "f" else 0)
        self.ds[lo:hi] = blank.astype(self.dtype)

    def write_direct_chunks(self, a: np.ndarray, lo: int) -> None:
        ds, rows = self.ds, self.rows
        origin = (0,) * (a.ndim - 1)
        for r in range(0, len(a), rows):  # skips HDF5's chunk cache and its copy
            ds.id.write_direct_chunk((lo + r, *origin), a[r : r + rows])


def direct_plist(chunk_bytes: int, compressed: bool, direct_fd, dtype: np.dtype):
    """The creation properties of O_DIRECT-written datasets, where they apply."""
    if not direct_fd or compressed or dtype.kind == "O":
        return None
    return direct.creation_plist(chunk_bytes)
