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
import importlib.util
import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import bench_common as bc  # first: it puts the repository root on sys.path
import torch
from torch.nn import functional as F

from probe.testing import oracles


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
        Case("plain_forward", "model(x) under inference_mode, no hooks", plain_forward),
        Case(
            "plain_forward_backward",
            "summed cross-entropy, loss.backward(), no hooks",
            plain_forward_backward,
            floor="plain_forward_backward",
        ),
        Case(
            "probe_stats",
            "pipeline, store=stats (statistics only; stats.backend=auto: numba on a CPU, torch on a GPU)",
            lambda s: oracles.probe_case(s, "store=stats"),
        ),
        Case(
            "probe_stats_torch",
            "pipeline, store=stats, stats.backend=torch (the portable reference)",
            lambda s: oracles.probe_case(s, "store=stats", "stats.backend=torch"),
        ),
        *gpu_cases(args),
        *(full_capture(*row) for row in FULL_CAPTURE),
        Case(
            "probe_grads",
            f"pipeline, probes={g} (output + grad_output)",
            lambda s: oracles.probe_case(s, f"probes={g}"),
            floor="plain_forward_backward",
            check=(("output", "grad_output"), None, True),
        ),
        Case(
            "naive_clone_torch_save",
            "forward hooks clone into lists, torch.save at the end",
            oracles.naive_clone_torch_save,
        ),
        Case(
            "hooks_h5py_sync",
            "forward hooks write h5py inside the hook",
            oracles.hooks_h5py_sync,
        ),
        Case(
            "fx_extractor_h5py",
            "torchvision create_feature_extractor + h5py",
            oracles.fx_extractor_h5py,
        ),
        Case("torchlens_h5py", "torchlens.extract + h5py", torchlens_h5py, peer="torchlens"),
        Case("nnsight_h5py", "nnsight trace + .save() + h5py", nnsight_h5py, peer="nnsight"),
    ]


# the pipeline's full-capture cases, each file checked against the plain hooks' outputs:
# (name, what, overrides, storage dtype, chunks spanning batches)
FULL_CAPTURE = [
    ("probe_full", "pipeline, full capture, uncompressed (the default)", "store.compression=none"),
    (
        "probe_full_torch",
        "pipeline, full capture, stats.backend=torch",
        "store.compression=none stats.backend=torch",
    ),
    ("probe_full_lzf", "pipeline, full capture, lzf", "store.compression=lzf"),
    (
        "probe_full_lzf_spanning",
        "pipeline, lzf, chunks spanning batches (the earlier layout: rewritten at each flush, "
        "not kill-safe)",
        "store.compression=lzf",
        None,
        True,
    ),
    (
        "probe_full_gzip1",
        "pipeline, full capture, gzip level 1",
        "store.compression=gzip store.compression_level=1",
    ),
    ("probe_full_f16", "pipeline, full capture, float16 storage", "", "float16"),
]


def full_capture(name: str, what: str, overrides: str, dtype=None, span=False) -> Case:
    def build(setup):
        case = oracles.probe_case(setup, *overrides.split(), dtype=dtype)
        return spanning(case) if span else case

    return Case(name, what, build, check=(("output",), dtype, False))


def gpu_cases(args) -> list[Case]:
    """On a GPU: statistics reduced on the host as before the torch backend (every capture
    copied over), beside probe_stats, which reduces them on the device."""
    if not args.device.startswith("cuda"):
        return []
    return [
        Case(
            "probe_stats_host",
            "pipeline, store=stats, stats.backend=numba: every capture copied to the host",
            lambda s: oracles.probe_case(s, "store=stats", "stats.backend=numba"),
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
    p.add_argument(
        "--out", default=str(bc.ROOT / "docs" / "bench" / "pipeline"), help="writes OUT.csv, OUT.md"
    )
    p.add_argument("--tmp", default=None, help="where cases write their files")
    p.add_argument(
        "--counts",
        action="store_true",
        help="no timing: what a stats-only run's batch moves to the host per site, on the path "
        "a GPU's values take (--device cuda: on the GPU; cpu: its branches, counted on the CPU)",
    )
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


# -- the bench's own cases: plain PyTorch floors and peers ------------------------------------
def plain_forward(setup) -> Callable:
    def case(out: Path) -> None:
        with torch.inference_mode():
            for b in setup.base.batches:
                setup.model(b.inputs.to(setup.base.device))

    return case


def plain_forward_backward(setup) -> Callable:
    def case(out: Path) -> None:
        model, dev = setup.model, setup.base.device
        for b in setup.base.batches:
            loss = F.cross_entropy(model(b.inputs.to(dev)), b.targets.to(dev), reduction="sum")
            loss.backward()
            model.zero_grad(set_to_none=True)

    return case


def spanning(case: Callable) -> Callable:
    """`case` with compressed chunks spanning several batches, as before they were kill-safe."""
    from probe.store import chunks

    def spanned(out: Path):
        chunks.COMPRESSED_CHUNKS_SPAN = True
        try:
            return case(out)
        finally:
            chunks.COMPRESSED_CHUNKS_SPAN = False

    return spanned


def torchlens_h5py(setup) -> Callable:
    import torchlens

    layers = {n: n for n in setup.names}

    def extract(x):
        with torch.no_grad():
            return torchlens.extract(setup.model, x, layers)

    return oracles.extracted_to_h5(setup, extract, "torchlens.h5")


def nnsight_h5py(setup) -> Callable:
    from nnsight import NNsight

    wrapped = NNsight(setup.model)
    envoys = []
    for n in setup.names:
        e = wrapped
        for part in n.split("."):
            e = e[int(part)] if part.isdigit() else getattr(e, part)
        envoys.append((n, e))

    def extract(x):
        saved = {}
        with torch.no_grad(), wrapped.trace(x):
            for n, e in envoys:
                saved[n] = e.output.save()
        return saved

    return oracles.extracted_to_h5(setup, extract, "nnsight.h5")


def interleave(cases: dict, reps: int, tmp: Path) -> dict:
    """A warm-up pass (its files stay in tmp/warm-NAME for the value check), then `reps` rounds
    of every case in turn; {name: [bench_common.timed(), ...]}."""
    bc.warm_up(cases, tmp, keep=cases)
    return bc.rounds(cases, reps, tmp)


def subprocess_json(flag: str, name: str) -> dict:
    """This script in a fresh process with this run's arguments (its --cases hold `name`) and
    `flag name`; the JSON line it printed, or {"error": ...}."""
    return bc.child_json([__file__, *sys.argv[1:], flag, name])


def main(argv=None) -> None:
    args = parse_args(argv)
    cases = catalogue(args)
    if args.cases:
        wanted = set(args.cases.split(","))
        cases = [c for c in cases if c.name in wanted or c.name.startswith("plain_")]
    by_name = {c.name: c for c in cases}
    tmp = Path(tempfile.mkdtemp(prefix="probe-bench-", dir=args.tmp))
    if args.counts:
        try:
            print(stats_counts(args, tmp), flush=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return
    try:
        setup = oracles.make_setup(overrides(args))
        if args.one:
            by_name[args.one].build(setup)(tmp)
            print(json.dumps({"peak_rss_mb": bc.peak_rss_mb()}))
            return
        if args.isolated:
            fns = {"plain_forward": plain_forward(setup)}
            fns[args.isolated] = by_name[args.isolated].build(setup)
            print(json.dumps(interleave(fns, args.reps, tmp)))
            return
        report(args, setup, cases, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def stats_counts(args, tmp: Path) -> str:
    """A stats-only run (`stats.backend=torch`, the fused reduction: a GPU's path) of the bench's
    model and batches, counted per batch: the copies its statistics ask of
    probe.hooks.device.copy_to_host and their bytes per site, the values read into Python
    (`aten._local_scalar_dense`) in the statistics' per-batch path, and, for comparison, the
    bytes per site of each site's whole packed batch, which the path before this one copied to
    the host per site and per batch (one copy each); and the operations that launch a kernel
    (views left out) the statistics' per-batch path makes per site. A markdown table."""
    from bench_watch import VIEWS
    from torch.utils._python_dispatch import TorchDispatchMode

    from probe.hooks import device as devices
    from probe.launch import run as run_module
    from probe.launch.parts.statistics import Statistics
    from probe.launch.run import run
    from probe.stats import device_fetch, device_sketch, torch_backend
    from probe.testing.compose import make_cfg

    class Reads(TorchDispatchMode):
        n = 0  # values read into Python
        ops = 0  # operations that launch a kernel (on a GPU)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                Reads.n += 1
            elif str(func) not in VIEWS:
                Reads.ops += 1
            return func(*args, **(kwargs or {}))

    def reading(method):
        def wrapped(*a, **kw):
            with Reads():
                return method(*a, **kw)

        return wrapped

    copies: list[tuple[bool, int]] = []  # (made to write /stats, values)
    packed: list[int] = []
    real_copy, real_pack = device_sketch.copy_to_host, torch_backend.packed_on_device
    real_fetch_copy = device_fetch.copy_to_host
    real_host, saved = torch_backend._host, (Statistics.took, Statistics.after_forward)

    def copy(t):  # (a batch's copy)
        copies.append((False, t.numel()))
        return real_copy(t)

    def fetch_copy(t):  # (the sketches' and units' copy, made to write /stats)
        copies.append((True, t.numel()))
        return real_fetch_copy(t)

    handed: list[int] = []  # bytes a batch hands to probe.hooks.device.to_host (a GPU's copied)
    real_to_host = devices.to_host

    def to_host(*groups):
        handed.append(sum(t.numel() * t.element_size() for g in groups for t in g.values()))
        return real_to_host(*groups)

    def pack(x, *a):
        out = real_pack(x, *a)
        packed.append(out[0].numel() * 8)
        return out

    device_sketch.copy_to_host, device_fetch.copy_to_host = copy, fetch_copy
    devices.to_host = to_host
    torch_backend.packed_on_device = pack
    if args.device == "cpu":
        torch_backend._host = lambda device: False  # (the branches a GPU takes)
    torch_backend.use_reduction("fused")
    Statistics.took, Statistics.after_forward = (reading(m) for m in saved)
    put = run_module.Sink.put
    folded: list[int] = []  # operations so far at the end of each batch's hand-over

    def handing(*a, **kw):
        with Reads():
            out = put(*a, **kw)
        folded.append(Reads.ops)
        return out

    run_module.Sink.put = handing  # (a stats-only CPU batch is folded as it is handed over)
    try:
        cfg = make_cfg(*overrides(args), "store.mode=stats", "stats.backend=torch",
                       "store.flush_seconds=3600")  # fmt: skip
        sites = len(run(cfg, run_dir=tmp / "counts").summary)
    finally:
        device_sketch.copy_to_host, device_fetch.copy_to_host = real_copy, real_fetch_copy
        devices.to_host = real_to_host
        torch_backend.packed_on_device = real_pack
        torch_backend._host = real_host
        torch_backend.use_reduction(None)
        Statistics.took, Statistics.after_forward = saved
        run_module.Sink.put = put
    per_batch = [n for written, n in copies if not written]
    ended = [n for written, n in copies if written]
    rows = [
        ["before (each site's packed batch, sketch included)", sites, sites,
         f"{sum(packed) / len(per_batch) / sites:,.0f}", "-", "-", "-", "-"],
        ["after (sketches and units merged on the device)", sites,
         len(per_batch) / args.batches, f"{sum(per_batch) * 8 / len(per_batch) / sites:,.0f}",
         Reads.n / args.batches,
         f"{Reads.ops / args.batches / sites:.1f} "
         f"({(folded[-1] - folded[0]) / max(len(folded) - 1, 1) / sites:.1f} after the first)",
         f"{sum(handed) / len(handed):,.0f}", f"{len(ended)} ({', '.join(f'{n * 8:,} bytes' for n in ended)})"],
    ]  # fmt: skip
    return bc.markdown(
        [f"### A stats-only run's batch on a GPU's path ({args.model}, {args.probes}, batch "
         f"{args.batch}, {args.image_size} px, {args.batches} batches, device {args.device})"],
        ["path", "sites", "copies to the host a batch", "bytes per site a batch",
         "values read a batch", "kernel ops per site a batch (main thread)",
         "bytes a batch's record hands to_host", "copies of sketches and units at the end"],
        rows, [],
    )  # fmt: skip


def report(args, setup, cases: list[Case], tmp: Path) -> None:
    import pandas as pd

    notes = []
    local = {c.name: c.build(setup) for c in cases if c.peer is None}
    print(f"timing {len(local)} cases x {args.reps} interleaved repetitions ...", flush=True)
    times = interleave(local, args.reps, tmp)
    medians = {n: bc.median(ts) for n, ts in times.items()}
    on_disk = {n: bc.median(ts, "durable") for n, ts in times.items()}
    written = {n: ts[0]["bytes"] for n, ts in times.items()}
    floors = dict(medians)
    for c in cases:
        if c.peer is None:
            continue
        if importlib.util.find_spec(c.peer) is None:
            notes.append(f"{c.name}: skipped, {c.peer} is not installed (pip install {c.peer})")
            continue
        print(f"timing {c.name} in its own process ...", flush=True)
        got = subprocess_json("--isolated", c.name)
        if "error" in got:
            notes.append(f"{c.name}: failed: {got['error']}")
            continue
        medians[c.name] = bc.median(got[c.name])
        on_disk[c.name] = bc.median(got[c.name], "durable")
        floors[c.name] = bc.median(got["plain_forward"])
        written[c.name] = got[c.name][0]["bytes"]
        notes.append(
            f"{c.name}: ratio to the plain forward timed in its own process "
            f"({floors[c.name]:.3f} s there)"
        )
    equal = check_values(setup, cases, tmp)
    rows = []
    for c in cases:
        if c.name not in medians:
            continue
        rss = None if args.no_rss else subprocess_json("--one", c.name).get("peak_rss_mb")
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
    rows = table.itertuples(index=False)
    out.with_suffix(".md").write_text(
        bc.markdown([f"_{header}_"], list(table.columns), rows, notes)
    )
    print(f"wrote {out.with_suffix('.csv')} and {out.with_suffix('.md')}")


def check_values(setup, cases: list[Case], tmp: Path) -> dict[str, str]:
    """For each probe case, whether its warm-up file equals the plain hooks' reference values."""
    refs, equal = {}, {}
    for c in cases:
        h5 = tmp / f"warm-{c.name}" / "probe.h5"
        if c.check is None or not h5.exists():
            continue
        sites, dtype, grads = c.check
        if grads not in refs:
            refs[grads] = oracles.reference_values(setup, grads=grads)
        ok, why = oracles.stored_values_match(h5, refs[grads], sites, dtype)
        equal[c.name] = "yes" if ok else f"NO: {why}"
    return equal


if __name__ == "__main__":
    main()
