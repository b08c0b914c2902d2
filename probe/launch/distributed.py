"""Data-parallel extraction under torchrun: every rank probes one contiguous block of whole
batches into its own shard file, and rank 0 stitches the shards into one file.

Shards are cut at batch boundaries, so each rank sees exactly the batches a single process would
(same rows, same per-batch parameter gradients, same short last batch) and the stitched file
equals a one-process run. The process group is only used for small messages (the run directory,
barriers, a circuit's edge sums: `gathered`); captures never travel between ranks. Backends:
gloo on CPU, nccl for CUDA tensors.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, Subset

from probe.data.batches import OrderedBatches, RunBatches
from probe.errors import ConfigError
from probe.store.groups import GroupKind
from probe.store.stitch import stitch

log = logging.getLogger("probe")


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def active() -> bool:
    """True in a process that torchrun started with more than one rank."""
    return world_size() > 1


def init() -> None:
    """Join the process group torchrun describes in the environment (once)."""
    if active() and not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend=backend)


def agree_run_dir(argv: list[str]) -> list[str]:
    """All ranks must write into one run directory: unless `hydra.run.dir` is given, rank 0's
    timestamped default is broadcast and appended to every rank's overrides."""
    if not active() or any(a.startswith("hydra.run.dir=") for a in argv):
        return argv
    init()
    chosen: list[str | None] = (
        [time.strftime("outputs/%Y-%m-%d/%H-%M-%S")] if dist.get_rank() == 0 else [None]
    )
    dist.broadcast_object_list(chosen, src=0)
    return [*argv, f"hydra.run.dir={chosen[0]}"]


def block(count: int, rank: int, world: int) -> range:
    """The rank-th of `world` contiguous, ordered blocks of range(count); the first ones are longer."""
    base, extra = divmod(count, world)
    lo = rank * base + min(rank, extra)
    return range(lo, lo + base + (rank < extra))


@dataclass(frozen=True)
class Shard:
    """This rank's part of the dataset: global batch and sample indices."""

    rank: int
    world: int
    batches: range
    samples: range
    dataset_samples: int
    blocks: tuple[int, ...]  # sample count of every rank's file

    def path(self, stitched: Path) -> Path:
        """Where this rank writes: the run file itself in a single process."""
        return stitched if self.world == 1 else shard_path(stitched, self.rank)

    def attrs(self) -> dict:
        if self.world == 1:
            return {}
        return {
            "rank": self.rank,
            "world_size": self.world,
            "shard_first_sample": self.samples.start,
        }

    def device(self, device: torch.device) -> torch.device:
        """`cuda` means this rank's GPU (LOCAL_RANK) under torchrun."""
        if device.type == "cuda" and device.index is None:
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return device


def shard_path(stitched: Path, rank: int) -> Path:
    """`probe.rank0.h5` next to `probe.h5`."""
    return stitched.with_name(f"{stitched.stem}.rank{rank}{stitched.suffix}")


def shard(batches: RunBatches) -> tuple[Shard, RunBatches]:
    """This rank's block of whole batches, as batches whose rows start at 0 (the writer offsets
    the sample index by `shard.samples.start`). A single process gets everything, unchanged."""
    if not active():  # (a caller's batches, `probe.launch.api`, may not know their count)
        n = batches.num_samples or 0
        return Shard(0, 1, range(n and len(batches)), range(n), n, (n,)), batches
    if not isinstance(batches, OrderedBatches):
        raise ConfigError(
            "probe.run over batches of your own runs in one process; under torchrun use the "
            "command line (python -m probe), whose dataset config each rank can split"
        )
    n, size = batches.num_samples, batches.batch_size
    init()
    rank, world = dist.get_rank(), dist.get_world_size()
    log.addFilter(_RankPrefix(rank))
    ranges = [block(len(batches), r, world) for r in range(world)]
    blocks = [range(min(b.start * size, n), min(b.stop * size, n)) for b in ranges]
    mine, samples = ranges[rank], blocks[rank]
    part = OrderedBatches(
        Subset(batches.dataset, samples),
        size,
        batches.loader.num_workers,
        batches.has_targets,
    )
    log.info(
        "this rank of %d: batches [%d, %d) and samples [%d, %d) of %d",
        world,
        mine.start,
        mine.stop,
        samples.start,
        samples.stop,
        n,
    )
    return Shard(rank, world, mine, samples, n, tuple(map(len, blocks))), part


def whole_dataset(batches: RunBatches) -> Dataset:
    """The whole dataset behind a torchrun rank's batches (`shard` gave them the rank's Subset
    of it)."""
    dataset = batches.dataset
    if not isinstance(dataset, Subset):
        raise RuntimeError("a torchrun rank's batches hold no Subset of the dataset")
    return dataset.dataset


def gathered(shard: Shard, value: object) -> list:
    """`value` of every rank, in rank order (a small, picklable one: a pass's sums); this
    rank's alone in a single process."""
    if shard.world == 1:
        return [value]
    out: list = [None] * shard.world
    dist.all_gather_object(out, value)
    return out


def finish(shard: Shard, stitched: Path, datasets: dict, after: Sequence[GroupKind | str] = ()):
    """The run's DatasetInfo records: in a single process the sink's own `datasets`; under
    torchrun, after every rank closed its shard, rank 0 stitches them into `stitched` (with what
    the run's parts wrote after the loop: `after`, probe.store.stitch) and returns the merged
    records while the other ranks return None. (A rank that failed never gets here: torchrun
    stops the others.)"""
    if shard.world == 1:
        return list(datasets.values())
    dist.barrier()
    merged = None
    if shard.rank == 0:
        merged = stitch(stitched, [shard_path(stitched, r) for r in range(shard.world)], after)
    dist.barrier()
    return merged


class _RankPrefix(logging.Filter):
    """`[rank 1] ...`: all ranks log into the same run directory."""

    def __init__(self, rank: int):
        super().__init__()
        self.prefix = f"[rank {rank}] "

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(self.prefix):
            record.msg = self.prefix + str(record.msg)
        return True
