"""What the statistics and top-k run parts keep of the written batches, on the sink's side
(probe.store.sink's `Fold`): each capture's running statistics (`StatsFold`, /stats) and its
examples per unit (`ExamplesFold`, /topk), folded from each batch's partials as the batch is
written, published in the slot the file's /progress points at, restored when a stopped run
resumes, and computed from the stored rows where the run asks for it (`stats.during=close`) or
the file holds no statistics that agree with its rows.

The partials come from the parts (probe.launch.parts.statistics, .topk_examples), which reduce
each capture on its own device; a fold only merges what it is given (the partials of a batch's
sites reduced on a device together: probe.stats.device_sketch.fold_all). A sketch and units
merged on a device come to the host when their slot is published.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from probe.errors import DataError
from probe.hooks.batch_topk import POSITION_BITS, partial, stored_keys
from probe.hooks.record import Record
from probe.stats import backend
from probe.stats.device_sketch import SiteBatch, fetch_all, fold_all
from probe.stats.running import RunningStats, occupied_buckets, stats_for
from probe.stats.topk import TopKSpec, TopKState
from probe.store import stats_file, topk_file
from probe.store.coverage import seen_ranges
from probe.store.fileformat import encode
from probe.store.sparse_rows import stored_rows
from probe.store.stats_file import BUCKET_TYPE, HIST_CHUNK, DatasetInfo

Key = tuple[str, str]
SUMMARY_ROW_BYTES = 1 << 10  # summary.csv and units.csv: generous bytes per (layer, site)


def _stats_path(key: Key) -> str:
    return f"stats/{encode(key[0])}/{encode(key[1])}"


def _captures(record: Record) -> Iterator[Key]:
    """The keys of `record`'s captures that take statistics, in the order they are written."""
    for key in [*record.values, *record.per_batch]:
        if key not in record.plain:
            yield key


class StatsFold:
    """Each capture's running statistics: folded batch by batch (`stats.during=run`), or computed
    from its stored rows at the end (`close`)."""

    name = "statistics"  # (the run part whose partials it folds)

    def __init__(self, during: str) -> None:
        self.during = during
        self.started: set[Key] = set()  # captures whose statistics exist
        self.hist_capacity: dict[Key, int] = {}  # /stats histogram buckets per slot

    def restore(self, sink) -> None:
        """From the published slot where it covers the kept rows, else from the rows."""
        f, rows = sink.file, sink.rows
        saved = stats_file.read(f)
        slots = "progress" in f  # whole by construction: published with the counts
        for key, info in rows.datasets.items():
            self.started.add(key)
            hist = f.get(f"{_stats_path(key)}/hist")
            self.hist_capacity[key] = hist.shape[-1] if hist is not None else 0
            if self.during != "run":  # computed at close from every row, or not at all
                continue
            stored, valid = saved.get(key), rows.valid(info)
            unseen = sum(b - a for a, b in rows.coverage.gaps.get(key, []))
            if stored is not None and (slots or stored.stats.rows == valid - unseen):
                info.stats, info.shape, info.dtype = stored.stats, stored.shape, stored.dtype
                continue
            if stored_rows(f, *key) is None:
                raise DataError(
                    f"{str(sink.path)!r} holds no statistics for the {valid} rows of {key[0]} "
                    f"{key[1]} that agree with each other, and no stored rows to recompute them "
                    "from (a store.mode=stats run killed while it rewrote them); start a new run "
                    "without resume=true"
                )
            self._from_rows(sink, key, info, valid)

    def fold(self, sink, record: Record) -> None:
        rows = sink.rows
        partials = record.outputs.folds.get(self.name, {})
        keys = list(_captures(record))
        on_device: list[tuple[RunningStats, SiteBatch]] = []  # (merged together: fold_all)
        for key in keys:
            info = rows.datasets[key]
            if key not in self.started:
                info.stats = stats_for(info.module_type, key[1], info.unit_axis)
                self.started.add(key)
            if self.during != "run":
                continue
            partial = partials.get(key)
            if isinstance(partial, SiteBatch):
                on_device.append((info.stats, partial))
            elif partial is not None:
                info.stats.merge(partial)
        fold_all(on_device)
        if self.during != "run":
            return
        for key in keys:
            path = _stats_path(key)
            if path not in rows.known:  # (its first batch: the units are known now)
                stats_file.create(sink.file, rows.datasets[key], rows.orders[key])
                rows.known.add(path)

    def publish(self, sink, slot: int) -> None:
        rows = sink.rows
        missing = [key for key in rows.datasets if _stats_path(key) not in rows.known]
        if missing:
            sink._creating()
        for key in missing:
            stats_file.create(sink.file, rows.datasets[key], rows.orders[key])
            rows.known.add(_stats_path(key))
        fetch_all(info.stats for info in rows.datasets.values())  # (sketches on a device)
        capacity = stats_file.write_slot(sink.file, rows.datasets.values(), slot)
        self.hist_capacity.update(capacity)

    def close(self, sink) -> None:
        if self.during == "close":
            for key, info in sink.rows.datasets.items():
                self._from_rows(sink, key, info, sink.rows.valid(info))

    def _from_rows(self, sink, key: Key, info: DatasetInfo, valid: int) -> None:
        """`info.stats` from the first `valid` stored rows, folded batch by batch as the run
        would have."""
        info.stats = stats_for(info.module_type, key[1], info.unit_axis)
        for _, block in stored_blocks(sink, key, info, valid):
            backend.fold(info.stats, block)

    def batch_bytes(self, record: Record) -> int:
        """Buckets this batch may add to a slot, in both slots."""
        partials = record.outputs.folds.get(self.name, {})
        return sum(2 * occupied_buckets(p) * BUCKET_TYPE.itemsize for p in partials.values())

    def closing_bytes(self, sink) -> int:
        """Each /stats group's histogram growing to the buckets its statistics occupy (both
        slots), every unit's row of the summary tables."""
        need = 0
        for key, info in sink.rows.datasets.items():
            buckets = -(-occupied_buckets(info.stats) // HIST_CHUNK) * HIST_CHUNK
            have = self.hist_capacity.get(key, 0)
            need += 2 * max(0, buckets - have) * BUCKET_TYPE.itemsize
            units = 0 if info.stats.units is None else info.stats.units.width
            need += SUMMARY_ROW_BYTES + units * 64
        return need


class ExamplesFold:
    """Each capture's examples per unit (`stats.topk`, `stats.bottomk`, `stats.topk_quantiles`),
    kept beside its statistics in the same slots."""

    name = "topk_examples"  # (the run part whose partials it folds)

    def __init__(self, spec: TopKSpec, during: str) -> None:
        self.spec, self.during = spec, during

    def restore(self, sink) -> None:
        f, rows = sink.file, sink.rows
        rows.known.update(p for p in (topk_file.path(*key) for key in rows.datasets) if p in f)
        if self.during != "run":
            return
        saved = stats_file.read(f)
        slots = "progress" in f
        for key, info in rows.datasets.items():
            stored, valid = saved.get(key), rows.valid(info)
            unseen = sum(b - a for a, b in rows.coverage.gaps.get(key, []))
            if stored is not None and (slots or stored.stats.rows == valid - unseen):
                info.topk = stored.topk
            elif not info.per_batch and stored_rows(f, *key) is not None:
                self._from_rows(sink, key, info, valid)

    def fold(self, sink, record: Record) -> None:
        if self.during != "run":
            return
        datasets = sink.rows.datasets
        for key, kinds in record.outputs.folds.get(self.name, {}).items():
            info = datasets[key]
            if info.topk is None:
                info.topk = TopKState(self.spec)
            info.topk.merge(kinds.arrays())
            if topk_file.path(*key) not in sink.rows.known:
                topk_file.create(sink.file, key[0], key[1], info.topk)
                sink.rows.known.add(topk_file.path(*key))

    def publish(self, sink, slot: int) -> None:
        f = sink.file
        for key, info in sink.rows.datasets.items():
            if info.topk is None or not info.topk.kinds:
                continue
            if topk_file.path(*key) not in sink.rows.known:  # (a resumed file's new capture)
                sink._creating()
                f = sink.file
                topk_file.create(f, key[0], key[1], info.topk)
                sink.rows.known.add(topk_file.path(*key))
            topk_file.write(f, key[0], key[1], info.topk, slot)

    def close(self, sink) -> None:
        if self.during != "close":
            return
        for key, info in sink.rows.datasets.items():
            if not info.per_batch:
                self._from_rows(sink, key, info, sink.rows.valid(info))

    def _from_rows(self, sink, key: Key, info: DatasetInfo, valid: int) -> None:
        """`info.topk` from the first `valid` stored rows, their keys from /samples/index or
        /tokens/* (a capture of token positions per sample cannot tell its padding apart: rows:
        tokens can)."""
        f, axis = sink.file, info.unit_axis
        info.topk = TopKState(self.spec)
        for lo, block in stored_blocks(sink, key, info, valid):
            n = len(block)
            if info.rows == "tokens":
                inner = int(np.prod(block.shape[1:], dtype=np.int64)) // block.shape[axis]
                sample = f["tokens/sample"][lo : lo + n].astype(np.int64)
                base = sample * (1 << POSITION_BITS) + f["tokens/position"][lo : lo + n] * inner
            else:
                base = f["samples/index"][lo : lo + n].astype(np.int64) * (1 << POSITION_BITS)
            found = stored_keys(torch.from_numpy(block), axis, torch.from_numpy(base))
            kinds = partial(*found, self.spec)
            info.topk.merge({kind: (v.numpy(), k.numpy()) for kind, (v, k) in kinds.items()})

    def batch_bytes(self, record: Record) -> int:
        return 0

    def closing_bytes(self, sink) -> int:
        return 0


def stored_blocks(
    sink, key: Key, info: DatasetInfo, valid: int
) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, rows) of each batch's stored rows of `key` below `valid`, the rows its
    module did not produce left out; sets `info`'s shape and dtype from the dataset."""
    ds = stored_rows(sink.file, *key)
    seen = seen_ranges(sink.file, key[0], key[1], min(valid, len(ds)))
    for lo, hi in _batch_rows(sink, info, valid):
        for a, b in seen:
            if max(lo, a) < min(hi, b):
                yield max(lo, a), ds[max(lo, a) : min(hi, b)]
    info.shape, info.dtype = tuple(ds.shape[1:]), str(ds.dtype)


def _batch_rows(sink, info: DatasetInfo, rows: int) -> list[tuple[int, int]]:
    """The [lo, hi) rows of each batch: the statistics merge batch by batch, as the run did."""
    batch_rows = sink.batch_rows
    if info.per_batch:
        return [(b, b + 1) for b in range(rows)]
    if info.rows != "tokens":
        return [(lo, min(lo + batch_rows, rows)) for lo in range(0, rows, batch_rows)]
    samples = sink.file["tokens/sample"][:rows] - sink.rows.first_sample
    edges = np.searchsorted(samples, np.arange(0, sink.rows.num_samples + batch_rows, batch_rows))
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:], strict=True) if b > a]
