"""The HDF5 writer: one background thread fed by a bounded queue, chunked resizable datasets.

The main thread hands over one record per batch; the queue bound caps memory at `queue_batches`
batches of captures, which the thread writes while the next forward pass runs. A record carries
its batch's statistics (taken in the hooks), folded in as the batch is written, so they never
count rows the file does not hold; a stats-only run on the CPU has nothing else to write and
folds them on the calling thread. The file is flushed after every batch (a stats-only file,
whose flush writes a /stats slot, every STATS_FLUSH_SECONDS); `/progress` says how many rows are
valid (probe.store.fileformat), and its `complete` is the very last write of a clean run."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import NamedTuple

import h5py
import numpy as np
import torch

from probe.errors import WriteError
from probe.hooks.record import Record
from probe.plan import StatsSpec, StoreSpec
from probe.stats import backend
from probe.stats.running import bounds_for, stats_for
from probe.stats.topk import TopKState
from probe.store import direct, stats_file
from probe.store.chunks import (
    ChunkedDataset,
    Chunking,
    direct_plist,
    make_dataset,
    name_axes,
    row_bytes,
    row_kind,
)
from probe.store.coverage import Coverage
from probe.store.diskspace import RESUME, check_closing, check_space, failure
from probe.store.fileformat import FORMAT_VERSION, Progress, encode, layer_path, write_progress
from probe.store.livefile import LiveFile
from probe.store.resume import recompute, restore, valid_rows
from probe.store.stats_file import DatasetInfo, tags

log = logging.getLogger("probe")
ROW_DIMS = ("sample", "token", "batch")
# A stats-only run writes nothing between flushes but its statistics (about 1 ms per dataset).
STATS_FLUSH_SECONDS = 10.0
DEFAULT_STORE, DEFAULT_STATS = StoreSpec(), StatsSpec()  # the schema's defaults
HELD_BYTES = 64 << 20  # ... or sooner when the extras it holds until then reach this size


class Placement(NamedTuple):
    """Where one capture's rows go: rows lo..hi of its dataset (per batch: one row), its unit
    axis, and whether its rows are tokens."""

    key: tuple[str, str]
    t: torch.Tensor
    lo: int
    hi: int
    per_batch: bool
    axis: int
    by_token: bool


class ProbeWriter:
    """Owns probe.h5 for one run. `put` a Record per batch, then `close(complete=...)`."""

    def __init__(
        self,
        path: Path,
        store: StoreSpec = DEFAULT_STORE,
        stats: StatsSpec = DEFAULT_STATS,
        *,
        module_types: dict[str, str] | None = None,
        token_layers: frozenset[str] = frozenset(),
        attrs: dict | None = None,
        resume: bool = False,
        batch_rows: int = 1,
        index_offset: int = 0,
        total_rows: int | None = None,
        provenance=None,
        stats_backend: str | None = None,
        topk=None,
    ):
        """A writer of `path` as `store` (store.*) and `stats` (stats.during; the rest is the
        backend's and `topk`'s) say, the values probe.plan checked. `module_types` and
        `token_layers` name the layers and those stored one row per token; `attrs` are the file's
        attributes; `batch_rows` the rows of a full batch, `index_offset` a shard's first sample
        in the whole dataset and `total_rows` its samples; `provenance` the dataset's identity
        and per-sample names; `stats_backend` reduces captures (None: the environment's);
        `topk` the examples per unit kept with the statistics (a TopKSpec), or None."""
        mode = store.mode
        self.path, self.mode = Path(path), str(mode)
        compression = store.compression
        self.compression = None if compression == "none" else str(compression)
        self.compression_opts = store.compression_level if compression == "gzip" else None
        self.chunking = Chunking(
            store.chunk_bytes, self.compression is not None, total_rows, batch_rows
        )
        flush_seconds = store.flush_seconds
        if flush_seconds is None:
            flush_seconds = STATS_FLUSH_SECONDS if mode == "stats" else 0.0
        self.flush_seconds, self.last_flush = flush_seconds, time.monotonic()
        self.index_offset = index_offset  # a shard's first sample in the whole dataset
        self.module_types = module_types or {}
        self.token_layers = token_layers  # layers stored one row per token
        self.provenance = provenance  # the dataset's identity and per-sample names
        # statistics: run (folded batch by batch), close (from the rows at close), none
        self.stats_during, self.batch_rows = str(stats.during), batch_rows
        self.topk = topk  # examples per unit kept with the statistics (a TopKSpec), or None
        # what reduces captures to statistics in the hooks (`probe.stats.backend`)
        if stats_backend is None:
            stats_backend = backend.resolve(os.environ.get(backend.ENV, "auto"))
        self.hook_stats = backend.observer(stats_backend)
        self._start_counts()
        self._open(resume, batch_rows, attrs)
        # written chunks bypass the page cache where they can (probe.store.direct)
        direct_io = mode == "full" and store.direct_io
        self.direct_fd = direct.open_direct(self.path) if direct_io else None
        self.direct_writes: list | None = None  # a batch's whole chunks, written together
        self.queue: queue.Queue[Record | None] = queue.Queue(maxsize=store.queue_batches)
        self.thread = threading.Thread(target=self._loop, name="probe-writer", daemon=True)
        self.inline: bool | None = None  # decided by the first record (see put)

    def _start_counts(self) -> None:
        """What the writer tracks while it writes: datasets, rows, flushes and their bytes."""
        self.bounds: dict[tuple[str, str], tuple[float, float] | None] = {}  # by dataset
        self.datasets: dict[tuple[str, str], DatasetInfo] = {}
        self.chunked: dict[str, ChunkedDataset] = {}  # by HDF5 path, as appended to
        self.file_chunking: dict[str, int | None] = {}  # rows per chunk in the file, by path
        # per-sample extras (the model's output) a stats-only run writes at its next flush
        self.held: list[tuple[str, np.ndarray, int, int]] = []
        self.held_bytes = 0
        self.unflushable = False
        self.error: BaseException | None = None
        self.num_samples = 0
        self.num_batches = 0
        self.num_tokens = 0  # rows of the token-row datasets
        self.progress = Progress()  # what the file says is valid (published at each flush)
        self.coverage = Coverage()
        self.known: set[str] = set()  # HDF5 paths of the datasets the file holds
        self.hist_capacity: dict[tuple[str, str], int] = {}  # /stats histogram buckets per slot

    def _open(self, resume: bool, batch_rows: int, attrs: dict | None) -> None:
        """Open the file live: a new one with its attributes, or a resumed one continued after
        its last flushed batch."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.out = LiveFile(self.path, resume)
        except OSError as e:
            raise WriteError(
                f"cannot create {str(self.path)!r} ({e}); choose a writable run directory with "
                "hydra.run.dir=PATH"
            ) from None
        if not resume:
            self._start_file(attrs or {})
            self.file.flush()
            return
        try:
            restore(self, batch_rows)
            # readable at once: a resume killed before its first batch leaves its file in SWMR
            # mode, which readers open, not plainly open for write, which they cannot
            self.file.flush()
            self.out.go_live()
        except BaseException:
            self.out.close(None)
            raise

    def _start_file(self, attrs: dict) -> None:
        f = self.file
        f.attrs["format_version"] = FORMAT_VERSION
        f.attrs["complete"] = False
        for count in ("num_samples", "num_batches", "num_tokens"):
            f.attrs[count] = 0
        f.attrs["store_mode"] = self.mode
        for k, v in attrs.items():
            f.attrs[k] = v
        if self.mode == "full":
            f.create_group("layers")  # present even when nothing is selected
        if self.provenance is not None:
            for name, values in self.provenance.lists.items():
                f.create_dataset(f"dataset/{name}", data=values, dtype=h5py.string_dtype())
        write_progress(f, self.progress)

    # -- main thread -------------------------------------------------------------------------
    def put(self, record: Record) -> None:
        """Take the statistics of a CPU batch's captures the hooks did not `observe`, then queue it;
        blocks while the queue is full, raises promptly if the writer failed.

        Statistics run on this thread (mostly in the hooks, as each capture is taken), while the
        forward's cores are idle; on the writer thread they would compete with the next forward
        pass. The writer folds them in when it writes the batch."""
        counted = record.counted
        if record.ready is None and self.stats_during == "run":
            for key, t in [*record.values.items(), *record.per_batch.items()]:
                if key not in counted and key not in record.plain:
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
        """Drain the queue, write statistics and counts, mark completion last, close."""
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
        final = None
        short = check_closing(self) if self.file.id.valid and not io_failed else None
        self.error = self.error or short
        try:
            # after a failed write HDF5 cannot flush
            if self.file.id.valid and not io_failed and not self.unflushable and short is None:
                self._close_coverage()
                if self.stats_during == "close":
                    for key, info in self.datasets.items():
                        recompute(self, key, info, valid_rows(self, info), self.batch_rows)
                self._flush(final=True, complete=complete and self.error is None)
                final = {
                    "num_samples": self.num_samples,
                    "num_batches": self.num_batches,
                    "num_tokens": self.num_tokens,
                    "complete": self.progress.complete,
                }
        except (OSError, RuntimeError) as e:
            self.error = self.error or e
            final = None
        finally:
            if self.direct_fd is not None:
                os.close(self.direct_fd)
                self.direct_fd = None
            try:
                self.out.close(final, abandon=final is None and self.error is not None)
            except (OSError, RuntimeError) as e:
                self.error = self.error or e
        self.coverage.warn(self.datasets, self.num_samples, self.num_batches, self.num_tokens)
        if complete:
            self._raise_if_failed()

    @property
    def file(self) -> h5py.File:
        return self.out.file

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
                f"writing {str(self.path)!r} failed{hint}: {failure(e)}. The file holds the "
                f"{self.progress.samples} samples flushed before (nothing more is written to it); "
                f"{RESUME}"
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
        if self.out.live and self._needs_objects(r):
            self._creating()
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
        self._flush()
        log.debug("flushed batch %d (%d samples)", r.batch_index, end)

    def _flush(self, final: bool = False, complete: bool = False) -> None:
        """Publish what is written: held extras and (stats-only, or at the end) the statistics
        into the slot not in use, then the counts that point at them. A full run's statistics
        are written at its end only (a resumed one recomputes them from the rows)."""
        if self.held and self.out.live and any(n not in self.known for n, *_ in self.held):
            self._creating()
        self._write_held()
        for dim, n in (("token", self.num_tokens), ("batch", self.num_batches)):
            if dim in self.known:  # pure dimensions: their length is the rows written
                self.file[dim].resize((n,))
        self.out.go_live()
        slot = -1
        if self.mode == "stats" or (final and self.stats_during != "none"):
            previous = self.progress.stats_slot
            slot = 1 - previous if previous >= 0 else 0
            self._stats_groups()
            self.file.flush()  # the data before the statistics that count it
            capacity = stats_file.write_slot(self.file, self.datasets.values(), slot)
            self.hist_capacity.update(capacity)
        self.progress = Progress(
            self.num_samples, self.num_batches, self.num_tokens, complete, slot
        )
        self.out.publish(self.progress)
        self.last_flush = time.monotonic()

    def _needs_objects(self, r: Record) -> bool:
        """Whether `r` brings a dataset the file does not hold yet (created outside SWMR mode)."""
        keys = [k for k in [*r.values, *r.per_batch] if k not in r.plain]
        if any(key not in self.datasets for key in keys):
            return True
        if self.mode == "full" and any(layer_path(*k) not in self.known for k in r.plain):
            return True
        gaps = any(
            self.coverage.needs_dataset(self.file, key, lo)
            for key, _, lo, *_ in self._placements(r, r.start + r.size)
        )
        if any(n not in self.known for n in [*r.outputs.batches, *r.outputs.once]):
            return True
        if gaps or self.mode != "full":
            return gaps
        names = [*r.outputs.samples, *(r.tokens or {})] + (
            ["samples/target"] if r.targets is not None else []
        )
        return any(n not in self.known for n in names)

    def _creating(self) -> None:
        """Leave SWMR mode to create objects; dataset handles of the closed file are dropped."""
        if self.out.creating():
            self.chunked.clear()
            self.file_chunking.clear()

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

    # -- one batch's arrays into the file: where rows go, datasets made on first sight --------
    def _stats_groups(self) -> None:
        """The /stats group of every dataset (a resumed file may lack some)."""
        if self.stats_during == "none":
            return
        paths = {key: f"stats/{encode(key[0])}/{encode(key[1])}" for key in self.datasets}
        missing = [key for key, p in paths.items() if p not in self.known]
        if missing and self.out.live:
            self._creating()
        for order, (key, info) in enumerate(self.datasets.items()):
            if key in missing:
                stats_file.create(self.file, info, order)
                self.known.add(paths[key])

    def _placements(self, r: Record, end: int) -> list[Placement]:
        """Where the rows of each capture of `r` go."""
        tokens = (self.num_tokens, self.num_tokens + r.token_count)
        out = []
        for key, t in r.values.items():
            by_token = key in r.token_keys
            lo, hi = tokens if by_token else (r.start, end)
            out.append(Placement(key, t, lo, hi, False, r.axes.get(key, 1), by_token))
        for key, t in r.per_batch.items():
            out.append(Placement(key, t, r.batch_index, r.batch_index + 1, True, 1, False))
        return out

    def _append_batch(self, r: Record, end: int) -> None:
        for place in self._placements(r, end):
            if place.key in r.plain:
                attrs = {**r.plain[place.key], "unit_axis": place.axis}
                self._append_unstated(place, place.t.numpy(), attrs)
                continue
            self._append(place, r)
        tokens = (self.num_tokens, self.num_tokens + r.token_count)
        if self.mode == "full" and self.token_layers and r.tokens is not None:
            for name, a in r.tokens.items():  # samples as in samples/index: dataset-wide
                offset = self.index_offset if name == "tokens/sample" else 0
                self._append_plain(name, a + offset if offset else a, *tokens, kind="token")
        self._append_outputs(r, end)
        if self.mode == "full":
            self._append_plain(
                "samples/index",
                np.arange(r.start, end, dtype=np.int64) + self.index_offset,
                r.start,
                end,
            )
            if r.targets is not None:
                self._append_plain("samples/target", r.targets.cpu().numpy(), r.start, end)
            if self.provenance is not None and self.provenance.per_sample:
                index = np.arange(r.start, end, dtype=np.int64) + self.index_offset
                for name, values in self.provenance.samples(index).items():
                    self._append_plain(f"samples/{name}", values, r.start, end)

    def _append_outputs(self, r: Record, end: int) -> None:
        """The features' named outputs: rows per sample, arrays written once, a row per batch."""
        out = r.outputs
        for name, t in out.samples.items():
            if self.mode == "stats":  # written with the statistics, at the flush
                self.held.append((name, t.numpy(), r.start, end))
                self.held_bytes += self.held[-1][1].nbytes
            else:
                self._append_plain(name, t.numpy(), r.start, end)
        for name, a in out.once.items():  # (a lens's first samples: written with the first batch)
            if name not in self.known:
                self._write_once(name, np.asarray(a))
        for name, a in out.batches.items():
            new = name not in self.known
            self._append_plain(name, a, r.batch_index, r.batch_index + 1, kind="batch")
            if new:  # (which rows are valid: batches)
                self.chunked[name].ds.attrs["per_batch"] = True

    def _write_once(self, name: str, a: np.ndarray) -> None:
        if name not in self.file:
            if a.dtype.kind in "UO":
                self.file.create_dataset(name, data=a.astype(object), dtype=h5py.string_dtype())
            else:
                self.file.create_dataset(name, data=a)
        self.known.add(name)

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

    def _append(self, place: Placement, r: Record) -> None:
        """One capture of `r`: its statistics and examples folded in, its rows written."""
        key, t, lo, hi, per_batch, unit_axis, by_token = place
        counted, examples = r.counted.get(key), r.outputs.examples.get(key)
        store = key not in r.unstored
        info = self.datasets.get(key)
        if info is None:
            module_type = self.module_types.get(key[0], "")
            info = DatasetInfo(
                key[0],
                key[1],
                module_type,
                tuple(t.shape[1:]),
                str(t.dtype).removeprefix("torch."),
                stats_for(module_type, key[1], unit_axis),
                per_batch,
                "tokens" if by_token else "samples",
            )
            self.datasets[key] = info
        if self.stats_during == "run":  # (else made at close: its layout follows the stats)
            info.stats.merge(counted if counted is not None else self.observe(key, t, unit_axis))
            if examples is not None:  # the batch's examples per unit (probe.stats.topk)
                if info.topk is None:
                    info.topk = TopKState(self.topk)
                info.topk.merge({kind: (v.numpy(), k.numpy()) for kind, (v, k) in examples.items()})
        if (
            self.stats_during == "run"
            and f"stats/{encode(key[0])}/{encode(key[1])}" not in self.known
        ):
            stats_file.create(self.file, info, len(self.datasets) - 1)
            self.known.add("stats/" + encode(key[0]) + "/" + encode(key[1]))
        gap = self.coverage.add(self.file, key, lo, hi)
        if self.mode != "full" or not store:
            return
        name = layer_path(*key)
        if name not in self.known:
            self._create_capture(name, info, t.numpy(), len(self.datasets) - 1)
        if gap is not None:
            self.chunked[name].fill(*gap)
        self._append_plain(name, t.numpy(), lo, hi)  # created above, by its kind

    def _append_unstated(self, place: Placement, a: np.ndarray, attrs: dict) -> None:
        """A dataset of the layer's rows with no statistics (an SAE's sparse latents)."""
        key, lo, hi, by_token = place.key, place.lo, place.hi, place.by_token
        if self.mode != "full":
            return
        name = layer_path(*key)
        if name not in self.known:
            ds = self._create(name, a, "token" if by_token else "sample")
            ds.attrs.update(
                {**attrs, "site": key[1], "row_unit": "tokens" if by_token else "samples"}
            )
            self.chunked[name] = ChunkedDataset(ds)
        self._append_plain(name, a, lo, hi)

    def _create_capture(self, name: str, info: DatasetInfo, a: np.ndarray, order: int) -> None:
        """A layer's dataset, tagged with what it is and with named dimensions."""
        g = self.file.require_group(name.rsplit("/", 1)[0])
        if "order" not in g.attrs:  # lets a file cut short say what each layer is, in order
            g.attrs["name"] = info.layer
            g.attrs["module_type"] = info.module_type
            g.attrs["order"] = order
        ds = self._create(name, a, row_kind(info.per_batch, info.rows))
        for k, v in tags(info, order).items():
            ds.attrs[k] = v
        name_axes(
            self.file, ds, info.stats.unit_axis, info.rows, info.per_batch, self.chunking.samples
        )
        self.known.update(d for d in ROW_DIMS if d in self.file)
        self.chunked[name] = ChunkedDataset(ds)

    def _append_plain(
        self, name: str, a: np.ndarray, lo: int, hi: int, kind: str = "sample"
    ) -> None:
        target = self.chunked.get(name)
        if target is None:
            ds = self.file.get(name)
            if ds is None:
                if lo != 0:
                    raise WriteError(f"dataset {name!r} appeared first at row {lo}")
                ds = self._create(name, a, kind)
            target = self.chunked[name] = ChunkedDataset(ds)
        target.append(a, lo, hi, self.direct_writes)

    def _create(self, name: str, a: np.ndarray, kind: str) -> h5py.Dataset:
        size = row_bytes(a)
        rows = self.chunking.rows(kind, len(a), size)
        plist = direct_plist(rows * size, self.chunking.compressed, self.direct_fd, a.dtype)
        self.known.add(name)
        return make_dataset(
            self.file, name, a, rows, self.compression, self.compression_opts, plist
        )

    def _close_coverage(self) -> None:
        """Rows a site missed at the end of the run (it did not run for the last batches)."""
        missing = []
        for key, info in self.datasets.items():
            total = self.num_batches if info.per_batch else self.num_samples
            total = self.num_tokens if info.rows == "tokens" else total
            if self.coverage.gap_before(key, total) is not None:
                missing.append((key, total))
        if not missing:
            return
        if any(self.coverage.needs_dataset(self.file, k, n) for k, n in missing):
            self._creating()
        for key, total in missing:
            gap = self.coverage.add(self.file, key, total, total)
            name = layer_path(*key)
            if self.mode == "full" and gap is not None and name in self.file:
                if name not in self.chunked:  # (statistics-only sites have no dataset)
                    self.chunked[name] = ChunkedDataset(self.file[name])
                self.chunked[name].fill(*gap)
