"""The host's time to fold one batch of a run's device statistics into the running statistics:
resnet18's convolution outputs of one batch, reduced by the torch backend's fused reduction (a
GPU's), folded as the path before probe.stats.device_sketch folded them (each site's whole packed
batch unpacked on the host, its 65,536-bucket sketch merged there) and as it folds them now (the
batch's scalars and units' rows read on the host, the sketch added on its device: here the CPU,
so its add is timed apart).

    python scripts/bench_stats_fold.py                   # batch 16 at 112 px, 5 rounds
    python scripts/bench_stats_fold.py --batch 32 --image-size 224
"""

from __future__ import annotations

import argparse
import statistics
import time

import bench_common  # noqa: F401 - first: it puts the repository root on sys.path
import torch
import torchvision

from probe.stats import torch_backend
from probe.stats.backend import DeviceStats
from probe.stats.device_sketch import BatchSketches, DeviceHistogram
from probe.stats.running import RunningStats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--image-size", type=int, default=112)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch_backend.use_reduction("fused")
    model = torchvision.models.resnet18().eval()
    outs: dict[str, torch.Tensor] = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Conv2d):
            m.register_forward_hook(lambda m, a, o, n=name: outs.__setitem__(n, o.detach()))
    with torch.no_grad():
        model(torch.randn(args.batch, 3, args.image_size, args.image_size))
    packs = {n: torch_backend.on_device(x, None, 1) for n, x in outs.items()}

    old_running = {n: RunningStats() for n in outs}  # (kept over the rounds, as a run keeps them)
    new_running = {n: RunningStats() for n in outs}

    def before() -> float:
        running = old_running
        t = time.perf_counter()
        for n, (packed, read) in packs.items():
            running[n].merge(DeviceStats(packed, read))
        return time.perf_counter() - t

    def now() -> tuple[float, float]:
        running = new_running
        sketches = BatchSketches()
        for n, x in outs.items():
            sketches.add(n, x, None, 1)
        parts = sketches.settle()
        t = time.perf_counter()
        for n, part in parts.items():
            running[n].merge(part.host())
        rest = time.perf_counter() - t
        t = time.perf_counter()
        for n, part in parts.items():
            if part.hist is not None:
                sketch = DeviceHistogram.of(running[n], part.hist.device, part.stream)
                sketch.add(part.hist, part.buckets)
        return rest, time.perf_counter() - t

    before(), now()  # (the running statistics' first batch makes their histograms)
    rounds = [(before(), *now()) for _ in range(args.rounds)]
    old, rest, add = (statistics.median(r[i] for r in rounds) * 1e3 for i in range(3))
    print(f"resnet18, {len(outs)} convolutions, batch {args.batch} at {args.image_size} px, "
          f"median of {args.rounds} rounds, ms of host time a batch:")  # fmt: skip
    print(f"  before (whole packed batches, sketches merged on the host): {old:.1f}")
    print(f"  now: scalars and units' rows {rest:.1f}; sketches added on the device {add:.1f}")


if __name__ == "__main__":
    main()
