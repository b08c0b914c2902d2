"""The run's sink: probe.h5 for one run (one rank's file under torchrun), written from what the
run's loop and its parts hand it by name.

What it takes, by kind:
- **rows**: a `Record` per batch (`put`): the captures and the parts' outputs of one row per
  sample, token or batch, and arrays written whole the first time they come
  (probe.store.row_datasets), written by one background thread fed by a bounded queue while the next
  forward runs;
- **folds**: running values a run part keeps of every written batch (statistics, top-k
  examples: a `Fold`), folded in as their batch is written, so they never count rows the file
  does not hold, and published with the counts;
- **groups**: after the loop, keyed groups appended one key at a time (a prompt's attribution
  graph: probe.store.groups), and a pass's running state saved after every step
  (probe.store.pass_state);
- **whole**: arrays a pass writes once at its end (a circuit's scores).

One flush policy: the rows are flushed after every batch (a stats-only file, which has nothing
to publish but its folds, every STATS_FLUSH_SECONDS), `/progress` saying how many are valid
(probe.store.fileformat); folds are published into the slot `/progress` does not point at,
then pointed at (every flush of a stats-only file, else at the end). One resume rule: every kind
is cut back to its last whole unit (rows to the published counts, groups to their last whole
key, folds to their published slot, a pass to its last saved state). One interrupt rule: what
was written before a stop or a failure stays; `complete`, the very last write, says whether the
run is whole. One stitch of torchrun shards (probe.store.stitch).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import h5py

from probe.errors import WriteError
from probe.hooks.record import Record
from probe.plan import StoreSpec
from probe.store import direct, resume
from probe.store.chunks import Chunking
from probe.store.diskspace import RESUME, check_closing, check_space, failure
from probe.store.fileformat import FORMAT_VERSION, Progress, write_progress
from probe.store.groups import GroupKind, GroupTables
from probe.store.livefile import LiveFile
from probe.store.pass_state import PassState
from probe.store.row_datasets import Rows

if TYPE_CHECKING:
    from probe.data.provenance import Provenance

log = logging.getLogger("probe")
# A stats-only run writes nothing between flushes but its statistics (about 1 ms per dataset).
STATS_FLUSH_SECONDS = 10.0
HELD_BYTES = 64 << 20  # ... or sooner when the outputs it holds until then reach this size
DEFAULT_STORE = StoreSpec()  # the schema's defaults


@dataclass
class RunFile:
    """The file a sink writes and what it says of itself: its attributes, whether it continues
    a stopped run's file (`resume`), the rows of a full batch, the rank's first sample in the
    whole dataset and its count of samples, the dataset's identity and per-sample names, and the
    captured layers' module types."""

    path: Path
    attrs: dict[str, Any] = field(default_factory=dict)
    resume: bool = False
    batch_rows: int = 1
    first_sample: int = 0
    samples: int | None = None
    provenance: Provenance | None = None  # the dataset's identity and per-sample names
    module_types: dict[str, str] = field(default_factory=dict)


class Fold(Protocol):
    """Running values a run part keeps of the written batches (probe.store.folds): its
    partials are each record's `outputs.folds[name]`. Every step runs on the thread that writes
    (`fold`, `publish`) or before it starts (`restore`) and after it stops (`close`)."""

    name: str

    def restore(self, sink: Sink) -> None:
        """A resumed file: the values as of its published slot (or from its rows)."""

    def fold(self, sink: Sink, record: Record) -> None:
        """`record` is written: its partials folded in, new groups made (the sink is out of
        SWMR mode when the record brings new captures)."""

    def publish(self, sink: Sink, slot: int) -> None:
        """The values into `slot` of their groups (made first where missing)."""

    def close(self, sink: Sink) -> None:
        """Before the last flush (what is computed from the rows at the end)."""

    def batch_bytes(self, record: Record) -> int:
        """What folding `record` can add to the file at the next publication."""
        return 0

    def closing_bytes(self, sink: Sink) -> int:
        """What publishing the values can still add to the file."""
        return 0


class Sink:
    """Owns one run's file. `put` a Record per batch, `end_rows` when the loop is done, then
    groups and whole arrays from the passes, and `close(complete=...)`."""

    def __init__(self, file: RunFile, store: StoreSpec = DEFAULT_STORE) -> None:
        """A sink writing `file` as `store` (store.*) says, the values probe.plan checked."""
        mode = store.mode
        self.path, self.mode = Path(file.path), str(mode)
        self.batch_rows = file.batch_rows
        compression = None if store.compression == "none" else str(store.compression)
        chunking = Chunking(
            store.chunk_bytes, compression is not None, file.samples, file.batch_rows
        )
        flush_seconds = store.flush_seconds
        if flush_seconds is None:
            flush_seconds = STATS_FLUSH_SECONDS if mode == "stats" else 0.0
        self.flush_seconds, self.last_flush = flush_seconds, time.monotonic()
        self.folds: list[Fold] = []
        self.error: BaseException | None = None
        self.unflushable = False
        self.progress = Progress()  # what the file says is valid (published at each flush)
        self.resumed = False
        self._open(file)
        # written chunks bypass the page cache where they can (probe.store.direct)
        direct_fd = direct.open_direct(self.path) if mode == "full" and store.direct_io else None
        self.rows = Rows(
            lambda: self.out.file, self._creating, mode=self.mode, chunking=chunking,
            compression=compression,
            compression_opts=store.compression_level if compression == "gzip" else None,
            module_types=file.module_types, first_sample=file.first_sample,
            provenance=file.provenance, direct_fd=direct_fd,
        )  # fmt: skip
        if file.resume:
            self._restore()
        self.queue: queue.Queue[Record | None] = queue.Queue(maxsize=store.queue_batches)
        self.thread = threading.Thread(target=self._loop, name="probe-writer", daemon=True)
        self.inline: bool | None = None  # decided by the first record (see put)
        self.rows_ended = False

    def _open(self, file: RunFile) -> None:
        """Open the file live: a new one with its attributes, or a resumed one (restored once
        its rows' bookkeeping exists)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.out = LiveFile(self.path, file.resume)
        except OSError as e:
            raise WriteError(
                f"cannot create {str(self.path)!r} ({e}); choose a writable run directory with "
                "hydra.run.dir=PATH"
            ) from None
        if file.resume:
            return
        f = self.file
        f.attrs["format_version"] = FORMAT_VERSION
        f.attrs["complete"] = False
        for count in ("num_samples", "num_batches", "num_tokens"):
            f.attrs[count] = 0
        f.attrs["store_mode"] = self.mode
        for k, v in file.attrs.items():
            f.attrs[k] = v
        if self.mode == "full":
            f.create_group("layers")  # present even when nothing is selected
        if file.provenance is not None:
            for name, values in file.provenance.lists.items():
                f.create_dataset(f"dataset/{name}", data=values, dtype=h5py.string_dtype())
        write_progress(f, self.progress)
        f.flush()

    def _restore(self) -> None:
        """A resumed file back to its last flush (probe.store.resume), readable at once: a
        resume killed before its first batch leaves its file in SWMR mode, which readers open."""
        try:
            resume.restore_rows(self)
            self.file.flush()
            self.out.go_live()
        except BaseException:
            self.out.close(None)
            raise
        self.resumed = True

    def attach(self, fold: Fold) -> None:
        """Fold what `fold` keeps from now on (a resumed file's values restored first)."""
        if self.resumed:
            fold.restore(self)
        self.folds.append(fold)

    @property
    def file(self) -> h5py.File:
        return self.out.file

    @property
    def num_samples(self) -> int:
        return self.rows.num_samples

    @property
    def num_batches(self) -> int:
        return self.rows.num_batches

    @property
    def num_tokens(self) -> int:
        return self.rows.num_tokens

    @property
    def datasets(self):
        """The captures' DatasetInfo by (layer, site), in the run's order."""
        return self.rows.datasets

    # -- rows: main thread -----------------------------------------------------------------
    def put(self, record: Record) -> None:
        """Queue one batch's record; blocks while the queue is full, raises promptly if the
        writer failed. A stats-only batch of CPU tensors leaves nothing to write but its folds:
        folding them here costs less than handing them to a thread that would take the GIL
        from the next forward pass. Records with GPU copies still go to the thread."""
        if self.inline is None:
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
                self.unflushable = True  # the folds in memory no longer match a row count
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

    def end_rows(self) -> None:
        """The loop is done: every queued batch written and the writer thread stopped (the
        passes after the loop write on the calling thread); raises what the thread met."""
        if self.rows_ended:
            return
        self.rows_ended = True
        if self.thread.is_alive():
            while True:
                try:
                    self.queue.put(None, timeout=0.2)
                    break
                except queue.Full:
                    if not self.thread.is_alive():
                        break
            self.thread.join()

    def close(self, complete: bool) -> None:
        """Drain the queue, publish the folds and counts, mark completion last, close."""
        self.end_rows()
        io_failed = isinstance(self.error, OSError | RuntimeError) and not isinstance(
            self.error, WriteError
        )
        final = None
        short = check_closing(self) if self.file.id.valid and not io_failed else None
        self.error = self.error or short
        try:
            # after a failed write HDF5 cannot flush
            if self.file.id.valid and not io_failed and not self.unflushable and short is None:
                self.rows.close_coverage()
                for fold in self.folds:
                    fold.close(self)
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
            if self.rows.direct_fd is not None:
                os.close(self.rows.direct_fd)
                self.rows.direct_fd = None
            try:
                self.out.close(final, abandon=final is None and self.error is not None)
            except (OSError, RuntimeError) as e:
                self.error = self.error or e
        rows = self.rows
        rows.coverage.warn(rows.datasets, rows.num_samples, rows.num_batches, rows.num_tokens)
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
                f"writing {str(self.path)!r} failed{hint}: {failure(e)}. The file holds the "
                f"{self.progress.samples} samples flushed before (nothing more is written to it); "
                f"{RESUME}"
            )
            error.hdf5_unclosed = self.file.id.valid  # HDF5 retries the flush at exit and crashes
            raise error from None
        if self.inline is False and not self.thread.is_alive() and self.queue.qsize():
            raise WriteError(f"the writer of {str(self.path)!r} stopped unexpectedly")

    # -- rows: the thread that writes ------------------------------------------------------
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
        """Write one record and fold it in, then give its buffers back for the next batches."""
        check_space(self, record)
        if record.ready is not None:
            record.ready.synchronize()
        if self.out.live and self.rows.needs_objects(record):
            self._creating()
        self.rows.append_batch(record)
        for fold in self.folds:
            fold.fold(self, record)
        if record.release is not None:
            record.release()
        rows = self.rows
        if time.monotonic() - self.last_flush < self.flush_seconds and rows.held_bytes < HELD_BYTES:
            return  # the row count on disk moves only with a flush, so it never overstates
        self._flush()
        log.debug("flushed batch %d (%d samples)", record.batch_index, rows.num_samples)

    def _flush(self, final: bool = False, complete: bool = False) -> None:
        """Publish what is written: held outputs and (stats-only, or at the end) the folds into
        the slot not in use, then the counts that point at them. A full run's folds are
        published at its end only (a resumed one computes them again from the rows)."""
        rows = self.rows
        rows.write_held()
        rows.resize_dims()
        self.out.go_live()
        slot = -1
        if self.folds and (self.mode == "stats" or final):
            previous = self.progress.stats_slot
            slot = 1 - previous if previous >= 0 else 0
            self.file.flush()  # the data before the folds that count it
            for fold in self.folds:
                fold.publish(self, slot)
        self.progress = Progress(
            rows.num_samples, rows.num_batches, rows.num_tokens, complete, slot
        )
        self.out.publish(self.progress)
        self.last_flush = time.monotonic()

    def _creating(self) -> None:
        """Leave SWMR mode to create objects; dataset handles of the closed file are dropped."""
        if self.out.creating():
            self.rows.dropped_handles()

    # -- after the loop: groups, a pass's state, whole arrays ------------------------------
    def groups(self, kind: GroupKind, attrs: Mapping[str, object], keep: bool) -> GroupTables:
        """`kind`'s group to append keys to after the loop: a new one, or with `keep` (a
        resumed run) the one the file holds, cut to its whole keys."""
        self._after_rows()
        return GroupTables(self.file, kind, attrs, keep=keep)

    def pass_state(self, name: str) -> PassState:
        """The running state of the pass `name` (probe.store.pass_state)."""
        self._after_rows()
        return PassState(self.file, name)

    def write_whole(self, name: str, write: Callable[[h5py.File], None]) -> None:
        """`write` the group `name` whole into the file (replacing one there), flushed."""
        self._after_rows()
        if name in self.file:
            del self.file[name]
        write(self.file)
        self.file.flush()

    def _after_rows(self) -> None:
        """The file out of SWMR mode (groups create objects and write strings), its rows done."""
        self.end_rows()
        self._raise_if_failed()
        self._creating()


def attach_all(sink: Sink, folds: Sequence[Fold]) -> None:
    """Attach each of `folds` to `sink`, in order."""
    for fold in folds:
        sink.attach(fold)
