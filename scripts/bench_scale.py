"""Scale benchmark: 2-process torchrun against 1 process, for a stats-only and a full-capture run,
and the projected file size (logged before the run) against the real one.

    python scripts/bench_scale.py [--samples 255] [--image-size 64] [--batch-size 16] [--repeat 3]

All runs happen here, side by side and interleaved, on the same config; each figure is the best
of `--repeat` runs (the machine may be shared). The single process gets every core
(OMP_NUM_THREADS=cores), each of the two ranks half of them. `wall` is the whole command
(interpreter start, model build, run); `loop` is from the plan to the last write (rank 0's log).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from bench_common import ROOT  # the repository root, put on sys.path there

STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]")


def run(command: list[str], run_dir: Path, threads: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
    start = time.perf_counter()
    out = subprocess.run(
        [*command, f"hydra.run.dir={run_dir}"], env=env, capture_output=True, text=True
    )
    wall = time.perf_counter() - start
    if out.returncode:
        sys.exit(f"{' '.join(command)} failed:\n{out.stderr[-3000:]}")
    log = [ln for ln in (run_dir / "probe.log").read_text().splitlines() if "[rank 1]" not in ln]
    plan = next(ln for ln in log if "projected" in ln)
    wrote = next(ln for ln in log if "- wrote " in ln or "] wrote " in ln)
    return {
        "wall": wall,
        "loop": _stamp(wrote) - _stamp(plan),
        "projected": int(re.search(r"\((\d+) bytes\)", plan).group(1)),
        "real": sum(p.stat().st_size for p in run_dir.glob("*.h5")),
    }


def _stamp(line: str) -> float:
    return datetime.strptime(STAMP.match(line).group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=255)
    ap.add_argument("--image-size", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    cores = os.cpu_count() or 2
    config = [
        f"model={args.model}",
        "probes=all_convs",
        f"dataset.num_samples={args.samples}",
        f"dataset.image_size={args.image_size}",
        f"dataset.batch_size={args.batch_size}",
        "print_summary=false",
        "progress=false",
    ]
    one = [sys.executable, "-m", "probe"]
    two = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    two += ["-m", "probe"]
    print(
        f"{args.model}, all_convs, {args.samples} samples of {args.image_size} px, batch "
        f"{args.batch_size}, {cores} cores"
    )
    print(
        f"{'store':6} {'procs':>5} {'wall s':>7} {'loop s':>7} {'projected B':>13} {'real B':>13} "
        f"{'proj/real':>9}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        runs: dict[tuple[str, int], list[dict]] = {}
        for attempt in range(args.repeat):
            for store in ("stats", "full"):
                for procs, command in ((1, one), (2, two)):
                    run_dir = Path(tmp) / f"{store}-{procs}-{attempt}"
                    r = run([*command, *config, f"store={store}"], run_dir, max(1, cores // procs))
                    runs.setdefault((store, procs), []).append(r)
                    for p in run_dir.glob("*.h5"):
                        p.unlink()  # keep the disk use to one run at a time
    best = {}
    for (store, procs), rs in runs.items():
        r = best[store, procs] = {
            "wall": min(x["wall"] for x in rs),
            "loop": min(x["loop"] for x in rs),
            "projected": rs[0]["projected"],
            "real": rs[0]["real"],
        }
        print(
            f"{store:6} {procs:5d} {r['wall']:7.2f} {r['loop']:7.2f} {r['projected']:13d} "
            f"{r['real']:13d} {r['projected'] / r['real']:9.3f}"
        )
    for store in ("stats", "full"):
        a, b = best[store, 2], best[store, 1]
        print(
            f"{store}: torchrun 2 procs / 1 proc wall-time ratio {a['wall'] / b['wall']:.2f} "
            f"(loop only {a['loop'] / b['loop']:.2f})"
        )


if __name__ == "__main__":
    main()
