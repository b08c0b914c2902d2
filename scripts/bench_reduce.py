"""One captured tensor reduced to its statistics: ATen operations and time, the torch backend's
reference path against its fused reduction, side by side in one process.

    python scripts/bench_reduce.py [--device cpu|cuda] [--rounds 7] [--batch 64]

Tensors: the 20 convolution outputs of resnet18 at 64 px (random init, one batch of random
images), summed per shape, and a (batch, 128, 256) token tensor with its units last. Per tensor:
the operations each path dispatches (a TorchDispatchMode counter: the reduction on the device,
not reading its result back; the reference counted on its host path and on the path it takes off
the host, branch-free), and the median over interleaved rounds of the time to reduce it and read
the statistics on the host (`torch_backend.batch_stats` with the path forced). On CUDA also the
host's time to queue the reduction alone, what a hook in a training step waits for.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import bench_common as bc  # first: it puts the repository root on sys.path
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from probe.hooks.hookset import HookSet
from probe.stats import torch_backend as torch_stats


class Dispatched(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def resnet_outputs(batch: int, device: str) -> dict[str, torch.Tensor]:
    """Each distinct shape of resnet18's convolution outputs at 64 px, with how many convolutions
    give it (name -> tensor; its count in the name)."""
    from torchvision.models import resnet18

    model = resnet18().eval().to(device)
    seen: dict[tuple, list[torch.Tensor]] = {}

    def keep(module, args, out):
        seen.setdefault(tuple(out.shape), []).append(out.clone())

    hooks = HookSet("bench")
    images = torch.randn(batch, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with hooks, torch.inference_mode():
        for name, m in model.named_modules():
            if isinstance(m, torch.nn.Conv2d):
                hooks.forward(m, keep, name=name)
        model(images.to(device))
    return {f"conv {tuple(s)} x{len(v)}": v[0] for s, v in seen.items()}


def counted(fn) -> int:
    fn()  # (constants made once per kind of batch)
    with Dispatched() as mode:
        fn()
    return mode.count


def forced(name: str, fn):
    def run():
        torch_stats.use_reduction(name)
        try:
            return fn()
        finally:
            torch_stats.use_reduction(None)

    return run


def off_host(fn):
    """fn on the reference's branch-free path, the one it takes on a GPU (run on the CPU)."""

    def run():
        host = torch_stats._host
        torch_stats._host = lambda device: False
        try:
            return fn()
        finally:
            torch_stats._host = host

    return run


def median_ms(fn, rounds: int, sync: bool) -> float:
    times = []
    for _ in range(rounds):
        if sync:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--batch", type=int, default=64)
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    tensors = resnet_outputs(args.batch, args.device)
    with torch.inference_mode():
        tensors[f"tokens ({args.batch}, 128, 256)"] = torch.randn(
            args.batch, 128, 256, device=args.device
        )
    rows = []
    for name, x in tensors.items():
        axis = -1 if name.startswith("tokens") else 1

        def on_device(x=x, axis=axis):
            return torch_stats.on_device(x, None, axis)

        def stats(x=x, axis=axis):
            return torch_stats.batch_stats(x, None, axis)

        with torch.inference_mode():
            ref_host = counted(forced("reference", on_device)) if not cuda else None
            ref_off = counted(forced("reference", on_device if cuda else off_host(on_device)))
            fused_ops = counted(forced("fused", on_device))
            variants = {"reference": forced("reference", stats), "fused": forced("fused", stats)}
            if cuda:
                variants["reference queued"] = forced("reference", on_device)
                variants["fused queued"] = forced("fused", on_device)
            for fn in variants.values():
                fn()
            times = {k: [] for k in variants}
            for _ in range(args.rounds):  # interleaved: load changes hit every variant
                for k, fn in variants.items():
                    times[k].append(median_ms(fn, 1, cuda and "queued" not in k))
        t = {k: statistics.median(v) for k, v in times.items()}
        row = [name, x.numel(), ref_host, ref_off, fused_ops, f"{t['reference']:.2f}",
               f"{t['fused']:.2f}", f"{t['fused'] / t['reference']:.2f}"]  # fmt: skip
        if cuda:
            row += [f"{t['reference queued']:.3f}", f"{t['fused queued']:.3f}"]
        rows.append(row)
        print(*row, sep="\t", flush=True)
    cols = ["tensor", "values", "ops ref (host)", "ops ref (off host)", "ops fused",
            "ms ref", "ms fused", "fused / ref"]  # fmt: skip
    if cuda:
        cols += ["ms queued ref", "ms queued fused"]
    threads = torch.get_num_threads()
    print(f"\n{args.device}, torch {torch.__version__}, {threads} threads, median of {args.rounds}")
    print("\n".join(bc.table_lines(cols, rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
