"""Benchmark: `python -m probe.fit`'s peak memory and rows per second, for one layer and for all
layers, at several sizes of a run: memory bounded in the number of rows (streamed, not a layer's
rows held).

    PYTHONPATH=. python scripts/bench_fit.py                  # 32, 256 and 1024 samples x 128
    PYTHONPATH=. python scripts/bench_fit.py --sizes 32,256,1024 --all-up-to 256 --out docs/bench/fit.md

The GPT-2-shaped model of the token benchmarks (6 blocks, width 256, seeded random), seeded random
ids; one capture per size (`probes=mlp_io`), then per size a fit of block 0 and (up to
`--all-up-to` samples) a fit of every block, each in a fresh process that runs probe.fit's `main` and reports its peak RSS above its
RSS once probe.fit, torch and the model's libraries are imported (VmHWM after clearing it), the
peak of its process tree's RSS (itself and any workers, sampled every 20 ms), its wall
seconds and the training rows it fitted (fit.csv). One pass over the training rows (`--epochs 1`)
at width 256, topk k 32: the rows are all read, the arithmetic kept small.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import bench_common as bc  # first: it puts the repository root on sys.path

POSITIONS = 128
FIT = ["--activation", "topk", "--k", "32", "--width", "256", "--epochs", "1"]


def tree_rss_mb(pid: int) -> float:
    """VmRSS of process `pid` and every process below it, in MB (0 for one that ended)."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return total


def child(argv: list[str]) -> None:
    """Run probe.fit's main on `argv` in this process; print one JSON line of its memory."""
    import threading

    import pandas as pd
    import torch  # noqa: F401  (imported before the baseline: its memory is not the fit's)

    import probe.analysis.fit.fitting  # noqa: F401
    from probe.fit import main

    start = bc.status_mb("VmRSS") or 0.0
    bc.reset_peak()
    tree_peak, done = [start], threading.Event()

    def sample() -> None:  # the process tree's RSS (workers, if the fit starts any)
        while not done.wait(0.02):
            tree_peak[0] = max(tree_peak[0], tree_rss_mb(os.getpid()))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    code = main(argv)
    wall = time.perf_counter() - t0
    done.set()
    sampler.join()
    out = Path(argv[argv.index("--out") + 1])
    fit = pd.read_csv(out / "fit.csv")
    fit = fit[fit.layer.astype(str) != "all"]  # the row of every layer spliced at once
    print(json.dumps({"code": code, "start_mb": start, "peak_mb": bc.peak_rss_mb(),
                      "tree_peak_mb": tree_peak[0], "wall": wall, "rows": int(fit.rows.sum()),
                      "seconds": float(fit.seconds.sum()), "layers": len(fit)}))  # fmt: skip


def capture(work: Path, samples: int, seed: int) -> tuple[Path, float]:
    import torch

    model_dir = work / "model"
    if not (model_dir / "config.json").exists():
        bc.save_gpt2(model_dir, POSITIONS, seed)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, bc.VOCAB, (samples, POSITIONS), generator=g)
    path = work / f"ids{samples}.pt"
    torch.save({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, path)
    run = work / f"run{samples}"
    argv = [sys.executable, "-m", "probe", "model=hf", f"model.name={model_dir}",
            "model.task=causal_lm", "dataset=tokens", f"dataset.path={path}",
            "dataset.batch_size=32", "probes=mlp_io", f"hydra.run.dir={run}"]  # fmt: skip
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, cwd=bc.ROOT, capture_output=True)
    return run, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="32,256,1024", help="runs' sequences of 128 tokens")
    p.add_argument("--all-up-to", type=int, default=256, help="fit every block up to this size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default="/tmp/bench-fit")
    p.add_argument("--out", default=None, help="also write the results as markdown to OUT")
    p.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        child(args.child)
        return
    import shutil

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    rows, results = [], []
    for samples in [int(n) for n in args.sizes.split(",")]:
        run, capture_s = capture(work, samples, args.seed)
        h5 = sum(f.stat().st_size for f in run.rglob("*.h5")) / 2**20
        print(f"{samples} samples captured in {capture_s:.1f} s ({h5:.0f} MB)", flush=True)
        fits = [("block 0", ["--layers", "0"]), ("all 6 blocks", [])]
        for label, layers in fits[: 2 if samples <= args.all_up_to else 1]:
            out = work / f"fit{samples}-{len(layers)}"
            argv = [str(run), *FIT, *layers, "--out", str(out)]
            got = bc.child_json([str(Path(__file__).relative_to(bc.ROOT)), "--child", *argv])
            if "error" in got:
                raise SystemExit(f"probe.fit {' '.join(argv)}: {got['error']}")
            got.update(samples=samples, label=label, h5_mb=h5, capture_s=capture_s)
            results.append(got)
            print(json.dumps(got), flush=True)
            layer_mb = samples * POSITIONS * bc.WIDTH * 4 * 2 / 2**20
            rows.append([f"{samples} x {POSITIONS}", label, got["rows"],
                         f"{got['peak_mb'] - got['start_mb']:.0f}",
                         f"{got['tree_peak_mb'] - got['start_mb']:.0f}",
                         f"{layer_mb * (1 if layers else bc.LAYERS):.0f}",
                         f"{got['wall']:.1f}", f"{got['rows'] / got['wall']:.0f}"])  # fmt: skip
    cols = [
        "rows of a run",
        "fit",
        "training rows",
        "peak RSS above start, MB",
        "process tree's peak above start, MB",
        "its rows (in + out, float32), MB",
        "wall s",
        "rows/s",
    ]
    head = ["# probe.fit: peak memory and rows per second", "",
            f"Measured {datetime.date.today()} with `python scripts/bench_fit.py"
            f" --sizes {args.sizes} --all-up-to {args.all_up_to}` on {os.cpu_count()} shared CPU "
            f"cores (CPU only), torch {__import__('torch').__version__}, Python "
            f"{platform.python_version()}."]  # fmt: skip
    notes = [
        f"model: the token benchmarks' GPT-2 shape ({bc.LAYERS} blocks, width {bc.WIDTH}, "
        "seeded random), seeded random ids; `probes=mlp_io` captures each block's MLP input "
        "and output",
        "fit: `python -m probe.fit RUN " + " ".join(FIT) + " [--layers 0]` (one pass over "
        "the training rows), in a fresh process per line",
        "peak RSS above start: the fit process's VmHWM (cleared after imports) minus its RSS "
        "then; process tree's: the RSS of the fit process and every process it started "
        "(workers, if any), summed, sampled every 20 ms, minus the same start",
        "its rows: what the fitted blocks' input and output rows would take in memory if held "
        "whole",
        "rows/s: training rows of every fitted block over the fit's wall seconds (held-out "
        "evaluation and writing included)",
    ]
    report = bc.markdown(head, cols, rows, notes)
    print(report)
    (work / "results.json").write_text(json.dumps(results, indent=1))
    if args.out:
        Path(args.out).write_text(report)


if __name__ == "__main__":
    main()
