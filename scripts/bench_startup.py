"""Start-up and the whole process: `python -m probe` against a plain script doing the same work.

    python scripts/bench_startup.py [--rounds 5] [--samples 1024] [--batch 16] [--image-size 112]
                                    [--out docs/bench/startup.md] [--no-importtime]
                                    [--no-gc-reference] [--cases full,stats]

Each round runs, as fresh processes on one torch thread (OMP_NUM_THREADS=1, MKL_NUM_THREADS=1,
and torch.set_num_threads(1) in the plain script), the default image job in each of these ways:

- probe_full:  `python -m probe` (resnet18, synthetic images, probes=all_convs: every
               convolution's output), full capture into probe.h5 plus its statistics;
- plain_full:  this file's `--plain full`: it imports what a run imports (torch, torchvision,
               h5py, pandas, hydra), builds resnet18 with the same seed, makes the same seeded
               images by hand and copies every convolution's output into h5py datasets (one
               chunk per batch) from forward hooks;
- probe_stats: `python -m probe store=stats`: statistics only;
- plain_stats: `--plain stats`: the same per-layer count, mean, std, min and max from forward
               hooks, written with pandas as summary.csv;
- plaingc_full, plaingc_stats: the plain script holding Python's garbage collections as
               `python -m probe` does (probe.launch.collector: none while it starts, one as
               the loop starts and what is alive then frozen, none at exit), so that the
               ratio to it shows what probe adds beyond that (--no-gc-reference: not run).

Reported: the whole process's seconds (from the parent, around the child) and the ratio
probe / plain (median of per-round ratios), and the time to the first batch: from the start of
the process to the end of its first batch, which the plain script prints and a run's log says
(its `plan:` line follows the first batch). A warm-up round first (its files checked: the plain
script's captures equal probe.h5's), with numba's kernels compiled beforehand (the kernel cache
is warm, as on every run after an install's first: scripts/bench_first_run.py times the first).
Then `-X importtime` of each process once more: per top-level package, the time its imports
took (self: its own modules; cumulative: with what it imported first).

Targets (docs/performance.md): whole process <= 1.15x (full) and <= 1.10x (stats), first batch
within 1 s of the plain script's.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from datetime import datetime
from pathlib import Path

import bench_common

TARGETS = {"full": 1.15, "stats": 1.10}
FIRST_BATCH_TARGET_S = 1.0
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
LOG_TIME = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]\[probe\]\[INFO\] - plan: ")
SEED = 0


# -- the plain script ----------------------------------------------------------------------------
def plain(mode: str, out: Path, samples: int, batch: int, size: int, hold_gc: bool) -> None:
    """The job by hand: resnet18, seeded images, hooks on every convolution (this runs in a
    child process: `--plain MODE`); with `hold_gc` Python's collections as `python -m probe`
    holds them (probe.launch.collector)."""
    if hold_gc:
        gc.disable()
        atexit.register(gc.freeze)
    import h5py
    import hydra  # noqa: F401 - imported by a run, so here too
    import pandas as pd
    import torch
    import torchvision

    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    model = torchvision.models.resnet18(num_classes=1000).eval()
    convs = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Conv2d)]
    file = h5py.File(out / "plain.h5", "w") if mode == "full" else None
    datasets: dict[str, h5py.Dataset] = {}
    sums: dict[str, list] = {}
    where = [0]

    def hook(name: str):
        def take(module, inputs, output) -> None:
            if file is not None:  # full capture: the rows into their place
                if name not in datasets:
                    shape, chunk = output.shape[1:], (min(batch, samples), *output.shape[1:])
                    datasets[name] = file.create_dataset(
                        f"layers/{name}/output", (samples, *shape), "float32", chunks=chunk
                    )
                datasets[name][where[0] : where[0] + len(output)] = output.numpy()
            else:  # statistics only: count, sum, sum of squares, min, max
                x = output.reshape(-1)
                low, high = torch.aminmax(x)
                d = x.double()
                s = sums.setdefault(name, [0, 0.0, 0.0, float("inf"), float("-inf")])
                s[0] += x.numel()
                s[1] += float(d.sum())
                s[2] += float(d.dot(d))
                s[3], s[4] = min(s[3], float(low)), max(s[4], float(high))

        return take

    handles = [m.register_forward_hook(hook(n)) for n, m in convs]
    if hold_gc:
        gc.collect()
        gc.freeze()
        gc.enable()
    with torch.inference_mode():
        for start in range(0, samples, batch):
            xs = []
            for i in range(start, min(start + batch, samples)):  # probe's synthetic images
                g = torch.Generator().manual_seed(SEED * 1_000_003 + i)
                torch.randint(1000, (1,), generator=g)  # (the target, drawn first)
                xs.append(torch.randn((3, size, size), generator=g))
            where[0] = start
            model(torch.stack(xs))
            if start == 0:
                print(f"first_batch {time.time():.6f}", flush=True)
    for h in handles:
        h.remove()
    if file is not None:
        file.close()
    else:
        rows = []
        for name, (n, total, squares, low, high) in sums.items():
            mean = total / n
            std = max(squares / n - mean * mean, 0.0) ** 0.5
            rows.append({"layer": name, "n": n, "mean": mean, "std": std, "min": low, "max": high})
        pd.DataFrame(rows).to_csv(out / "summary.csv", index=False)


# -- the cases -----------------------------------------------------------------------------------
def command(case: str, out: Path, args) -> list[str]:
    """The child's argv (without the interpreter) of `case` writing into `out`."""
    side, kind = case.split("_")
    if side.startswith("plain"):
        sizes = ["--samples", str(args.samples), "--batch", str(args.batch)]
        return [__file__, "--plain", kind, "--dir", str(out), *sizes,
                "--image-size", str(args.image_size), *(["--gc"] if side == "plaingc" else [])]  # fmt: skip
    return [
        "-m", "probe", "model=resnet18", "probes=all_convs", f"store={kind}", f"seed={SEED}",
        f"dataset.num_samples={args.samples}", f"dataset.batch_size={args.batch}",
        f"dataset.image_size={args.image_size}", "progress=false", "print_summary=false",
        f"hydra.run.dir={out}",
    ]  # fmt: skip


def first_batch_at(case: str, out: Path, stdout: str) -> float | None:
    """The wall-clock time (time.time()) at which the case's first batch was done."""
    if case.startswith("plain"):
        found = [ln.split()[1] for ln in stdout.splitlines() if ln.startswith("first_batch ")]
        return float(found[0]) if found else None
    log = out / "probe.log"
    for line in log.read_text().splitlines() if log.is_file() else []:
        m = LOG_TIME.match(line)
        if m:
            return datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return None


def run_case(case: str, out: Path, args, env: dict, importtime: bool = False) -> dict:
    """One process of `case` into a fresh `out`: whole-process seconds, seconds to the end of
    its first batch (the log's timestamps have milliseconds), and with `importtime` its
    `-X importtime` lines."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    flags = ["-X", "importtime"] if importtime else []
    started = time.time()
    c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, *flags, *command(case, out, args)],
        env=env,
        cwd=bench_common.ROOT,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{case} failed:\n{done.stderr[-3000:]}")
    first = first_batch_at(case, out, done.stdout)
    return {
        "wall": wall,
        "cpu": (c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime),
        "first": None if first is None else first - started,
        "imports": done.stderr if importtime else "",
    }


def values_equal(probe_dir: Path, plain_dir: Path) -> str:
    """Whether every convolution's rows the plain script wrote equal probe.h5's (the first
    batch's; 'yes' or what differs)."""
    import h5py
    import numpy as np

    with h5py.File(probe_dir / "probe.h5", "r") as a, h5py.File(plain_dir / "plain.h5", "r") as b:
        names = list(b["layers"])
        for name in names:
            ours, theirs = a[f"layers/{name}/output"], b[f"layers/{name}/output"]
            if ours.shape != theirs.shape:
                return f"no: {name} {ours.shape} != {theirs.shape}"
            rows = min(16, len(ours))
            if not np.array_equal(ours[:rows], theirs[:rows]):
                return f"no: {name} differs"
    return f"yes ({len(names)} layers)"


def warm_kernels(env: dict, tmp: Path) -> None:
    """Prime numba's kernel cache (a run starts its compile when there is none) and wait for it."""
    from probe.stats import kernel_cache

    probe = [sys.executable, "-m", "probe", "dataset.num_samples=8", "progress=false",
             "print_summary=false", f"hydra.run.dir={tmp / 'prime'}"]  # fmt: skip
    subprocess.run(probe, env=env, cwd=bench_common.ROOT, capture_output=True, check=True)
    cache = kernel_cache.cache_dir()
    while any(cache.glob("*.lock")):
        time.sleep(0.5)


# -- -X importtime -------------------------------------------------------------------------------
IMPORT_LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)")


def import_table(text: str) -> dict[str, tuple[float, float]]:
    """{top-level package: (self ms, cumulative ms)} of `-X importtime` output: self sums its
    modules' own times; cumulative sums the outermost imports of the package (each with what it
    imported that was not loaded yet)."""
    lines = [
        (int(m[1]), int(m[2]), len(m[3]), m[4])
        for m in map(IMPORT_LINE.match, text.splitlines())
        if m
    ]
    own: dict[str, float] = defaultdict(float)
    cumulative: dict[str, float] = defaultdict(float)
    # importtime prints a module after everything it imported, so walk backwards to know the
    # importers (the open lines of smaller indentation) of each line
    stack: list[tuple[int, str]] = []
    for us_self, us_cum, indent, name in reversed(lines):
        while stack and stack[-1][0] >= indent:
            stack.pop()
        top = name.split(".")[0]
        own[top] += us_self / 1e3
        if not any(parent.split(".")[0] == top for _, parent in stack):
            cumulative[top] += us_cum / 1e3
        stack.append((indent, name))
    return {k: (own[k], cumulative[k]) for k in own}


def import_section(tables: dict[str, dict[str, tuple[float, float]]], top: int) -> list[str]:
    names = sorted(
        {k for t in tables.values() for k in t},
        key=lambda k: -max(t.get(k, (0.0, 0.0))[1] for t in tables.values()),
    )[:top]
    cols = ["package"] + [f"{case} self / cum ms" for case in tables]
    rows = [
        [name]
        + [
            "-" if name not in t else f"{t[name][0]:.0f} / {t[name][1]:.0f}"
            for t in tables.values()
        ]
        for name in names
    ]
    rows.append(
        ["(all imports)"] + [f"{sum(v[0] for v in t.values()):.0f}" for t in tables.values()]
    )
    return bench_common.table_lines(cols, rows)


# -- main ----------------------------------------------------------------------------------------
def summary_row(kind: str, reference: str, got: dict[str, list[dict]]) -> list:
    """The row of probe_KIND against REFERENCE_KIND (plain or plaingc)."""
    pr, pl = got[f"probe_{kind}"], got[f"{reference}_{kind}"]
    ratio = bench_common.ratios(pr, pl)
    cpu_ratio = statistics.median(bench_common.ratios(pr, pl, "cpu"))
    gap = [a["first"] - b["first"] for a, b in zip(pr, pl, strict=True)]
    med, med_gap = statistics.median(ratio), statistics.median(gap)
    target = TARGETS[kind]
    return [
        kind,
        reference,
        f"{bench_common.median(pl):.2f}",
        f"{bench_common.median(pr):.2f}",
        f"{med:.3f}",
        f"{min(ratio):.3f}-{max(ratio):.3f}",
        f"{cpu_ratio:.3f}",
        f"{target:.2f} {'met' if med <= target else 'NOT met'}",
        f"{bench_common.median(pl, 'first'):.2f}",
        f"{bench_common.median(pr, 'first'):.2f}",
        f"{med_gap:+.2f}",
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--image-size", type=int, default=112)
    p.add_argument("--cases", default="full,stats", help="full, stats or both (default)")
    p.add_argument(
        "--no-gc-reference", action="store_true", help="skip the plain script with probe's gc"
    )
    p.add_argument("--no-importtime", action="store_true", help="skip the -X importtime tables")
    p.add_argument("--top", type=int, default=16, help="packages in the importtime table")
    p.add_argument("--tmp", default=None, help="where the cases write (default: the system's)")
    p.add_argument("--out", type=Path, default=None, help="also write the report here (markdown)")
    p.add_argument("--plain", choices=["full", "stats"], help=argparse.SUPPRESS)  # the child
    p.add_argument("--gc", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.plain:
        return plain(args.plain, args.dir, args.samples, args.batch, args.image_size, args.gc)

    env = {**os.environ, **ONE_THREAD, "HYDRA_FULL_ERROR": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(bench_common.ROOT), env.get("PYTHONPATH", "")])
    tmp = Path(tempfile.mkdtemp(prefix="bench_startup_", dir=args.tmp))
    kinds = [k for k in ("full", "stats") if k in args.cases.split(",")]
    sides = ["plain", "probe"] if args.no_gc_reference else ["plain", "plaingc", "probe"]
    warm_kernels(env, tmp)

    print("warm-up round", flush=True)
    for kind in kinds:
        for side in sides:
            run_case(f"{side}_{kind}", tmp / f"warm-{side}_{kind}", args, env)
    checked = (
        values_equal(tmp / "warm-probe_full", tmp / "warm-plain_full") if "full" in kinds else "-"
    )
    for d in tmp.glob("warm-*"):
        shutil.rmtree(d, ignore_errors=True)

    got: dict[str, list[dict]] = defaultdict(list)
    for r in range(args.rounds):
        for kind in kinds:  # a kind's cases back to back, their order rotating by round
            for side in sides[r % len(sides) :] + sides[: r % len(sides)]:
                case = f"{side}_{kind}"
                t = run_case(case, tmp / case, args, env)
                shutil.rmtree(tmp / case, ignore_errors=True)
                got[case].append(t)
                print(f"  round {r + 1}/{args.rounds} {case:<14} {t['wall']:7.2f} s  "
                      f"cpu {t['cpu']:7.2f} s  first batch {t['first']:.2f} s", flush=True)  # fmt: skip

    rows = [summary_row(k, side, got) for k in kinds for side in sides if side != "probe"]
    cols = ["case", "against", "plain_s", "probe_s", "x_plain", "per round", "x_plain_cpu",
            "target", "plain_first_s", "probe_first_s", "first_gap_s"]  # fmt: skip
    head = [
        f"# Start-up and the whole process ({time.strftime('%Y-%m-%d')})",
        "",
        f"`python scripts/bench_startup.py --rounds {args.rounds} --samples {args.samples} "
        f"--batch {args.batch} --image-size {args.image_size}`: resnet18, probes=all_convs (20 "
        f"convolutions), {args.samples} synthetic images of {args.image_size} px in batches of "
        f"{args.batch}, one torch thread, {os.cpu_count()} cores; each case a fresh process, "
        "rounds interleaved; medians.",
    ]
    notes = [
        "against: plain is the plain script; plaingc the same script holding Python's garbage "
        "collections as `python -m probe` does (probe.launch.collector: none while it starts, "
        "one as the loop starts and what is alive then frozen, none at exit)",
        "x_plain: median over rounds of probe's whole process over the plain script's in the "
        "same round (wall seconds); x_plain_cpu: the same of their CPU seconds (user + system, "
        "every thread: steadier on a shared machine)",
        "first_s: from the process's start to the end of its first batch; first_gap_s: the "
        "median of per-round differences probe - plain",
        f"values: the plain script's captures equal probe.h5's: {checked}",
    ]
    for kind in kinds:
        for side in sides:
            seconds = ", ".join(f"{t['wall']:.2f}" for t in got[f"{side}_{kind}"])
            notes.append(f"{side}_{kind}: seconds per round {seconds}")
    report = bench_common.markdown(head, cols, rows, notes)

    if not args.no_importtime:
        print("-X importtime", flush=True)
        tables = {}
        for case in (*(f"probe_{k}" for k in kinds), f"plain_{kinds[0]}"):
            t = run_case(case, tmp / f"imports-{case}", args, env, importtime=True)
            tables[case] = import_table(t["imports"])
        report += "\n".join([
            "",
            "## -X importtime",
            "",
            "Each process once more under `python -X importtime`, per top-level package: self is "
            "the time its own modules took to import, cumulative (cum) that of its outermost "
            "imports with what each imported first (torch's numpy counts to torch); the import "
            "times include the flag's own overhead.",
            "",
            *import_section(tables, args.top),
            "",
        ])  # fmt: skip
    shutil.rmtree(tmp, ignore_errors=True)
    print(report)
    if args.out:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
