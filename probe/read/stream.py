"""A run's captures as training data: a shuffled, bounded-memory torch IterableDataset of rows.

`Run.dataset(layer, site)` (and `Sweep.dataset`, concatenating runs) streams the valid rows of one
dataset: only the rows `/progress` counts and the site saw (a live run's flushed rows; coverage
gaps left out). Shuffling is chunk-aware, as mosaicml's streaming shuffles shards: each epoch a
seeded permutation of the file's chunks, split over DataLoader workers and DDP ranks so every row
comes once per epoch, read chunk by chunk (sequential reads) into a rolling buffer of
`buffer_rows` rows from which each batch is drawn at random, the buffer refilled as it drains.
Memory is the buffer and one chunk, whatever the file. `state_dict()` holds the epoch, the chunks read,
the ids of the rows left in the buffer and the generator: a resumed stream gives the batches an
uninterrupted one would have.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import overload

import h5py
import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from probe.errors import DataError
from probe.read.chunk_reads import ChunkReader, open_plain

BUFFER_BYTES = 64 << 20  # the default buffer: rows of this many bytes (at least 4 batches)


@dataclass
class Source:
    """One dataset of one run file: its valid row ranges and what goes with each row."""

    h5_path: str
    name: str  # HDF5 path of the rows
    ranges: list[tuple[int, int]]  # valid rows
    chunk: int  # rows per HDF5 chunk
    labels: str | None = None  # /samples/target or /tokens/label, when the run has them
    index: dict[str, str] = field(default_factory=dict)  # with_index: name -> HDF5 path
    row_bytes: int = 0
    shape: tuple = ()  # one row's shape
    paired: str | None = None  # HDF5 path of a second site's rows of the same tokens (`pair`)
    paired_shape: tuple = ()


class RowStream(IterableDataset):
    """Batches of `(rows, labels)` (labels None where the run has none; with `with_index` also a
    dict of each row's sample, and for token rows position and token id, and `source`: which
    of the sources, a sweep's runs in order). Use it with `DataLoader(stream, batch_size=None,
    num_workers=...)`. Ranks may get a batch more or less than each other: every row comes once,
    none is repeated to even them out."""

    def __init__(self, sources: list[Source], batch_size: int = 4096, shuffle: bool = True,
                 seed: int = 0, buffer_rows: int | None = None, drop_last: bool = False,
                 with_index: bool = False, dtype=None, device=None, rank: int | None = None,
                 world_size: int | None = None):  # fmt: skip
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be at least 1")
        shapes = {(s.shape, s.paired_shape) for s in sources}
        if len(shapes) > 1:
            raise DataError(
                f"the runs' rows differ in shape ({', '.join(map(str, sorted(shapes)))}); stream "
                "the runs of one shape (open_run(path).dataset) or sweep only what keeps it"
            )
        if any(s.labels is None for s in sources):  # labels only where every run has them
            sources = [replace(s, labels=None) for s in sources]
        self.sources, self.batch_size, self.shuffle, self.seed = sources, batch_size, shuffle, seed
        width = max(s.row_bytes for s in sources) if sources else 1
        self.buffer_rows = buffer_rows or max(4 * batch_size, BUFFER_BYTES // max(width, 1))
        self.drop_last, self.with_index = drop_last, with_index
        self.dtype, self.device = dtype, torch.device(device) if device is not None else None
        self.rank, self.world_size = rank, world_size
        self.epoch = 0
        self._resume: dict | None = None
        self._state: Callable[[], dict] | None = None  # the stream's state as of the last batch

    @property
    def held_rows(self) -> int:
        """The buffer's rows, what it fills up to before a batch is drawn: `buffer_rows`, and
        at least a batch and a chunk (with shuffle off, just that)."""
        least = self.batch_size + max((s.chunk for s in self.sources), default=1) - 1
        return max(self.buffer_rows, least) if self.shuffle else least

    def __len__(self) -> int:
        rows = sum(hi - lo for s in self.sources for lo, hi in s.ranges)
        return rows // self.batch_size if self.drop_last else math.ceil(rows / self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose permutation the next pass takes (call it before each, as with
        DistributedSampler)."""
        self.epoch = int(epoch)

    def _shard(self) -> tuple[int, int]:
        """(this reader's index, how many readers): ranks x DataLoader workers."""
        rank, world = self.rank, self.world_size
        if rank is None and torch.distributed.is_available() and torch.distributed.is_initialized():
            rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        rank, world = rank or 0, world or 1
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        return rank * workers + worker, world * workers

    def pieces(self) -> list[tuple[int, int, int]]:
        """(source, first row, end) of every chunk's valid rows, in file order."""
        out = []
        for i, s in enumerate(self.sources):
            for lo, hi in s.ranges:
                start = lo
                while start < hi:
                    end = min(hi, (start // s.chunk + 1) * s.chunk)
                    out.append((i, start, end))
                    start = end
        return out

    def order(self, epoch: int) -> list[tuple[int, int, int]]:
        """This reader's pieces of `epoch`: a seeded permutation, dealt to every reader."""
        pieces = self.pieces()
        if self.shuffle:
            g = np.random.default_rng([self.seed, epoch])
            pieces = [pieces[i] for i in g.permutation(len(pieces)).tolist()]
        me, readers = self._shard()
        return pieces[me::readers]

    def state_dict(self, arrays: bool = False) -> dict:
        """Where the stream stands (the last batch given): resume with load_state_dict. Plain
        lists and ints: it survives JSON and torch.save. `arrays`: the buffer's held rows as one
        (rows, 2) int64 array rather than a list of [source, row] lists (no Python object a row:
        what a checkpoint of a large buffer wants; load_state_dict reads either)."""
        if self._state is None:
            return {}
        state = self._state()
        return {**state, "held": state["held"].copy() if arrays else state["held"].tolist()}

    def load_state_dict(self, state: dict) -> None:
        self._resume = dict(state) if state else None
        if state:
            self.epoch = int(state["epoch"])

    def __iter__(self):
        from probe.store.runfile import open_probe_file

        files: dict = {}
        opener = lambda path: open_probe_file(path, ours_only=False)  # noqa: E731
        buf = Buffer(self, files, opener)
        try:
            yield from self._batches(buf)
        finally:
            for plain in buf.plain_files.values():
                if plain is not None:
                    plain.close()
            if self._state is not None:  # (a snapshot: the buffer's memory goes with the pass)
                last = self._state()
                self._state = lambda: last
            for f in files.values():
                f.close()

    def _batches(self, buf: Buffer):
        """Keep the buffer full, draw each batch at random from all it holds, refill with the
        next chunk: a row's stay is geometric, so the rows of one sequence spread over many
        batches (half the same-sequence share of filling and draining the buffer whole)."""
        epoch, resume = self.epoch, self._resume
        self._resume = None
        me, _ = self._shard()
        g = np.random.default_rng([self.seed, epoch, me + 1])
        order = self.order(epoch)
        cursor = 0
        if resume is not None:
            cursor = int(resume["cursor"])
            g.bit_generator.state = resume["generator"]
            buf.load(np.asarray(resume["held"], np.int64).reshape(-1, 2))
        while True:
            while (
                cursor < len(order)
                and buf.size + order[cursor][2] - order[cursor][1] <= self.held_rows
            ):
                buf.add(*order[cursor])
                cursor += 1
            done = cursor >= len(order)
            if buf.size < self.batch_size and (not done or self.drop_last or not buf.size):
                if done:
                    return
                continue
            take = min(self.batch_size, buf.size)
            if self.shuffle:  # (sorted: the held rows' order is about their memory order)
                picked = np.sort(g.choice(buf.size, take, replace=False, shuffle=False))
            else:
                picked = np.arange(take)
            data = buf.take(picked)
            # read by state_dict() while this generator waits at the yield: as of this batch
            self._state = lambda c=cursor: {"epoch": epoch, "cursor": c, "held": buf.held,
                                            "generator": g.bit_generator.state}  # fmt: skip
            yield self._batch(data)

    def _batch(self, data: dict[str, np.ndarray]):
        rows = torch.from_numpy(data["rows"])
        if self.dtype is not None:
            rows = rows.to(self.dtype)
        labels = torch.from_numpy(data["labels"]) if "labels" in data else None
        paired = torch.from_numpy(data["paired"]) if "paired" in data else None
        if paired is not None and self.dtype is not None:
            paired = paired.to(self.dtype)
        if self.device is not None:
            device = self.device
            rows, labels, paired = _to(rows, device), _to(labels, device), _to(paired, device)
        out: tuple[torch.Tensor | dict[str, torch.Tensor] | None, ...] = (rows, labels)
        if self.with_index:
            skip = ("rows", "labels", "paired")
            out += ({k: torch.from_numpy(v) for k, v in data.items() if k not in skip},)
        return out if paired is None else (*out, paired)


@overload
def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor: ...
@overload
def _to(t: None, device: torch.device) -> None: ...
@overload
def _to(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None: ...
def _to(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """To the device; through pinned memory and a non-blocking copy for CUDA."""
    if t is None or device.type != "cuda":
        return t if t is None else t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class Buffer:
    """The rows in hand, in arrays of `held_rows` slots allocated once. A chunk is read
    sequentially into a scratch array and scattered into free slots; a batch is gathered out of
    its slots, which become free. Only 8-byte slot numbers move: `slots` lists the held rows'
    slots in held order (a batch's picks are places in it), `ids` each slot's (source, row)."""

    def __init__(self, stream: RowStream, files: dict, opener):
        self.stream, self.files, self.opener = stream, files, opener
        self.arrays: dict[str, np.ndarray] = {}
        self.scratch: dict[str, np.ndarray] = {}
        self._slots = np.zeros(0, np.int64)
        self.free = np.zeros(0, np.int64)  # a stack of free slots, the first free_count
        self.ids = np.zeros((0, 2), np.int64)
        self.opened: dict[int, dict] = {}
        self.plain_files: dict = {}
        self.pool = BatchPool()
        self.size = self.free_count = 0

    @property
    def slots(self) -> np.ndarray:
        """The held rows' slots, in held order (a view)."""
        return self._slots[: self.size]

    @property
    def held(self) -> np.ndarray:
        """(source, row) of each held row, in held order."""
        return self.ids[self.slots]

    def _datasets(self, i: int) -> dict:
        """Source i's datasets, opened once per pass."""
        if i not in self.opened:
            s = self.stream.sources[i]
            f = self.files.get(s.h5_path)
            if f is None:
                f = self.files[s.h5_path] = self.opener(s.h5_path)
                self.plain_files[s.h5_path] = open_plain(s.h5_path)
            names = {"rows": s.name}
            if s.labels is not None:
                names["labels"] = s.labels
            if s.paired is not None:
                names["paired"] = s.paired
            if self.stream.with_index:
                names.update(s.index)
            plain = self.plain_files[s.h5_path]
            self.opened[i] = {k: ChunkReader(_uncached(f, n), plain) for k, n in names.items()}
        return self.opened[i]

    def add(self, i: int, lo: int, hi: int, rows: np.ndarray | None = None) -> None:
        """Rows [lo, hi) of source i (or only `rows` among them) into free slots, held last."""
        datasets = self._datasets(i)
        if not self.arrays:
            chunk = max(s.chunk for s in self.stream.sources)
            capacity = self.stream.held_rows
            for k, reader in datasets.items():
                ds = reader.ds
                self.arrays[k] = np.empty((capacity, *ds.shape[1:]), ds.dtype)
                self.scratch[k] = np.empty((chunk, *ds.shape[1:]), ds.dtype)
            self.ids = np.zeros((capacity, 2), np.int64)
            self.free, self.free_count = np.arange(capacity)[::-1].copy(), capacity
            self._slots = np.zeros(capacity, np.int64)
        n, wanted = len(self.slots), np.arange(lo, hi) if rows is None else rows
        at = self.free[self.free_count - len(wanted) : self.free_count][::-1]
        self.free_count -= len(wanted)
        run = at[0] + len(at) == at[-1] + 1 and bool((np.diff(at) == 1).all())
        into = slice(int(at[0]), int(at[-1]) + 1) if run else at  # (filling: one block)
        pick = None if rows is None else wanted - lo
        for k, reader in datasets.items():
            reader.scatter(lo, hi, self.arrays[k], into, pick, self.scratch[k])
        self.ids[at, 0], self.ids[at, 1] = i, wanted
        self._slots[n : n + len(at)] = at
        self.size = n + len(at)

    def take(self, picked: np.ndarray) -> dict[str, np.ndarray]:
        """The rows at these places of the held list, gathered; their slots freed."""
        at = self.slots[picked]
        out = {k: a[at] for k, a in self.arrays.items() if k != "rows"}
        out["rows"] = self.pool.gather(self.arrays["rows"], at)
        if self.stream.with_index:
            out["source"] = self.ids[at, 0]
        keep = np.ones(self.size, bool)
        keep[picked] = False
        kept = self.slots[keep]
        self._slots[: len(kept)], self.size = kept, len(kept)
        self.free[self.free_count : self.free_count + len(at)] = at
        self.free_count += len(at)
        return out

    def load(self, ids: np.ndarray) -> None:
        """The rows of a resumed buffer, by id and in that order, one chunk read at a time."""
        if not len(ids):
            return
        sources = self.stream.sources
        groups: dict[tuple[int, int], list[int]] = {}
        for n, (i, r) in enumerate(ids.tolist()):
            groups.setdefault((i, r // sources[i].chunk), []).append(n)
        start = self.size
        for (i, _), members in groups.items():
            rows = ids[members, 1]
            self.add(i, int(rows.min()), int(rows.max()) + 1, rows)
        placed = np.concatenate([np.asarray(m) for m in groups.values()])
        back = np.empty_like(placed)
        back[placed] = np.arange(len(placed))  # held order, as the state gave it
        self.slots[start:] = self.slots[start:][back]


class BatchPool:
    """Batch arrays reused once nothing holds them: a tensor made by torch.from_numpy (and every
    view of it) keeps its array referenced, so an array only the pool refers to is free. A fresh
    batch array costs its page faults at every batch (glibc hands large blocks back to the
    system), more than the gather itself; a reused one, none."""

    KEEP = 2  # arrays kept per shape: the batch the consumer holds and the next one

    def __init__(self):
        self.arrays: list[np.ndarray] = []

    def gather(self, source: np.ndarray, at: np.ndarray) -> np.ndarray:
        """source[at] in a free pooled array (or a new one, pooled while there is room)."""
        shape = (len(at), *source.shape[1:])
        dest = next(
            (a for a in self.arrays if a.shape == shape and a.dtype == source.dtype
             and sys.getrefcount(a) <= 3),  # (the list, `a` and getrefcount's argument)
            None,
        )  # fmt: skip
        if dest is None:
            dest = np.empty(shape, source.dtype)
            if sum(a.shape == shape for a in self.arrays) < self.KEEP:
                self.arrays.append(dest)
        torch.index_select(
            torch.from_numpy(source), 0, torch.from_numpy(at), out=torch.from_numpy(dest)
        )
        return dest


def _uncached(f, name: str):
    """The dataset opened without a chunk cache: whole-chunk reads go straight into the buffer
    (no second copy of a chunk in memory)."""
    dapl = h5py.h5p.create(h5py.h5p.DATASET_ACCESS)
    dapl.set_chunk_cache(0, 0, 1.0)
    return h5py.Dataset(h5py.h5d.open(f.id, name.encode(), dapl=dapl))


def sources_of(run, layer: str, site: str, pair: tuple[str, str] | None = None) -> list[Source]:
    """The Source of one (layer, site) of an open Run: its valid rows (what /progress counts,
    less the coverage gaps), its chunking, and its labels and index datasets; with `pair`, a
    second (layer, site) of the same rows (its valid rows too)."""
    from probe.store.coverage import seen_ranges
    from probe.store.fileformat import is_per_batch, layer_path

    f, name = run.file, layer_path(layer, site)
    for lay, sit in ((layer, site), *([pair] if pair else [])):
        if layer_path(lay, sit) not in f:
            raise KeyError(
                f"no stored rows of {lay!r} {sit!r} in {run.h5_path}; run.keys lists them"
            )
    ds = f[name]
    tokens = ds.attrs.get("row_unit") == "tokens"
    if is_per_batch(ds.attrs, site):
        valid = run.num_batches
    else:
        valid = run.num_tokens if tokens else run.num_samples
    valid = min(valid, len(ds))
    row_bytes = int(np.prod(ds.shape[1:], dtype=np.int64)) * ds.dtype.itemsize
    chunk = ds.chunks[0] if ds.chunks else max(1, (1 << 20) // max(row_bytes, 1))
    if tokens:
        labels = "tokens/label" if "tokens/label" in f else None
        index = {"sample": "tokens/sample", "position": "tokens/position", "token": "tokens/id"}
    else:
        labels = "samples/target" if "samples/target" in f else None
        index = {"sample": "samples/index"}
    ranges = seen_ranges(f, layer, site, valid)
    source = Source(str(run.h5_path), name, ranges, chunk, labels, index, row_bytes,
                    tuple(ds.shape[1:]))  # fmt: skip
    if pair is None:
        return [source]
    other = f[layer_path(*pair)]
    unit = lambda d: d.attrs.get("row_unit")  # noqa: E731
    if unit(other) != unit(ds) or is_per_batch(other.attrs, pair[1]) != is_per_batch(
        ds.attrs, site
    ):
        raise DataError(
            f"{pair[0]!r} {pair[1]!r} has rows of {unit(other) or 'samples'} but {layer!r} "
            f"{site!r} of {unit(ds) or 'samples'}: pair two sites of the same probe's rows"
        )
    both = _intersect(ranges, seen_ranges(f, *pair, min(valid, len(other))))
    paired_bytes = int(np.prod(other.shape[1:], dtype=np.int64)) * other.dtype.itemsize
    return [replace(source, ranges=both, paired=layer_path(*pair), row_bytes=row_bytes + paired_bytes,
                    paired_shape=tuple(other.shape[1:]))]  # fmt: skip


def _intersect(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The rows in both lists of [start, stop) ranges."""
    out = [(max(x0, y0), min(x1, y1)) for x0, x1 in a for y0, y1 in b]
    return sorted((lo, hi) for lo, hi in out if hi > lo)
