"""How big a run will be, logged before anything is written: bytes per sample for each probe and
the projected size of the file(s) for the whole dataset.

The sizes come from the run's first batch (its real forward and backward through the same hooks),
so every site, reduction and storage dtype counts exactly. The projection follows the writer's
layout: whole chunks of `store.chunk_bytes` per dataset (HDF5 allocates the last chunk in full),
one file per rank, no compression (a compressed file is smaller). A stats-only file holds the
per-sample rows of /model/output (chunked by batch as in full mode), and per dataset its /stats: the histogram's
non-empty buckets (from those the first batch filled; later batches add a few, BUCKET_GROWTH)
and the per-unit arrays.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from dataclasses import dataclass

from probe.data.batches import RunBatches
from probe.hooks.record import Record
from probe.hooks.step_context import Partial
from probe.stats.backend import DeviceStats
from probe.stats.device_sketch import SiteBatch
from probe.stats.running import occupied_buckets
from probe.store.chunks import Chunking, allocated_bytes
from probe.store.folds import StatsFold
from probe.store.stats_file import BUCKET_TYPE, HIST_CHUNK, UNIT_TYPE

log = logging.getLogger("probe")

# Measured on HDF5 2.0 files of this writer (resnet18 all_convs): fixed costs besides the data.
FILE_OVERHEAD = 8 << 10  # superblock, root group, attributes (the resolved config)
STATS_OVERHEAD = 2900  # one /stats/<layer>/<site> group and its attributes
# Non-empty histogram buckets of a dataset whose first batch was not observed (a GPU run): after
# many samples resnet18's convs fill 3300-3900, each stored as an int64 index and count.
TYPICAL_BUCKETS = 4096
# Later samples fill a few more buckets: about 1 + 0.13 ln(samples / first batch's) times the
# first batch's (resnet18's convs, 7 to 1024 samples at 32-64 px).
BUCKET_GROWTH = 0.13
DATASET_OVERHEAD = 4600  # one chunked dataset's object header and chunk index


@dataclass
class SizePlan:
    per_sample: dict[str, int]  # probe name -> bytes per sample
    per_batch: int  # bytes per batch (parameter gradients)
    projected: int  # bytes of all files of the run

    @property
    def sample_bytes(self) -> int:
        return sum(self.per_sample.values())


def announce(record: Record, batches: RunBatches, selections, store, shard) -> SizePlan | None:
    """On rank 0, log the plan measured from the run's first batch, before it is written."""
    if shard.rank != 0:
        return None
    if record.ready is not None:
        record.ready.synchronize()
    known = batches.num_samples  # None: a caller's batches of unknown count (`probe.launch.api`)
    blocks = list(shard.blocks) if known else [record.size]
    result = estimate(record, selections, store, blocks, batches.batch_size)
    log_plan(result, shard.dataset_samples if known else None, shard.world, store)
    if record.ready is not None:
        log_transfer(record)
    return result


def log_transfer(record: Record) -> None:
    """What a GPU batch moves to the host: the captures' copies (full capture, or every
    capture when the statistics are reduced on the host) and the statistics' partials reduced
    on the device (without the sketches that stay there: probe.stats.device_sketch)."""
    captures = sum(t.nbytes for t in [*record.values.values(), *record.per_batch.values()])
    partials = record.outputs.folds.get(StatsFold.name, {}).values()  # the statistics' partials
    stats = sum(c.host_bytes for c in partials if isinstance(c, DeviceStats | SiteBatch))
    where = "on the GPU" if stats else "on the host"
    log.info(
        "plan: GPU -> host per batch: captures %s, statistics %s (statistics reduced %s)",
        human(captures),
        human(stats),
        where,
    )


def row_bytes(t) -> int:
    """Bytes of one row (a stats-only record holds empty slices: their shape is what counts)."""
    return t.element_size() * math.prod(t.shape[1:])


def estimate(record: Record, selections, store, blocks: list[int], batch_size: int) -> SizePlan:
    """Sizes from one record; `blocks` are the sample counts of the files (one per rank)."""
    probe_of = {s.name: s.probe for s in selections}
    by_token = {s.name for s in selections if s.rows == "tokens"}
    tokens = record.token_count / record.size  # token rows per sample (rows: tokens)
    per_sample: dict[str, int] = defaultdict(int)
    rows: list[tuple[int, str]] = []  # (bytes per row, a row per sample|batch|token) of datasets
    full = store.mode == "full"
    for (layer, _), t in record.values.items():
        row, kind = row_bytes(t), "token" if layer in by_token else "sample"
        per_sample[probe_of.get(layer, "?")] += int(row * tokens) if kind == "token" else row
        if full:
            rows.append((row, kind))
    per_batch = 0
    for t in record.per_batch.values():
        per_batch += row_bytes(t)
        if full:
            rows.append((row_bytes(t), "batch"))
    for t in record.outputs.samples.values():  # /model/output and, with edits, /model/output_clean
        rows.append((row_bytes(t), "sample"))
    if full:
        rows.append((8, "sample"))  # samples/index
        if record.targets is not None:
            rows.append((record.targets[0].element_size(), "sample"))
        if by_token and record.tokens is not None:  # /tokens/sample, position and id
            rows += [(a.itemsize, "token") for a in record.tokens.values()]
    captured = [*record.values.items(), *record.per_batch.items()]
    # the first batch's statistics read on the host (a GPU's are not copied yet: not read)
    counted = {
        key: p
        for key, p in record.outputs.folds.get("statistics", {}).items()
        if not isinstance(p, Partial)
    }

    def fixed(n: int) -> int:
        growth = 1 + BUCKET_GROWTH * math.log(max(n / record.size, 1))
        slots = 1 if full else 2  # a full run writes its statistics once, at its end
        stats = sum(stats_bytes(t, counted.get(key), growth, n, slots) for key, t in captured)
        return FILE_OVERHEAD + DATASET_OVERHEAD * len(rows) + stats

    projected = fixed(sum(blocks)) if len(blocks) > 1 else 0  # a torchrun job's stitched file
    for n in blocks:
        projected += fixed(n)
        layout = Chunking(store.chunk_bytes, store.compression != "none", n, batch_size)
        for row, kind in rows:
            count = {"batch": math.ceil(n / batch_size), "sample": n, "token": n * tokens}[kind]
            per_write = {"batch": 1, "sample": min(batch_size, n), "token": record.token_count}
            chunk = layout.rows(kind, per_write[kind], row)
            projected += allocated_bytes(0, math.ceil(count), row, chunk)
    return SizePlan(dict(per_sample), per_batch, projected)


def stats_bytes(t, first, growth: float, rows: int, slots: int = 2) -> int:
    """One dataset's /stats: its histogram's buckets, `growth` times those the first batch's
    statistics `first` filled, or when not observed yet (parameter gradients, a GPU run) at most
    TYPICAL_BUCKETS and the values of `rows` rows; and its per-unit arrays."""
    if first is not None:
        buckets = min(int(occupied_buckets(first) * growth), 1 << 16)
    else:
        buckets = min(TYPICAL_BUCKETS, rows * math.prod(t.shape[1:]))
    units = t.shape[1] if t.ndim > 1 else 0
    buckets = -(-buckets // HIST_CHUNK) * HIST_CHUNK  # the histogram grows by whole chunks
    hist = slots * BUCKET_TYPE.itemsize * buckets
    return STATS_OVERHEAD + hist + 2 * UNIT_TYPE.itemsize * units  # units: both slots, at once


def log_plan(plan: SizePlan, num_samples: int | None, world: int, store) -> None:
    for probe, size in plan.per_sample.items():
        log.info("plan: probe %-12s %s per sample", probe, human(size))
    if plan.per_batch:
        log.info("plan: parameter gradients %s per batch", human(plan.per_batch))
    if num_samples is None:
        log.info(
            "plan: %s per sample (the number of samples is not known)", human(plan.sample_bytes)
        )
        return
    files = f"{world} shard files" if world > 1 else store.filename
    note = "" if store.mode == "full" else " (store=stats: statistics only)"
    if store.mode == "full" and store.compression != "none":
        note = f" (uncompressed; {store.compression} makes it smaller)"
    log.info(
        "plan: %s per sample; projected %s for %d samples: %s (%d bytes)%s",
        human(plan.sample_bytes),
        files,
        num_samples,
        human(plan.projected),
        plan.projected,
        note,
    )


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")
