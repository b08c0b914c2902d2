"""Side-by-side benchmark: the pipeline against plain PyTorch, hand-written hooks and peers.

    python scripts/bench.py                       # resnet18, all convs, batch 16, 112x112, CPU
    python scripts/bench.py --model vgg11 --device cuda --batch 32 --image-size 224

Cases run interleaved in one process (A B C ... A B C ...) after one warm-up pass each, over the
same materialised batches and the same model; the table holds medians and ratios to the plain
forward (and, for gradient cases, to the plain forward + backward); `durable_s` also waits until
every file a case wrote is on disk (fsync), which buffered writers leave for later. Peak RSS is
measured per case in a fresh subprocess. TorchLens and nnsight patch torch and the model for the
rest of a process, so each is timed in its own subprocess, interleaved with a plain forward there,
and its ratio is to that one.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts import bench_cases as bc  # noqa: E402


@dataclass
class Case:
    name: str
    what: str
    build: object  # (setup) -> case callable
    floor: str = "plain_forward"
    check: tuple | None = None  # (sites, dtype, needs gradient reference)
    peer: str | None = None  # module that must be installed; timed in its own subprocess


def catalogue(args) -> list[Case]:
    g = args.grad_probes
    return [
        Case("plain_forward", "model(x) under inference_mode, no hooks", bc.plain_forward),
        Case(
            "plain_forward_backward",
            "summed cross-entropy, loss.backward(), no hooks",
            bc.plain_forward_backward,
            floor="plain_forward_backward",
        ),
        Case(
            "probe_stats",
            "pipeline, store=stats (statistics only; stats.backend=auto: numba on a CPU, torch on a GPU)",
            lambda s: bc.probe_case(s, "store=stats"),
        ),
        Case(
            "probe_stats_torch",
            "pipeline, store=stats, stats.backend=torch (the portable reference)",
            lambda s: bc.probe_case(s, "store=stats", "stats.backend=torch"),
        ),
        *gpu_cases(args),
        Case(
            "probe_full",
            "pipeline, full capture, uncompressed (the default)",
            lambda s: bc.probe_case(s, "store.compression=none"),
            check=(("output",), None, False),
        ),
        Case(
            "probe_full_torch",
            "pipeline, full capture, stats.backend=torch",
            lambda s: bc.probe_case(s, "store.compression=none", "stats.backend=torch"),
            check=(("output",), None, False),
        ),
        Case(
            "probe_full_lzf",
            "pipeline, full capture, lzf",
            lambda s: bc.probe_case(s, "store.compression=lzf"),
            check=(("output",), None, False),
        ),
        Case(
            "probe_full_lzf_spanning",
            "pipeline, lzf, chunks spanning batches (the earlier layout: rewritten at each flush, "
            "not kill-safe)",
            lambda s: bc.spanning(bc.probe_case(s, "store.compression=lzf")),
            check=(("output",), None, False),
        ),
        Case(
            "probe_full_gzip1",
            "pipeline, full capture, gzip level 1",
            lambda s: bc.probe_case(s, "store.compression=gzip", "store.compression_level=1"),
            check=(("output",), None, False),
        ),
        Case(
            "probe_full_f16",
            "pipeline, full capture, float16 storage",
            lambda s: bc.probe_case(s, dtype="float16"),
            check=(("output",), "float16", False),
        ),
        Case(
            "probe_grads",
            f"pipeline, probes={g} (output + grad_output)",
            lambda s: bc.probe_case(s, f"probes={g}"),
            floor="plain_forward_backward",
            check=(("output", "grad_output"), None, True),
        ),
        Case(
            "naive_clone_torch_save",
            "forward hooks clone into lists, torch.save at the end",
            bc.naive_clone_torch_save,
        ),
        Case(
            "hooks_h5py_sync",
            "forward hooks write h5py inside the hook",
            bc.hooks_h5py_sync,
        ),
        Case(
            "fx_extractor_h5py",
            "torchvision create_feature_extractor + h5py",
            bc.fx_extractor_h5py,
        ),
        Case(
            "torchlens_h5py",
            "torchlens.extract + h5py",
            bc.torchlens_h5py,
            peer="torchlens",
        ),
        Case("nnsight_h5py", "nnsight trace + .save() + h5py", bc.nnsight_h5py, peer="nnsight"),
    ]


def gpu_cases(args) -> list[Case]:
    """On a GPU: statistics reduced on the host as before the torch backend (every capture
    copied over), beside probe_stats, which reduces them on the device."""
    if not args.device.startswith("cuda"):
        return []
    return [
        Case(
            "probe_stats_host",
            "pipeline, store=stats, stats.backend=numba: every capture copied to the host",
            lambda s: bc.probe_case(s, "store=stats", "stats.backend=numba"),
        )
    ]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--probes", default="all_convs")
    p.add_argument("--grad-probes", default="grads_all_convs")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--image-size", type=int, default=112)
    p.add_argument(
        "--batches",
        type=int,
        default=16,
        help="batches per run (default 16: a run's fixed costs, file set-up and close, weigh "
        "more in fewer batches)",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--cases", default="", help="comma-separated subset (default: all)")
    p.add_argument("--no-rss", action="store_true", help="skip the per-case RSS subprocesses")
    p.add_argument("--out", default=str(ROOT / "docs" / "bench"), help="writes OUT.csv, OUT.md")
    p.add_argument("--tmp", default=None, help="where cases write their files")
    p.add_argument("--one", help=argparse.SUPPRESS)  # subprocess: run one case once, print RSS
    p.add_argument("--isolated", help=argparse.SUPPRESS)  # subprocess: time a peer vs forward
    return p.parse_args(argv)


def overrides(args) -> list[str]:
    return [
        f"model={args.model}",
        f"probes={args.probes}",
        f"dataset.batch_size={args.batch}",
        f"dataset.image_size={args.image_size}",
        f"dataset.num_samples={args.batch * args.batches}",
        f"device={args.device}",
    ]


def timed(fn, out: Path) -> tuple[float, float, int]:
    """Seconds for one run of `fn` into a fresh `out`; seconds until what it wrote is on disk
    (every file fsync'ed: a buffered write that left its bytes in the page cache has not
    written them yet, and their writeback would land in a later case's timing); the bytes."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    sync()
    t0 = time.perf_counter()
    fn(out)
    sync()
    seconds = time.perf_counter() - t0
    files = [f for f in out.rglob("*") if f.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    durable = time.perf_counter() - t0
    return seconds, durable, sum(f.stat().st_size for f in files)


def sync() -> None:
    """Wait for queued GPU work, so a timing covers it."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def interleave(cases: dict, reps: int, tmp: Path) -> tuple[dict, dict, dict]:
    """A warm-up pass, then `reps` rounds of every case in turn; per-case times, times until
    on disk, and bytes."""
    times = {n: [] for n in cases}
    durable = {n: [] for n in cases}
    written = {}
    for n, fn in cases.items():
        *_, written[n] = timed(fn, tmp / n)
    for _ in range(reps):
        for n, fn in cases.items():
            seconds, on_disk, _ = timed(fn, tmp / f"{n}.rep")
            times[n].append(seconds)
            durable[n].append(on_disk)
    return times, durable, written


def peak_rss_mb() -> float:
    """This process's own peak RSS. VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the
    parent at fork, so a child of a big parent would report the parent's peak."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def subprocess_json(args, flag: str, name: str) -> dict:
    argv = [a for a in sys.argv[1:] if not a.startswith("--cases")]
    cmd = [sys.executable, __file__, *argv, flag, name]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode or not lines:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(lines[-1])


def main(argv=None) -> None:
    args = parse_args(argv)
    cases = catalogue(args)
    if args.cases:
        wanted = set(args.cases.split(","))
        cases = [c for c in cases if c.name in wanted or c.name.startswith("plain_")]
    by_name = {c.name: c for c in cases}
    tmp = Path(tempfile.mkdtemp(prefix="probe-bench-", dir=args.tmp))
    try:
        setup = bc.make_setup(overrides(args))
        if args.one:
            by_name[args.one].build(setup)(tmp)
            print(json.dumps({"peak_rss_mb": peak_rss_mb()}))
            return
        if args.isolated:
            fns = {"plain_forward": bc.plain_forward(setup)}
            fns[args.isolated] = by_name[args.isolated].build(setup)
            times, durable, written = interleave(fns, args.reps, tmp)
            print(json.dumps({"times": times, "durable": durable, "written": written}))
            return
        report(args, setup, cases, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def report(args, setup, cases: list[Case], tmp: Path) -> None:
    import pandas as pd

    notes = []
    local = {c.name: c.build(setup) for c in cases if c.peer is None}
    print(f"timing {len(local)} cases x {args.reps} interleaved repetitions ...", flush=True)
    times, durable, written = interleave(local, args.reps, tmp)
    medians = {n: statistics.median(v) for n, v in times.items()}
    on_disk = {n: statistics.median(v) for n, v in durable.items()}
    floors = dict(medians)
    for c in cases:
        if c.peer is None:
            continue
        if not bc.installed(c.peer):
            notes.append(f"{c.name}: skipped, {c.peer} is not installed (pip install {c.peer})")
            continue
        print(f"timing {c.name} in its own process ...", flush=True)
        got = subprocess_json(args, "--isolated", c.name)
        if "error" in got:
            notes.append(f"{c.name}: failed: {got['error']}")
            continue
        medians[c.name] = statistics.median(got["times"][c.name])
        on_disk[c.name] = statistics.median(got["durable"][c.name])
        floors[c.name] = statistics.median(got["times"]["plain_forward"])
        written[c.name] = got["written"][c.name]
        notes.append(
            f"{c.name}: ratio to the plain forward timed in its own process "
            f"({floors[c.name]:.3f} s there)"
        )
    equal = check_values(setup, cases, tmp)
    rows = []
    for c in cases:
        if c.name not in medians:
            continue
        rss = None if args.no_rss else subprocess_json(args, "--one", c.name).get("peak_rss_mb")
        fwd = floors[c.name] if c.peer else medians["plain_forward"]
        floor = medians.get(c.floor, fwd)
        mb = written.get(c.name, 0) / 1e6
        rows.append(
            {
                "case": c.name,
                "median_s": round(medians[c.name], 3),
                "x_forward": round(medians[c.name] / fwd, 2),
                "x_floor": round(medians[c.name] / floor, 2),
                "durable_s": round(on_disk[c.name], 3),
                "x_durable": round(on_disk[c.name] / fwd, 2),
                "peak_rss_mb": None if rss is None else round(rss),
                "mb_written": round(mb, 1),
                "mb_per_s": round(mb / medians[c.name], 1) if mb else None,
                "values_equal": equal.get(c.name, "-"),
                "what": c.what,
            }
        )
    table = pd.DataFrame(rows)
    header = (
        f"{args.model}, probes={args.probes}, batch {args.batch}, {args.image_size}x"
        f"{args.image_size}, {args.batches} batches per run, {args.device}, "
        f"median of {args.reps} interleaved runs"
    )
    with pd.option_context("display.width", 200, "display.max_colwidth", 60):
        print(header)
        print(table.to_string(index=False))
    for n in notes:
        print("note:", n)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(out.with_suffix(".csv"), index=False)
    out.with_suffix(".md").write_text(markdown(header, table, notes))
    print(f"wrote {out.with_suffix('.csv')} and {out.with_suffix('.md')}")


def check_values(setup, cases: list[Case], tmp: Path) -> dict[str, str]:
    """For each probe case, whether its warm-up file equals the plain hooks' reference values."""
    refs, equal = {}, {}
    for c in cases:
        if c.check is None or not (tmp / c.name / "probe.h5").exists():
            continue
        sites, dtype, grads = c.check
        if grads not in refs:
            refs[grads] = bc.reference_values(setup, grads=grads)
        ok, why = bc.stored_values_match(tmp / c.name / "probe.h5", refs[grads], sites, dtype)
        equal[c.name] = "yes" if ok else f"NO: {why}"
    return equal


def markdown(header: str, table, notes: list[str]) -> str:
    cols = list(table.columns)
    lines = [f"_{header}_", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in table.itertuples(index=False):
        lines.append("| " + " | ".join("" if v is None else str(v) for v in row) + " |")
    lines += [""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
