"""Quick check of the cost of a stats-only run against a plain forward over the same batches.

    python scripts/bench_stats_cost.py [--batches 6] [--batch-size 8] [--image-size 224] [--reps 2]

Both sides build the model and the batches the same way (resnet18, synthetic data); the stats side
is `probe.launch.run.run` with `probes=all_convs store=stats` (hooks, copies, streaming statistics, file).
Target: at most 1.15x.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import bench_common  # noqa: F401 - first: it puts the repository root on sys.path
import torch
from hydra import compose, initialize_config_dir

from probe.config import config_dir
from probe.data.batches import build_batches
from probe.launch.run import run
from probe.models.build import build_model
from probe.plan import parse


def plain(cfg) -> tuple[float, float]:
    """(wall seconds, CPU seconds of all threads)."""
    t, c = time.perf_counter(), time.process_time()
    model = build_model(parse(cfg).model, cfg.seed).eval()
    with torch.inference_mode():
        for batch in build_batches(parse(cfg).data, parse(cfg).model, cfg.seed):
            model(batch.inputs)
    return time.perf_counter() - t, time.process_time() - c


def stats_only(cfg) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        t, c = time.perf_counter(), time.process_time()
        run(cfg, run_dir=Path(tmp))
        return time.perf_counter() - t, time.process_time() - c


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    overrides = [
        "model=resnet18",
        "probes=all_convs",
        "store=stats",
        "print_summary=false",
        "progress=false",
        f"dataset.batch_size={args.batch_size}",
        f"dataset.num_samples={args.batch_size * args.batches}",
        f"dataset.image_size={args.image_size}",
    ]
    with initialize_config_dir(version_base="1.3", config_dir=config_dir()):
        cfg = compose("config", overrides=overrides)
    plain(cfg), stats_only(cfg)  # warm-up
    times = {"plain": [], "stats": []}
    for _ in range(args.reps):  # interleaved, so load changes hit both sides
        times["plain"].append(plain(cfg))
        times["stats"].append(stats_only(cfg))
    for i, kind in enumerate(("wall", "CPU (all threads; steadier on a shared machine)")):
        p = min(t[i] for t in times["plain"])  # the least disturbed repeat of each
        s = min(t[i] for t in times["stats"])
        print(f"{kind}: plain forward {p:.2f} s, stats-only run {s:.2f} s, ratio {s / p:.2f}x")
    print("target: stats-only at most 1.15x a plain forward")
    return 0


if __name__ == "__main__":
    sys.exit(main())
