"""Peak RSS of `python -m probe` at N and FACTOR x N samples, and of the same loop with no hooks.

    python scripts/bench_memory.py                    # N=100, 4N; resnet18 all convs, batch 16, 112x112
    python scripts/bench_memory.py --n 100 --factor 10

Each run is a fresh `python -m probe` subprocess; its peak RSS comes from wait4(). Memory stays flat
when the 4N run peaks within 10% of the N run. The writer's queue bound is what full capture may add
over the no-hook loop: (store.queue_batches + 2) batches of captures (one filling in the hooks, the
queued ones, one being written).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
from bench_common import ROOT  # the repository root, put on sys.path there


def run_probe(run_dir: Path, *overrides: str) -> tuple[float, float]:
    """(peak RSS in MB, wall seconds) of one `python -m probe` subprocess."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "probe", f"hydra.run.dir={run_dir}", "progress=false"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [*cmd, "print_summary=false", *overrides],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status):
        sys.exit(f"python -m probe {' '.join(overrides)} failed:\n{proc.stderr.read().decode()}")
    return usage.ru_maxrss / 1024, seconds


def batch_capture_mb(h5_path: Path, batch: int) -> float:
    """Bytes of one batch of captures, from the per-sample row sizes in the file."""
    total = 0
    with h5py.File(h5_path, "r") as f:

        def add(name, obj):
            nonlocal total
            if isinstance(obj, h5py.Dataset) and name.startswith("layers/"):
                total += obj.dtype.itemsize * int(obj[0].size if obj.ndim > 1 else 1)

        f.visititems(add)
    return total * batch / 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--n", type=int, default=100)
    p.add_argument("--factor", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--image-size", type=int, default=112)
    p.add_argument("--probe-name", default="convs", help="the probe in probes=all_convs")
    p.add_argument("--queue-batches", type=int, default=2)
    args = p.parse_args()
    common = [
        "model=resnet18",
        "probes=all_convs",
        f"dataset.batch_size={args.batch}",
        f"dataset.image_size={args.image_size}",
        f"store.queue_batches={args.queue_batches}",
    ]
    no_hooks = [
        f"probes.{args.probe_name}.types=[Conv3d]",  # none in resnet18: the loop without hooks
        f"probes.{args.probe_name}.allow_empty=true",
    ]
    with tempfile.TemporaryDirectory(prefix="probe-mem-") as tmp:
        rows = []
        for label, n, extra in [
            ("no hooks", args.n, no_hooks),
            ("full capture", args.n, []),
            ("full capture", args.n * args.factor, []),
        ]:
            run_dir = Path(tmp) / f"{label.replace(' ', '_')}_{n}"
            rss, seconds = run_probe(run_dir, *common, f"dataset.num_samples={n}", *extra)
            size = (run_dir / "probe.h5").stat().st_size / 1e6
            rows.append((label, n, rss, seconds, size))
            if label == "full capture" and n == args.n:
                per_batch = batch_capture_mb(run_dir / "probe.h5", args.batch)
        print(f"{'run':<14}{'samples':>8}{'peak RSS MB':>13}{'seconds':>9}{'file MB':>9}")
        for label, n, rss, seconds, size in rows:
            print(f"{label:<14}{n:>8}{rss:>13.0f}{seconds:>9.1f}{size:>9.0f}")
        base, small, big = rows[0][2], rows[1][2], rows[2][2]
        bound = (args.queue_batches + 2) * per_batch
        print(f"ratio peak RSS {args.factor}N / N: {big / small:.3f} (target <= 1.10)")
        print(
            f"full capture - no hooks: {small - base:.0f} MB; queue bound "
            f"(queue_batches + 2) x {per_batch:.1f} MB per batch = {bound:.0f} MB"
        )


if __name__ == "__main__":
    main()
