"""Crash safety, measured: SIGKILL `python -m probe` runs at random moments and check their files.

The interrupt tests kill a run at a few chosen batches; this kills many runs at random moments
(timed, right after a flush, and aimed at the next batch's write) in several store modes, and counts
how often the file opens, holds exactly the uninterrupted run's first rows, and resumes to the
uninterrupted file. Exits non-zero if any trial failed.

    python scripts/crash_trials.py [--trials 20] [--seed 0] [--jobs 4] [--modes full,gradients]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import queue
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np
from bench_common import ROOT  # the repository root, put on sys.path there

from probe.stats import backend
from probe.stats.running import stats_for
from probe.store import stats_file
from probe.store.fileformat import decode, is_scale, layer_path, read_progress
from probe.store.runfile import NothingFlushed, open_probe_file
from probe.testing.arrays import file_arrays  # as the tests compare files

BASE = [
    *("print_summary=false", "progress=false", "hydra.verbose=probe", "model=custom"),
    *("model._target_=probe.testing.models.TinyNet", "model.input_shape=[3,8,8]"),
    "model.num_classes=10",
]
EVERYTHING = ["probes=everything"]  # conv, relu, fc: input and output, float16
BIG_CHUNKS = "store.chunk_bytes=65536"  # many batches of rows per chunk, where the writer allows
CONFIGS = {  # reference name: overrides beside BASE, the sizes and the delay
    "full": EVERYTHING,
    "stats": [*EVERYTHING, "store.mode=stats", "store.flush_seconds=0"],
    "grads": ["probes=param_grads", "probes.params.capture=[output,grad_output,param_grad]"],
    "lzf": [*EVERYTHING, "store.compression=lzf", BIG_CHUNKS],
    "gzip": [*EVERYTHING, "store.compression=gzip", BIG_CHUNKS],
}
MODES = {  # mode: (reference, share of --trials, kills before the final resume)
    "full": ("full", 1.0, 1),
    "stats-only": ("stats", 1.0, 1),
    "gradients": ("grads", 1.0, 1),
    "compressed lzf": ("lzf", 0.5, 1),
    "compressed gzip": ("gzip", 0.5, 1),
    "resume killed again": ("full", 1.0, 2),
}
KINDS = ("timer", "after flush", "next write")
FLUSHED = re.compile(r"flushed batch (\d+) ")


@dataclass
class Reference:
    """An uninterrupted run of one config: its arrays and how long its phases took."""

    args: list[str]
    arrays: dict
    setup: float  # first log line -> first flushed batch
    rest: float  # first log line -> exit
    period: float  # median time between flushed batches
    chunks: str  # rows per chunk of layers/conv/output


@dataclass
class Trial:
    mode: str
    index: int
    kinds: list[str] = field(default_factory=list)
    readable: bool = False
    nothing: bool = False
    rows_equal: bool | None = None  # None: no rows to compare (nothing was flushed)
    resume_equal: bool | None = None  # None: not resumed (nothing was flushed)
    missed: int = 0  # kills that came after the run had finished
    failures: list[str] = field(default_factory=list)


def run(args: list[str], run_dir: Path, plan=None, limit: float = 600):
    """`python -m probe ARGS` (test models importable) to its end, or SIGKILLed as `plan` says:
    ("timer", seconds after its first log line) or ("flush", K, seconds after "flushed batch K").
    Returns (rc, output, time of the first line, times of flushed batches, end time, killed)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONPATH": path}  # runs side by side
    env.pop("HYDRA_FULL_ERROR", None)
    cmd = [sys.executable, "-m", "probe", *args, f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    lines: queue.Queue = queue.Queue()

    def pump():
        for line in proc.stdout:
            lines.put((time.monotonic(), line))
        lines.put((0, None))

    threading.Thread(target=pump, daemon=True).start()
    out, flushes, first, deadline, stop = [], [], None, None, time.monotonic() + limit
    ended = False
    while True:
        now = time.monotonic()
        if deadline is not None and now >= deadline or now >= stop:
            break
        try:
            t, line = lines.get(timeout=max(0.0, min(deadline or stop, stop) - now))
        except queue.Empty:
            continue
        if line is None:
            ended = True
            break
        out.append(line)
        first = first or t
        if m := FLUSHED.search(line):
            flushes.append(t)
        if plan and deadline is None:
            if plan[0] == "timer":
                deadline = first + plan[1]
            elif m and int(m.group(1)) == plan[1]:
                deadline = time.monotonic() + plan[2]
    killed = not ended and proc.poll() is None  # output still open: the process still runs
    if killed:
        proc.kill()
    proc.wait(timeout=120)
    while not ended and (item := lines.get(timeout=60))[1] is not None:
        out.append(item[1])
    return proc.returncode, "".join(out), first, flushes, time.monotonic(), killed


def differing_rows(got: np.ndarray, want: np.ndarray) -> str:
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{got.dtype}{got.shape} != {want.dtype}{want.shape}"
    nan = got.dtype.kind in "fc"
    same = [np.array_equal(a, b, equal_nan=nan) for a, b in zip(got, want, strict=True)]
    bad = [i for i, s in enumerate(same) if not s]
    return f"rows {bad[:5]}{'...' if len(bad) > 5 else ''} of {len(got)} differ" if bad else ""


def same_values(got, want, rtol: float) -> bool:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return got.shape == want.shape and np.allclose(got, want, rtol=rtol, atol=0, equal_nan=True)


def check_prefix(f: h5py.File, ref: Reference, stats_ref: Reference, batch: int) -> list[str]:
    """What of a killed file is not the reference's first rows (empty list: all of it is)."""
    p, problems, seen = read_progress(f), [], set()

    def visit(name, ds):
        if not isinstance(ds, h5py.Dataset) or name in ("progress",) or name[:6] == "stats/":
            return
        if is_scale(ds) and name != "sample":
            return
        seen.add(name)
        if name not in ref.arrays:
            problems.append(f"{name}: not in the reference")
            return
        want = ref.arrays[name]
        if ds.shape == ():
            n, got = None, ds[()]
        else:
            n = p.valid_rows(ds, decode(name.rsplit("/", 1)[-1]))
            got, want = ds[:n], want[:n]
        if ds.dtype != want.dtype:
            problems.append(f"{name}: dtype {ds.dtype}, reference {want.dtype}")
        elif n is None and not np.array_equal(got, want):
            problems.append(f"{name}: differs")
        elif n is not None and (why := differing_rows(got, want)):
            problems.append(f"{name}: first {n} valid rows: {why}")

    f.visititems(visit)
    missing = {k for k in ref.arrays if k[:6] != "stats/"} - seen
    if missing and p.samples:
        problems.append(f"missing after {p.samples} samples: {sorted(missing)[:4]}")
    for (layer, site), info in stats_file.read(f).items():
        rows = p.batches if info.per_batch else p.tokens if info.rows == "tokens" else p.samples
        s = info.stats
        if s.rows != rows:
            problems.append(f"stats/{layer}/{site}: rows {s.rows}, /progress counts {rows}")
            continue
        source = stats_ref.arrays.get(layer_path(layer, site))
        if source is None:
            problems.append(f"stats/{layer}/{site}: no {layer_path(layer, site)} to recompute")
            continue
        want, step = stats_for(info.module_type, site, s.unit_axis), 1 if info.per_batch else batch
        for lo in range(0, rows, step):
            backend.fold(want, source[lo : lo + step])
        a, b = s.as_row(), want.as_row()
        bad = [k for k in b if not same_values(a.get(k, math.nan), b[k], 1e-12)]
        if bad:
            problems.append(f"stats/{layer}/{site} over {rows} rows: {bad} differ from recomputed")
    return problems


def check_killed(path: Path, ref: Reference, stats_ref: Reference, batch: int):
    """("ok" | "nothing" | "unreadable" | "rows", detail) of a killed run's file."""
    if not path.exists():
        return "nothing", "no probe.h5"
    try:
        f = open_probe_file(path)
    except NothingFlushed as e:
        return "nothing", str(e)
    except Exception as e:  # noqa: BLE001 - any failure to open is what is counted
        return "unreadable", f"{type(e).__name__}: {e}"
    with f:
        try:
            n = read_progress(f).samples
            problems = check_prefix(f, ref, stats_ref, batch)
        except Exception as e:  # noqa: BLE001
            return "rows", f"reading failed: {type(e).__name__}: {e}"
    return ("rows", "; ".join(problems[:4])) if problems else ("ok", f"{n} samples")


def check_complete(path: Path, ref: Reference) -> list[str]:
    """What of a finished file differs from the reference (statistics' floats to 1e-12)."""
    with open_probe_file(path, ours_only=False) as f:
        if not read_progress(f).complete:
            return ["not complete"]
        got = file_arrays(f)
    problems = [f"{k}: only in the resumed file" for k in sorted(set(got) - set(ref.arrays))]
    problems += [f"{k}: missing" for k in sorted(set(ref.arrays) - set(got))]
    for k in sorted(set(got) & set(ref.arrays)):
        a, b = got[k], ref.arrays[k]
        if k[:6] == "stats/" and a.dtype.kind == "f":
            if not same_values(a, b, 1e-12):
                problems.append(f"{k}: differs beyond 1e-12")
        elif a.shape and (why := differing_rows(a, b)):
            problems.append(f"{k}: {why}")
        elif not a.shape and not np.array_equal(a, b):
            problems.append(f"{k}: differs")
    return problems


def tail(output: str, n: int = 3) -> str:
    return " | ".join(line.strip() for line in output.strip().splitlines()[-n:])


def plan_kill(kind: str, rng: random.Random, ref: Reference, done: int, total: int):
    """A kill for a run that starts with `done` of `total` batches written."""
    left = max(total - done, 1) / total
    if kind == "timer" or done >= total:
        return ("timer", rng.uniform(0, ref.setup + (ref.rest - ref.setup) * left))
    k = rng.randrange(done, total)
    if kind == "after flush":
        return ("flush", k, 0.0)
    return ("flush", k, ref.period * rng.uniform(0.8, 1.15))  # about when batch k+1 is written


def trial(mode: str, index: int, refs: dict, opts) -> Trial:
    name, _, kills = MODES[mode]
    ref = refs[name]
    stats_ref = refs["full"] if name == "stats" else ref  # rows to recompute /stats from
    rng, result = random.Random(f"{opts.seed}/{mode}/{index}"), Trial(mode, index)
    run_dir = opts.tmp / f"{mode.replace(' ', '-')}-{index}"
    path, total, done = run_dir / "probe.h5", opts.samples // opts.batch, 0
    result.readable = True
    for k in range(kills):
        kind = KINDS[index % 3] if k or kills == 1 else rng.choice(KINDS[1:])
        plan = plan_kill(kind, rng, ref, done, total)
        when = f" {plan[1]} +{plan[2]:.3f}s" if plan[0] == "flush" else f" {plan[1]:.2f}s"
        result.kinds.append(kind + when)
        rc, out, *_, killed = run(ref.args + (["resume=true"] if k else []), run_dir, plan)
        if not killed:
            result.missed += 1
            if rc != 0:
                result.failures.append(f"kill {k + 1}: exited {rc} before the kill: {tail(out)}")
                return result
        status, detail = check_killed(path, ref, stats_ref, opts.batch)
        if status == "nothing" and k:  # the first kill left flushed rows: they must stay
            result.readable = False
            result.failures.append(f"kill {k + 1} ({result.kinds[-1]}) of a resumed run with "
                                   f"{done} batches flushed: opens as {detail}")  # fmt: skip
            return result
        if status == "nothing":  # resume=true continues it from its first batch: checked below
            result.nothing = True
            break
        result.readable = result.readable and status != "unreadable"
        result.rows_equal = status == "ok" and result.rows_equal is not False
        if status != "ok":
            result.failures.append(f"kill {k + 1} ({result.kinds[-1]}): {status}: {detail}")
            break
        with open_probe_file(path) as f:
            done = read_progress(f).batches
    if not path.exists() or not read_complete(path):
        rc, out, *_ = run([*ref.args, "resume=true"], run_dir)
        if rc != 0:
            result.resume_equal = False
            result.failures.append(f"resume exited {rc}: {tail(out)}")
            return result
    problems = check_complete(path, ref)
    result.resume_equal = not problems
    if problems:
        result.failures.append(f"resumed file: {'; '.join(problems[:4])}")
    elif not result.failures:
        shutil.rmtree(run_dir, ignore_errors=True)
    return result


def read_complete(path: Path) -> bool:
    with contextlib.suppress(Exception), open_probe_file(path) as f:
        return read_progress(f).complete
    return False  # resume=true then says what is wrong


def reference(name: str, opts) -> Reference:
    sizes = [f"dataset.num_samples={opts.samples}", f"dataset.batch_size={opts.batch}"]
    args = [*BASE, *CONFIGS[name], *sizes, f"+model.kwargs.delay={opts.delay}"]
    run_dir = opts.tmp / f"reference-{name}"
    rc, out, first, flushes, end, _ = run(args, run_dir)
    if rc != 0 or not flushes:
        sys.exit(f"the reference run {name} failed ({rc}): {tail(out, 8)}")
    with open_probe_file(run_dir / "probe.h5") as f:
        arrays = file_arrays(f)
        ds = f.get("layers/conv/output")
        chunks = f"{ds.chunks[0]} rows ({ds.compression or 'plain'})" if ds is not None else "-"
    period = statistics.median(np.diff(flushes)) if len(flushes) > 1 else opts.delay
    return Reference(args, arrays, flushes[0] - first, end - first, period, chunks)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=20, help="trials per mode (compressed: split)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=4, help="trials run side by side")
    p.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated, of: " + ", ".join(MODES)
    )
    p.add_argument("--samples", type=int, default=60)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--delay", type=float, default=0.05, help="seconds of sleep per forward")
    p.add_argument("--keep", action="store_true", help="keep the run directories")
    opts = p.parse_args()
    modes = [m.strip() for m in opts.modes.split(",") if m.strip()]
    if unknown := set(modes) - set(MODES):
        p.error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    opts.tmp = Path(tempfile.mkdtemp(prefix="crash_trials-"))
    started = time.monotonic()
    names = sorted({MODES[m][0] for m in modes} | {"full"})
    with ThreadPoolExecutor(opts.jobs) as pool:
        refs = dict(zip(names, pool.map(lambda n: reference(n, opts), names), strict=True))
        print(f"references ({time.monotonic() - started:.0f}s): " + ", ".join(
            f"{n}: first flush {r.setup:.1f}s, run {r.rest:.1f}s, chunks {r.chunks}"
            for n, r in refs.items()))  # fmt: skip
        jobs = [(m, i) for m in modes for i in range(max(1, round(opts.trials * MODES[m][1])))]
        results = list(pool.map(lambda job: trial(*job, refs, opts), jobs))
    head = ("mode", "trials", "readable", "nothing flushed", "rows equal", "resume equal", "missed")
    rows = []
    for m in modes:
        rs = [r for r in results if r.mode == m]
        resumed = [r for r in rs if r.resume_equal is not None]
        compared = [r for r in rs if r.rows_equal is not None]
        rows.append((m, len(rs), f"{sum(r.readable for r in rs)}/{len(rs)}",
                     sum(r.nothing for r in rs), f"{sum(bool(r.rows_equal) for r in compared)}/{len(compared)}",
                     f"{sum(bool(r.resume_equal) for r in resumed)}/{len(resumed)}",
                     sum(r.missed for r in rs)))  # fmt: skip
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]
    for row in (head, *rows):
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)))
    failed = [r for r in results if r.failures]
    print(f"\n{len(results)} trials, {len(failed)} failed, {time.monotonic() - started:.0f}s; "
          "readable: opened, or nothing flushed; missed: kills after the run had finished")  # fmt: skip
    for r in failed:
        for why in r.failures:
            print(f"FAIL {r.mode} trial {r.index} [{', '.join(r.kinds)}]: {why}")
    if failed or opts.keep:
        print(f"run directories: {opts.tmp}")
    else:
        shutil.rmtree(opts.tmp, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
