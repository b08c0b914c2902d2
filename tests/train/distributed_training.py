"""A small watched training over ranks, and the one-process training it must equal.

    python -m tests.train.distributed_training single OUT       # one process
    torchrun --nproc_per_node=2 -m tests.train.distributed_training ddp OUT
    torchrun --nproc_per_node=2 -m tests.train.distributed_training fsdp OUT

An MLP (widths 7 and 5: uneven shards over 2 ranks) trains 3 steps with SGD and momentum on
seeded global batches of 8 rows. Under torchrun rank r trains on rows [4r, 4r + 4) of each
batch, its model wrapped in DistributedDataParallel or sharded with FSDP2's fully_shard (on the
CPU, gloo). The one process takes the same two halves as micro-batches and averages their
gradients before the step, as DDP's all-reduce does. Every run writes its watch into OUT/watch
and its final parameters into OUT/final.pt; under FSDP rank 0 also writes OUT/fsdp1.txt, the
error a watch of parameter sites gives on an FSDP1-wrapped model, and each rank OUT/early<rank>.txt,
the error of a watch made before sharding and started after.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import probe
from probe.errors import ConfigError
from probe.testing.trainings import EVERY_SITE

PROBES = {"all": {"layers": ["*"], "types": ["Linear", "Tanh"], "capture": EVERY_SITE}}
STEPS, ROWS, WORLD = 3, 8, 2


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(ROWS, 6, generator=g), torch.randint(0, 3, (ROWS,), generator=g))
            for _ in range(STEPS)]  # fmt: skip


def halves(x: torch.Tensor) -> list[torch.Tensor]:
    return list(x.chunk(WORLD))


def single(out: Path) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with probe.watch(model, PROBES, out=out / "watch", optimizer=opt) as w:
        for x, y in batches():
            opt.zero_grad()
            for xh, yh in zip(halves(x), halves(y), strict=True):
                loss = F.cross_entropy(model(xh), yh)
                loss.backward()
                w.loss(loss)
            for p in model.parameters():
                p.grad /= WORLD
            opt.step()
    torch.save({k: v.detach() for k, v in model.state_dict().items()}, out / "final.pt")


def ranks(mode: str, out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    net = mlp()
    if mode == "ddp":
        model = nn.parallel.DistributedDataParallel(net)
    else:
        from torch.distributed.fsdp import fully_shard

        if rank == 0:
            (out / "fsdp1.txt").write_text(fsdp1_refusal())
        early = probe.watch(net, PROBES, out=out / "early")  # made before sharding
        for layer in net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        model = fully_shard(net)
        try:
            early.start()
        except ConfigError as e:
            (out / f"early{rank}.txt").write_text(str(e))
        try:  # rank 0 alone would evaluate it, and a sharded forward needs every rank
            probe.watch(model, PROBES, out=out / "probed", probe_batch=torch.randn(2, 6))
        except ConfigError as e:
            (out / f"probe_batch{rank}.txt").write_text(str(e))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with probe.watch(model, PROBES, out=out / "watch", optimizer=opt) as w:
        for x, y in batches():
            opt.zero_grad()
            loss = F.cross_entropy(model(halves(x)[rank]), halves(y)[rank])
            loss.backward()
            w.loss(loss)
            opt.step()
    final = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
             for k, v in net.state_dict().items()}  # fmt: skip
    if rank == 0:
        torch.save({k.removeprefix("module."): v.detach() for k, v in final.items()},
                   out / "final.pt")  # fmt: skip
    dist.destroy_process_group()


def fsdp1_refusal() -> str:
    from torch.distributed.fsdp import FullyShardedDataParallel

    wrapped = FullyShardedDataParallel(mlp(), device_id=torch.device("cpu"))
    try:
        probe.watch(wrapped, PROBES, out="unused")
    except ConfigError as e:
        return str(e)
    return "no error"


if __name__ == "__main__":
    torch.set_num_threads(1)
    mode, out = sys.argv[1], Path(sys.argv[2])
    single(out) if mode == "single" else ranks(mode, out)
