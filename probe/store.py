"""The HDF5 writer: one background thread fed by a bounded queue, chunked resizable datasets.

The main thread hands over one record per batch; the queue bound caps memory at `queue_batches`
batches of captures, which the thread writes while the next forward pass runs. A record carries
its batch's statistics (taken in the hooks), folded in as the batch is written, so they never
count rows the file does not hold; a stats-only run on the CPU has nothing else to write and
folds them on the calling thread. The file is flushed after every batch (a stats-only file,
whose flush rewrites /stats, every STATS_FLUSH_SECONDS), its `num_samples` attribute says how many
rows are valid, and `complete=True` is the very last write of a clean run."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

from probe import backend, direct
from probe.diskspace import check_space
from probe.errors import WriteError
from probe.h5fresh import add_attrs, add_dataset
from probe.resume import describe, restore, tags
from probe.stats import RunningStats, bounds_for, stats_for

FORMAT_VERSION = 1
log = logging.getLogger("probe")
COMPRESSIONS = ("none", "lzf", "gzip")
# A stats-only run writes nothing between flushes (its per-sample extras wait for the flush), so
# a kill there leaves the file of the last flush; each flush rewrites /stats (about 1 ms per
# dataset), hence not after every batch.
STATS_FLUSH_SECONDS = 10.0
HELD_BYTES = 64 << 20  # ... or sooner when the extras it holds until then reach this size


@dataclass
class Record:
    """One batch: per-sample tensors (axis 0 = samples) and per-batch tensors (one row per batch)."""

    start: int
    size: int
    batch_index: int
    values: dict[tuple[str, str], torch.Tensor]
    per_batch: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)
    targets: torch.Tensor | None = None
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # per-sample, own path
    ready: Any = None  # a CUDA event to wait on before reading host copies of GPU tensors
    # statistics of this batch already taken (in the hooks, or by `put`), folded in once written
    counted: dict[tuple[str, str], Any] = field(default_factory=dict)  # RunningStats or packed
    # gives the values' buffers back for reuse once written; they may not be read after
    release: Callable[[], None] | None = None
    axes: dict[tuple[str, str], int] = field(default_factory=dict)  # unit axis by dataset
    # a token batch's /tokens/{sample,position,id} rows (the rows of `token_layers` datasets)
    tokens: dict[str, np.ndarray] | None = None

    @property
    def token_count(self) -> int:
        return 0 if self.tokens is None else len(self.tokens["tokens/sample"])


@dataclass
class DatasetInfo:
    layer: str
    site: str
    module_type: str
    shape: tuple[int, ...]
    dtype: str
    per_batch: bool
    stats: RunningStats = field(default_factory=RunningStats)
    rows: str = "samples"  # or "tokens": one row per non-padding token


class ProbeWriter:
    """Owns probe.h5 for one run. `put` a Record per batch, then `close(complete=...)`."""

    def __init__(
        self,
        path: Path,
        *,
        mode: str = "full",
        compression: str = "none",
        compression_level: int | None = None,
        chunk_bytes: int = 1 << 20,
        queue_batches: int = 2,
        module_types: dict[str, str] | None = None,
        attrs: dict | None = None,
        resume: bool = False,
        batch_rows: int = 1,
        flush_seconds: float | None = None,
        index_offset: int = 0,
        token_layers: frozenset[str] = frozenset(),
        stats_backend: str | None = None,
        direct_io: bool = True,
    ):
        if compression not in COMPRESSIONS:
            raise WriteError(
                f"store.compression={compression!r} is unknown; choose from {', '.join(COMPRESSIONS)}"
            )
        if mode not in ("full", "stats"):
            raise WriteError(f"store.mode={mode!r} is unknown; choose full or stats")
        if queue_batches < 1:
            raise WriteError(f"store.queue_batches={queue_batches} must be at least 1")
        self.path, self.mode = Path(path), mode
        if (
            compression == "gzip"
            and compression_level is not None
            and not 0 <= compression_level <= 9
        ):
            raise WriteError(
                f"store.compression_level={compression_level} is out of range for gzip; give 0-9 "
                "(1 is fastest, 9 smallest)"
            )
        self.compression = None if compression == "none" else compression
        self.compression_opts = compression_level if compression == "gzip" else None
        self.chunk_bytes = chunk_bytes
        if flush_seconds is None:
            flush_seconds = STATS_FLUSH_SECONDS if mode == "stats" else 0.0
        self.flush_seconds, self.last_flush = flush_seconds, time.monotonic()
        self.index_offset = index_offset  # a shard's first sample in the whole dataset
        self.module_types = module_types or {}
        self.token_layers = token_layers  # layers stored one row per token
        self.bounds: dict[tuple[str, str], tuple[float, float] | None] = {}  # by dataset
        # what reduces captures to statistics in the hooks (`probe.backend`)
        if stats_backend is None:
            stats_backend = backend.resolve(os.environ.get(backend.ENV, "auto"))
        self.hook_stats = backend.observer(stats_backend)
        self.datasets: dict[tuple[str, str], DatasetInfo] = {}
        self.targets: dict[str, ChunkedTarget] = {}  # by HDF5 path, as appended to
        self.file_chunking: dict[str, int | None] = {}  # rows per chunk in the file, by path
        # per-sample extras (the model's output) a stats-only run writes at its next flush
        self.held: list[tuple[str, np.ndarray, int, int]] = []
        self.held_bytes = 0
        self.unflushable = False
        self.num_samples = 0
        self.num_batches = 0
        self.num_tokens = 0  # rows of the token-row datasets
        self.error: BaseException | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.file = h5py.File(
                self.path,
                "r+" if resume else "w",
                alignment_threshold=direct.ALIGN,
                alignment_interval=direct.ALIGN,
            )
        except OSError as e:
            raise WriteError(
                f"cannot create {str(self.path)!r} ({e}); choose a writable run directory with "
                "hydra.run.dir=PATH"
            ) from None
        if resume:  # append mode: continue after the last flushed batch
            try:
                restore(self, batch_rows)
            except BaseException:
                self.file.close()
                raise
        else:
            self.file.attrs["format_version"] = FORMAT_VERSION
            self.file.attrs["complete"] = False
            self.file.attrs["num_samples"] = 0
            self.file.attrs["num_tokens"] = 0
            self.file.attrs["store_mode"] = mode
            for k, v in (attrs or {}).items():
                self.file.attrs[k] = v
            if mode == "full":
                self.file.create_group("layers")  # present even when nothing is selected
        self.file.flush()
        # written chunks bypass the page cache where they can (probe.direct)
        self.direct_fd = direct.open_direct(self.path) if mode == "full" and direct_io else None
        self.direct_writes: list | None = None  # a batch's whole chunks, written together
        self.queue: queue.Queue[Record | None] = queue.Queue(maxsize=queue_batches)
        self.thread = threading.Thread(target=self._loop, name="probe-writer", daemon=True)
        self.inline: bool | None = None  # decided by the first record (see put)

    # -- main thread -------------------------------------------------------------------------
    def put(self, record: Record) -> None:
        """Take the statistics of a CPU batch's captures the hooks did not `observe`, then queue it;
        blocks while the queue is full, raises promptly if the writer failed.

        Statistics run on this thread (mostly in the hooks, as each capture is taken), while the
        forward's cores are idle; on the writer thread they would compete with the next forward
        pass. The writer folds them in when it writes the batch."""
        counted = record.counted
        if record.ready is None:
            for key, t in [*record.values.items(), *record.per_batch.items()]:
                if key not in counted:
                    counted[key] = self.observe(key, t, record.axes.get(key, 1))
        if self.inline is None:
            # A stats-only batch of CPU tensors leaves nothing to write but its statistics:
            # folding them here costs less than handing them to a thread that would take the
            # GIL from the next forward pass. Records with GPU copies still go to the thread.
            self.inline = self.mode == "stats" and record.ready is None
            if not self.inline:
                self.thread.start()
        if self.inline:
            self._raise_if_failed()
            try:
                self._take(record)
            except Exception as e:  # noqa: BLE001 - reported as the writer thread's would be
                self.error = e
            except BaseException:  # a second Ctrl-C part-way through folding the batch in
                self.unflushable = True  # the statistics in memory no longer match a row count
                raise
            self._raise_if_failed()
            return
        while True:
            self._raise_if_failed()
            try:
                self.queue.put(record, timeout=0.2)
                return
            except queue.Full:
                continue

    def close(self, complete: bool) -> None:
        """Drain the queue, write statistics and attributes, mark completion last, close."""
        if self.thread.is_alive():
            while True:
                try:
                    self.queue.put(None, timeout=0.2)
                    break
                except queue.Full:
                    if not self.thread.is_alive():
                        break
            self.thread.join()
        io_failed = isinstance(self.error, OSError | RuntimeError) and not isinstance(
            self.error, WriteError
        )
        try:
            # after a failed write HDF5 cannot flush
            if self.file.id.valid and not io_failed and not self.unflushable:
                self._write_held()
                self._write_stats()
                self._write_counts()
                self.file.flush()
                if complete and self.error is None:
                    self.file.attrs["complete"] = True
                    self.file.flush()
        except (OSError, RuntimeError) as e:
            self.error = self.error or e
        finally:
            with contextlib.suppress(OSError, RuntimeError):
                if self.file.id.valid:
                    self.file.close()
            if self.direct_fd is not None:
                os.close(self.direct_fd)
                self.direct_fd = None
        if complete:
            self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if isinstance(self.error, WriteError):
            raise self.error
        if self.error is not None:
            e = self.error
            hint = (
                " (is the disk full?)"
                if "space" in str(e).lower() or isinstance(e, OSError)
                else ""
            )
            error = WriteError(
                f"writing {str(self.path)!r} failed{hint}: {e}; HDF5 stopped in the middle of a "
                "write, so the file may not open. Free space, then run again into a new hydra.run.dir"
            )
            error.hdf5_unclosed = self.file.id.valid  # HDF5 retries the flush at exit and crashes
            raise error from None
        if self.inline is False and not self.thread.is_alive() and self.queue.qsize():
            raise WriteError(f"the writer of {str(self.path)!r} stopped unexpectedly")

    # -- writer thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            record = self.queue.get()
            if record is None:
                return
            if self.error is not None:
                continue
            try:
                self._take(record)
            except BaseException as e:  # noqa: BLE001 - reported to the main thread by put/close
                self.error = e

    def _take(self, record: Record) -> None:
        """Write one record, then give its buffers back for the next batches."""
        check_space(self, record)
        self._write(record)
        if record.release is not None:
            record.release()

    def _write(self, r: Record) -> None:
        if r.ready is not None:
            r.ready.synchronize()
        end = r.start + r.size
        self.direct_writes = [] if self.direct_fd is not None else None
        try:
            self._append_batch(r, end)
            self._write_direct()
        finally:
            self.direct_writes = None
        self.num_samples, self.num_batches = end, r.batch_index + 1
        self.num_tokens += r.token_count
        if time.monotonic() - self.last_flush < self.flush_seconds and self.held_bytes < HELD_BYTES:
            return  # the row count on disk moves only with a flush, so it never overstates
        if self.mode == "stats":  # all a stats-only file holds, written only here
            self._write_held()
            self._write_stats()
        self._write_counts()
        self.file.flush()
        self.last_flush = time.monotonic()
        log.debug("flushed batch %d (%d samples)", r.batch_index, end)

    def _write_counts(self) -> None:
        """The rows valid so far: samples, batches (parameter gradients) and tokens."""
        attrs = self.file.attrs
        attrs["num_samples"] = self.num_samples
        attrs["num_batches"] = self.num_batches
        attrs["num_tokens"] = self.num_tokens

    def _append_batch(self, r: Record, end: int) -> None:
        tokens = (self.num_tokens, self.num_tokens + r.token_count)
        for key, t in r.values.items():
            lo, hi = tokens if key[0] in self.token_layers else (r.start, end)
            self._append(key, t, lo, hi, False, r.counted.get(key), r.axes.get(key, 1))
        for key, t in r.per_batch.items():
            self._append(key, t, r.batch_index, r.batch_index + 1, True, r.counted.get(key))
        if self.mode == "full" and self.token_layers and r.tokens is not None:
            for name, a in r.tokens.items():  # samples as in samples/index: dataset-wide
                offset = self.index_offset if name == "tokens/sample" else 0
                self._append_plain(name, a + offset if offset else a, *tokens)
        for name, t in r.extra.items():
            if self.mode == "stats":  # written with the statistics, at the flush
                self.held.append((name, t.numpy(), r.start, end))
                self.held_bytes += self.held[-1][1].nbytes
            else:
                self._append_plain(name, t.numpy(), r.start, end)
        if self.mode == "full":
            self._append_plain(
                "samples/index",
                np.arange(r.start, end, dtype=np.int64) + self.index_offset,
                r.start,
                end,
            )
            if r.targets is not None:
                self._append_plain("samples/target", r.targets.cpu().numpy(), r.start, end)

    def _write_direct(self) -> None:
        """The batch's whole chunks in as few O_DIRECT writes as their places in the file allow;
        those O_DIRECT cannot take go through HDF5."""
        pending = self.direct_writes
        if not pending:
            return
        done = direct.write_chunks(self.direct_fd, [(t.ds, a, lo, t.rows) for t, a, lo in pending])
        for (target, a, lo), written in zip(pending, done, strict=True):
            if not written:
                target.write_direct_chunks(a, lo)

    def _write_held(self) -> None:
        for name, a, lo, hi in self.held:
            self._append_plain(name, a, lo, hi)
        self.held.clear()
        self.held_bytes = 0

    def observe(self, key: tuple[str, str], t: torch.Tensor, unit_axis: int = 1):
        """Statistics of one capture of the current batch (main thread): a CPU one's now, a GPU
        one's queued on its device (torch backend). The writer folds them in when it writes the
        batch, so /stats never count rows the file does not hold."""
        bounds = self.bounds.get(key, False)
        if bounds is False:
            bounds = self.bounds[key] = bounds_for(self.module_types.get(key[0], ""), key[1])
        return self.hook_stats(t, bounds, unit_axis)

    @property
    def observes_device(self) -> bool:
        """Whether `observe` takes GPU captures where they are (else they reach it on the host)."""
        return getattr(self.hook_stats, "on_device", False)

    def begin_batch(self) -> None:
        """Before each forward, on its thread: what `observe` can look up once per batch."""
        self.hook_stats.begin()

    def _append(
        self,
        key: tuple[str, str],
        t: torch.Tensor,
        lo: int,
        hi: int,
        per_batch: bool,
        counted=None,
        unit_axis: int = 1,
    ) -> None:
        info = self.datasets.get(key)
        new = info is None
        if new:
            if lo != 0:
                raise WriteError(
                    f"layer {key[0]!r} produced {key[1]} first at row {lo}: its calls differ between "
                    "batches (data-dependent control flow), which a fixed file layout cannot hold"
                )
            info = DatasetInfo(
                key[0],
                key[1],
                self.module_types.get(key[0], ""),
                tuple(t.shape[1:]),
                str(t.dtype).removeprefix("torch."),
                per_batch,
                stats_for(self.module_types.get(key[0], ""), key[1], unit_axis),
                "tokens" if key[0] in self.token_layers and not per_batch else "samples",
            )
            self.datasets[key] = info
            if self.mode == "full":  # lets a file cut short say what each layer is, in order
                g = self.file.require_group(f"layers/{key[0]}")
                g.attrs["module_type"] = info.module_type
                g.attrs.setdefault("order", len(self.datasets) - 1)
        info.stats.merge(counted if counted is not None else self.observe(key, t, unit_axis))
        if self.mode == "full":
            self._append_plain(f"layers/{key[0]}/{key[1]}", t.numpy(), lo, hi)
            if new:
                describe(self.file[f"layers/{key[0]}/{key[1]}"], info, len(self.datasets) - 1)

    def _append_plain(self, name: str, a: np.ndarray, lo: int, hi: int) -> None:
        target = self.targets.get(name)
        if target is None:
            ds = self.file.get(name)
            if ds is None:
                if lo != 0:
                    raise WriteError(f"dataset {name!r} appeared first at row {lo}")
                ds = self._create(name, a)
            target = self.targets[name] = ChunkedTarget(ds)
        target.append(a, lo, hi, self.direct_writes)

    def _create(self, name: str, a: np.ndarray) -> h5py.Dataset:
        row_bytes = max(1, a[0].nbytes if len(a) else a.itemsize)
        rows = chunk_rows(len(a), row_bytes, self.chunk_bytes)
        chunk_bytes = rows * row_bytes
        plist = (
            direct.creation_plist(chunk_bytes) if self.direct_fd and not self.compression else None
        )
        return self.file.create_dataset(
            name,
            dcpl=plist,
            shape=(0, *a.shape[1:]),
            maxshape=(None, *a.shape[1:]),
            dtype=a.dtype,
            chunks=(rows, *a.shape[1:]),
            compression=self.compression,
            compression_opts=self.compression_opts,
            rdcc_nbytes=max(2 * chunk_bytes, 1 << 20),
            rdcc_w0=1.0,
        )

    def _write_stats(self) -> None:
        write_stats(self.file, self.datasets.values())


class ChunkedTarget:
    """One dataset being appended to, with what its writes depend on read once: asking HDF5 for
    a dataset's properties holds the GIL, which the forward pass is waiting for."""

    def __init__(self, ds: h5py.Dataset):
        plist = ds.id.get_create_plist()
        self.ds, self.dtype, self.row_shape = ds, ds.dtype, ds.shape[1:]
        self.rows = ds.chunks[0] if ds.chunks else 0
        # whole batches of rows can be whole chunks, written straight from the array's memory
        self.by_chunk = (
            bool(self.rows) and not plist.get_nfilters() and ds.chunks[1:] == ds.shape[1:]
        )
        self.allocated_early = plist.get_alloc_time() == h5py.h5d.ALLOC_TIME_EARLY

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

    def write_direct_chunks(self, a: np.ndarray, lo: int) -> None:
        ds, rows = self.ds, self.rows
        origin = (0,) * (a.ndim - 1)
        for r in range(0, len(a), rows):  # skips HDF5's chunk cache and its copy
            ds.id.write_direct_chunk((lo + r, *origin), a[r : r + rows])


def chunk_rows(batch: int, row_bytes: int, chunk_bytes: int) -> int:
    """Rows per chunk, aligned to the batch so that a batch's write fills whole chunks: the
    largest divisor of the batch that fits in `chunk_bytes` (at least one row); when a whole batch
    fits, the batch, or several batches when one is under a quarter of `chunk_bytes`. A chunk of
    several batches is written again at every flush until full (and through HDF5's chunk cache,
    not straight from the capture), which costs little only while batches are small."""
    batch = max(1, batch)
    if batch * row_bytes <= chunk_bytes:
        batches = chunk_bytes // (batch * row_bytes)
        return batch * (batches if batches >= 4 else 1)
    fits = max(1, chunk_bytes // row_bytes)
    return max(d for d in range(1, min(batch, fits) + 1) if batch % d == 0)


def write_stats(file: h5py.File, datasets) -> None:
    """`/stats/<layer>/<site>`: each DatasetInfo's statistics (scalar attributes, histogram and
    per-unit arrays) and layout, tagged with its `order` of first appearance so a table read back
    from the file (or a resumed run) keeps the run's row order."""
    group = file.require_group("stats")
    for order, info in enumerate(datasets):
        path = f"{info.layer}/{info.site}"
        attrs = {
            **tags(info, order),
            **info.stats.state(),
            "shape": list(info.shape),
            "dtype": info.dtype,
        }
        if path not in group:  # (the first flush): nothing to replace
            g = group.create_group(path)
            add_attrs(g, attrs)
            for name, a in info.stats.arrays().items():
                add_dataset(g, name, a)
            continue
        g = group[path]
        for k, v in attrs.items():
            g.attrs[k] = v
        for name, a in info.stats.arrays().items():
            if name in g:
                del g[name]
            g.create_dataset(name, data=a)
