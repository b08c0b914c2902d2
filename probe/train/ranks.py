"""A watched training over several processes (DDP or FSDP2 under torchrun): each rank hooks its
own forward and backward, rank 0 merges every recorded step and writes the one file.

At each recorded step every rank sends rank 0 its step (a `gather_object`, one per step):

- activation sites (values and gradients of the ranks' batches) merge exactly over the ranks,
  in rank order, as a step's micro-batches do (`RunningStats.merge`: Chan et al. for the
  moments, added counts and fixed-bucket histograms);
- parameter sites of a replicated model (DDP: parameters, all-reduced gradients and updates
  are the same on every rank) are rank 0's, and the others send none;
- parameter sites of a sharded model (FSDP2's `fully_shard`: each rank holds rows of dim 0 of
  every parameter, `to_local()`) join their pieces: the counts, moments and histograms merge,
  the per-unit statistics (a parameter's units are its dim 0) are laid end to end in rank
  order, and the one row's L2 norm is the root of the pieces' squares;
- the loss is the mean of every rank's losses, the global grad norms the root of the ranks'
  squared norms where the model is sharded (rank 0's otherwise, and where the norm is the
  training's already: one a clip returned and the loop handed over), the rest rank 0's.

The FullyShardedDataParallel wrapper (FSDP1) flattens parameters, so parameter sites under it
are refused (`check_model`).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np
import torch.distributed as dist
from torch import nn

from probe.errors import ConfigError, ProbeError
from probe.site_keys import PARAM_SITES, family_of
from probe.stats.running import RunningStats, UnitStats
from probe.train.step_hooks import StepRecord, is_dtensor


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the initialized process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def check_model(model: nn.Module, specs) -> None:
    """Parameter sites need the model's own parameters: the FullyShardedDataParallel wrapper
    (FSDP1) replaces them by flat shards, so it is refused there."""
    wanted = [n for n, spec in specs.items()
              if any(family_of(str(c)) in PARAM_SITES for c in spec.capture)]  # fmt: skip
    if not wanted:
        return
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise ConfigError(
            f"the probes {', '.join(map(repr, wanted))} watch param, param_grad or "
            "param_update, and the model is wrapped in FullyShardedDataParallel (FSDP1), which "
            "flattens its parameters into shards the watch cannot name; shard it with FSDP2's "
            "torch.distributed.fsdp.fully_shard instead, or drop the parameter sites"
        )


def check_probe_batch(model: nn.Module, world: int) -> None:
    """A probe batch is evaluated by rank 0 alone: a sharded model (FSDP2's fully_shard, or the
    FSDP1 wrapper) needs every rank in each forward, so rank 0's would wait for the others."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    sharded = any(is_dtensor(p) for p in model.parameters())
    if world > 1 and (
        sharded or any(isinstance(m, FullyShardedDataParallel) for m in model.modules())
    ):
        raise ConfigError(
            "probe_batch is evaluated by rank 0 alone, and this model is sharded over the ranks "
            "(FSDP): its forward needs every rank, so rank 0 would wait for them forever; drop "
            "probe_batch under FSDP, or evaluate the batch in the training loop on every rank"
        )


def check_params_current(model: nn.Module, watched) -> None:
    """The watch reads the parameters it found when it was made: a model sharded (fully_shard)
    after that trains other ones."""
    current = {id(p) for p in model.parameters()}
    for w in watched:
        for params in w.params.values():
            for name, p in params.items():
                if id(p) not in current:
                    raise ConfigError(
                        f"layer {w.name!r} parameter {name!r} is no longer one of the model's: "
                        "the model's parameters were replaced after the watch was made (by "
                        "fully_shard?); make the watch after sharding the model"
                    )


def agree(failure: BaseException | None, rank: int, world: int) -> BaseException | None:
    """Every rank learns whether the others could start their watch (rank 0 opens the run
    directory): a rank's own failure, or a ProbeError naming the first other rank's."""
    said: list[str | None] = [None] * world  # each rank's failure, as a line
    dist.all_gather_object(
        said, None if failure is None else f"{type(failure).__name__}: {failure}"
    )
    if failure is not None:
        return failure
    for other, message in enumerate(said):
        if message is not None:
            return ProbeError(f"rank {other} could not start the watch ({message}); see its error")
    return None


class RankMerge:
    """The watcher's `merge_ranks` in a process group: rank 0 gets the training's StepRecord,
    the other ranks None (they write nothing)."""

    def __init__(self, model: nn.Module, rank: int, world: int):
        self.rank, self.world = rank, world
        self.sharded = any(is_dtensor(p) for p in model.parameters())

    def __call__(self, record: StepRecord) -> StepRecord | None:
        sent = {
            key: (record.infos[key], pack(s))
            for key, s in record.stats.items()
            if self.sharded or record.infos[key].kind != "parameter" or self.rank == 0
        }
        norms = {k: record.scalars.get(k) for k in ("grad_norm", "grad_norm_preclip")}
        mine = (sent, record.losses, norms)
        parts: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(mine, parts, dst=0)
        if parts is None:  # (a rank other than 0: rank 0 gathers)
            return None
        return self._merge(record, parts)

    def _merge(self, record: StepRecord, parts: list) -> StepRecord:
        by_key: dict = {}
        for sent, _, _ in parts:
            for key, item in sent.items():
                by_key.setdefault(key, []).append(item)
        stats, infos = {}, {}
        for key, items in by_key.items():
            info = items[0][0]
            pieces = [unpack(packed) for _, packed in items]
            if info.kind == "parameter" and self.sharded:
                stats[key] = join_shards(pieces)
                rows = sum(i.shape[1] for i, _ in items)
                infos[key] = replace(info, shape=(1, rows, *info.shape[2:]))
            else:
                merged = pieces[0]
                for piece in pieces[1:]:
                    merged.merge(piece)
                stats[key], infos[key] = merged, info
        scalars = dict(record.scalars)
        for name in ("grad_norm", "grad_norm_preclip"):
            norms = [n[name] for _, _, n in parts if n.get(name) is not None]
            if self.sharded and norms and name not in record.whole:  # (else rank 0's)
                scalars[name] = math.sqrt(sum(n * n for n in norms))
        losses = [x for _, ls, _ in parts for x in ls]
        return StepRecord(record.step, stats, infos, scalars, losses)


def pack(s: RunningStats) -> tuple:
    """RunningStats as a few small arrays (the histogram's occupied buckets only)."""
    arrays = s.arrays()
    return s.state()["state"], arrays["hist"], arrays.get("units"), s.unit_axis


def unpack(packed: tuple) -> RunningStats:
    state, hist, units, axis = packed
    arrays = {"hist": hist, **({"units": units} if units is not None else {})}
    return RunningStats.from_saved({"state": state, "unit_axis": axis}, arrays)


def join_shards(pieces: list[RunningStats]) -> RunningStats:
    """One parameter's statistics from its dim-0 pieces, each one row, in rank order."""
    out = RunningStats(unit_axis=pieces[0].unit_axis)
    units = [p.units for p in pieces if p.units is not None]
    for p in pieces:
        p.units = None
        out.merge(p)
    out.rows = 1
    out.l2_sum = math.sqrt(sum(p.l2_sum * p.l2_sum for p in pieces))
    if units:
        fields = ("count", "sum", "min", "max", "positive")
        out.units = UnitStats(*(np.concatenate([getattr(u, f) for u in units]) for f in fields))
    return out
