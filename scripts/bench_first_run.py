"""A fresh install's first run against a warm one: the default job's whole process.

    python scripts/bench_first_run.py [--rounds 3] [--out docs/bench/first_run.md]

Each round times, interleaved, `python -m probe` (the default job) with empty caches (numba's and
the kernel stamp's: a fresh install, where stats.backend=auto runs on torch while a background
process compiles the kernels), with warm caches, and with empty caches and stats.backend=numba (the
kernels compiled in the run, as every first run did before the torch backend), plus
`python -m probe --help` with empty and warm caches. Between cases it waits for any background
compile to end, so none overlaps the next case. Target: cold <= 1.3x warm.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET = 1.3


def timed(args: list[str], env: dict, cwd: Path) -> float:
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "probe", *args],
        env={**os.environ, **env},
        cwd=cwd,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"probe {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return wall


def wait_for_compiles(cache: Path) -> float:
    """Seconds until no background compile holds a lock in `cache`."""
    t0 = time.perf_counter()
    while any(cache.glob("*.lock")):
        time.sleep(0.2)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="also write the report here")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench_first_run_"))
    warm = {"NUMBA_CACHE_DIR": str(tmp / "warm_numba"), "PROBE_CACHE_DIR": str(tmp / "warm")}
    job = ["progress=false"]
    timed([*job, f"hydra.run.dir={tmp / 'prime'}"], warm, tmp)  # starts the warm cache's compile
    wait_for_compiles(tmp / "warm")
    times: dict[str, list[float]] = {}
    after: list[float] = []
    for r in range(args.rounds):
        for case in ("cold", "warm", "cold_numba", "help_cold", "help_warm"):
            cold = {
                "NUMBA_CACHE_DIR": str(tmp / f"{case}{r}_numba"),
                "PROBE_CACHE_DIR": str(tmp / f"{case}{r}"),
            }
            env = warm if case.endswith("warm") else cold
            extra = ["stats.backend=numba"] if case == "cold_numba" else []
            run = ["--help"] if case.startswith("help") else [*job, *extra]
            run += [] if case.startswith("help") else [f"hydra.run.dir={tmp / f'{case}{r}_run'}"]
            times.setdefault(case, []).append(timed(run, env, tmp))
            waited = wait_for_compiles(Path(env["PROBE_CACHE_DIR"]))
            if case == "cold":
                after.append(waited)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = [c / w for c, w in zip(times["cold"], times["warm"], strict=True)]
    numba_ratio = [c / w for c, w in zip(times["cold_numba"], times["warm"], strict=True)]
    lines = [
        f"# First run of a fresh install ({time.strftime('%Y-%m-%d')})",
        "",
        f"`python scripts/bench_first_run.py --rounds {args.rounds}`: the default job "
        f"(`python -m probe`), whole process, {os.cpu_count()} cores; medians of interleaved rounds.",
        "",
        "| case | median_s | per round |",
        "|---|---|---|",
        *(f"| {k} | {med[k]:.2f} | {', '.join(f'{t:.2f}' for t in v)} |" for k, v in times.items()),
        "",
        f"- cold / warm (stats.backend=auto): {statistics.median(ratio):.3f}x (per round "
        f"{', '.join(f'{x:.3f}' for x in ratio)}); target <= {TARGET}x: "
        f"{'met' if statistics.median(ratio) <= TARGET else 'NOT met'}",
        f"- cold / warm with stats.backend=numba (compiled in the run): "
        f"{statistics.median(numba_ratio):.3f}x",
        f"- the background compile went on for a median {statistics.median(after):.1f} s after "
        "the cold run's process ended",
        f"- --help: {med['help_cold']:.2f} s cold, {med['help_warm']:.2f} s warm",
    ]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
