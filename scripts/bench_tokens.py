"""Benchmark: caching a causal LM's residual stream (every block output, one row per token).

    python scripts/bench_tokens.py                              # 512 x 128 tokens, batch 32, 5 rounds
    python scripts/bench_tokens.py --rounds 3 --samples 128 --threads 1 --out docs/bench/tokens.md

A GPT-2-shaped model (6 layers, width 256, 4 heads, vocab 5000, seeded random init, written with
save_pretrained and loaded by `model=hf model.name=DIR`) runs over seeded random token ids given as
a tokens .pt file (all-ones attention_mask). Variants, interleaved per round after one warm-up each,
over the same materialised batches and model: the plain HF forward under inference_mode; HF
`output_hidden_states=True` writing hidden_states[1..6] into chunked resizable h5py datasets; the
pipeline with probes=residual (store=full, store=stats); nnsight and TorchLens when installed (each
in its own subprocess, interleaved with a plain forward there). Per variant: median seconds, the
median of per-round ratios to the plain forward, tokens/s, CPU time / (threads x wall) (a figure
holds only near 1: below it, a neighbour took the cores), and the peak RSS increase of one run in a
fresh subprocess. The pipeline's full file is checked once against what a plain forward sees.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import bench_common as bc  # first: it puts the repository root on sys.path
from bench_common import HEADS, LAYERS, VOCAB, WIDTH

POSITIONS = 128
FULL_FLOOR = 1.3  # the floor for full capture
PEER_FULL, PEER_STATS = 1.05, 1.03  # the peers' figures to beat (FIELD-NOTES, 2026-11-24)
QUIET = 0.9  # a round is quiet when every variant's CPU time >= QUIET x threads x wall
PEERS = {
    "nnsight_h5py": "nnsight",
    "transformer_lens_h5py": "transformer_lens",
    "torchlens_h5py": "torchlens",
}


def parse_args(argv=None):
    p = bc.token_parser(__doc__, rounds=5)
    p.add_argument("--samples", type=int, default=512, help="sequences (default 512)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--batch", type=int, default=32, help="batch size (default 32)")
    p.add_argument("--no-rss", action="store_true", help="skip the per-variant RSS subprocesses")
    p.add_argument("--assets", help=argparse.SUPPRESS)  # subprocess: the parent's model and ids
    p.add_argument("--one", help=argparse.SUPPRESS)  # subprocess: one run of a variant, peak RSS
    p.add_argument("--isolated", help=argparse.SUPPRESS)  # subprocess: a peer vs the forward
    return p.parse_args(argv)


# -- the model, the data, the shared setup -----------------------------------------------------
def write_assets(assets: Path, args) -> tuple[Path, Path]:
    """A seeded random GPT-2 written with save_pretrained, and a tokens .pt of seeded ids."""
    import torch

    model_dir, ids_path = assets / "model", assets / "tokens.pt"
    if not (model_dir / "config.json").exists():
        bc.save_gpt2(model_dir, POSITIONS, args.seed)
    if not ids_path.exists():
        g = torch.Generator().manual_seed(args.seed)
        ids = torch.randint(0, VOCAB, (args.samples, args.seq_len), generator=g)
        torch.save({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, ids_path)
    return model_dir, ids_path


def make_setup(args, assets: Path):
    from probe.testing import oracles

    model_dir, ids_path = write_assets(assets, args)
    return oracles.make_setup(
        [
            "model=hf",
            f"model.name={model_dir}",
            "model.task=causal_lm",
            "dataset=tokens",
            f"dataset.path={ids_path}",
            f"dataset.batch_size={args.batch}",
            "probes=residual",
            f"seed={args.seed}",
        ]
    )


# -- the variants: each is `fn(out_dir)` -------------------------------------------------------
def plain(setup) -> Callable:
    import torch

    def case(out: Path) -> None:
        with torch.inference_mode():
            for b in setup.base.batches:
                setup.model(**b.inputs)

    return case


class RowSink:
    """Chunked, resizable (rows, C) float32 h5py datasets, appended batch by batch."""

    def __init__(self, path: Path):
        import h5py

        self.file, self.datasets = h5py.File(path, "w"), {}

    def append(self, name: str, t) -> None:
        a = t.detach().reshape(-1, t.shape[-1]).cpu().numpy()
        ds = self.datasets.get(name)
        if ds is None:
            ds = self.file.create_dataset(
                name,
                shape=(0, a.shape[1]),
                maxshape=(None, a.shape[1]),
                chunks=(max(1, (1 << 20) // (4 * a.shape[1])), a.shape[1]),  # 1 MB, as probe's
                dtype="float32",
            )
            self.datasets[name] = ds
        n = ds.shape[0]
        ds.resize(n + len(a), axis=0)
        ds[n:] = a

    def close(self) -> None:
        self.file.close()


def hidden_states_h5py(setup) -> Callable:
    """output_hidden_states=True; hidden_states[1..6] (the last one is after ln_f in GPT-2: written
    as given, for an equal byte count) appended to h5py as (N*T, C) rows."""
    import torch

    def case(out: Path) -> None:
        sink = RowSink(out / "hidden.h5")
        try:
            with torch.inference_mode():
                for b in setup.base.batches:
                    hs = setup.model(**b.inputs, output_hidden_states=True).hidden_states
                    for i, h in enumerate(hs[1:], start=1):
                        sink.append(f"hidden_states.{i}", h)
        finally:
            sink.close()

    return case


def probe_variant(setup, *overrides: str) -> Callable:
    from probe.testing import oracles

    return oracles.probe_case(setup, *overrides)


def block_names() -> list[str]:
    return [f"transformer.h.{i}" for i in range(LAYERS)]


def nnsight_h5py(setup) -> Callable:
    import torch
    from nnsight import NNsight

    wrapped = NNsight(setup.model)

    def case(out: Path) -> None:
        sink = RowSink(out / "nnsight.h5")
        try:
            for b in setup.base.batches:
                saved = []  # (nnsight runs the trace's body apart: a comprehension's name is lost)
                with torch.no_grad(), wrapped.trace(**b.inputs):
                    for i in range(LAYERS):
                        saved.append(wrapped.transformer.h[i].output.save())
                for name, s in zip(block_names(), saved, strict=True):
                    v = getattr(s, "value", s)
                    sink.append(name, v[0] if isinstance(v, tuple) else v)
        finally:
            sink.close()

    return case


def torchlens_h5py(setup) -> Callable:
    import torch
    import torchlens

    layers = {n: n for n in block_names()}

    def case(out: Path) -> None:
        sink = RowSink(out / "torchlens.h5")
        try:
            for b in setup.base.batches:
                with torch.no_grad():
                    got = torchlens.extract(setup.model, b.inputs["input_ids"], layers)
                for name, v in got.items():
                    sink.append(name, v[0] if isinstance(v, tuple) else v)
        finally:
            sink.close()

    return case


def transformer_lens_h5py(setup) -> Callable:
    """TransformerLens 4's TransformerBridge over the same saved HF model, run_with_cache of the
    6 blocks' resid_post, h5py."""
    import torch
    from transformer_lens.model_bridge import TransformerBridge

    model = TransformerBridge.boot_transformers(setup.cfg.model.name, device="cpu")
    wanted = {f"blocks.{i}.hook_resid_post" for i in range(LAYERS)}

    def case(out: Path) -> None:
        sink = RowSink(out / "transformer_lens.h5")
        try:
            for b in setup.base.batches:
                with torch.inference_mode():
                    _, cache = model.run_with_cache(
                        b.inputs["input_ids"], names_filter=lambda n: n in wanted
                    )
                for name in sorted(wanted):
                    sink.append(name, cache[name])
        finally:
            sink.close()

    return case


def local_variants(setup) -> dict[str, tuple[str, Callable]]:
    return {
        "plain": ("HF forward under inference_mode, no capture", plain(setup)),
        "hidden_states+h5py": (
            "output_hidden_states=True, hidden_states[1..6] to chunked h5py",
            hidden_states_h5py(setup),
        ),
        "probe_full": (
            "pipeline, probes=residual (rows: tokens), store=full",
            probe_variant(setup, "store=full"),
        ),
        "probe_full_rows_only": (
            "pipeline, store=full, stats.during=none (the rows, no statistics)",
            probe_variant(setup, "store=full", "stats.during=none"),
        ),
        "probe_stats": (
            "pipeline, probes=residual, store=stats",
            probe_variant(setup, "store=stats"),
        ),
    }


PEER_BUILD = {
    "nnsight_h5py": nnsight_h5py,
    "transformer_lens_h5py": transformer_lens_h5py,
    "torchlens_h5py": torchlens_h5py,
}
PEER_WHAT = {
    "nnsight_h5py": "nnsight trace + .save() of the 6 blocks, h5py",
    "transformer_lens_h5py": "TransformerLens 4 TransformerBridge run_with_cache of resid_post, h5py",
    "torchlens_h5py": "torchlens.extract of the 6 blocks, h5py",
}


# -- the value check ---------------------------------------------------------------------------
def check_values(setup, h5_path: Path) -> str:
    """The pipeline's /layers/transformer.h.{i}/output equals hidden_states[i+1] flattened for
    i < 5, and the last block's equals what a plain forward hook on transformer.h.5 sees; the token
    rows are in (sample, position) order. Raises SystemExit when they differ."""
    import h5py
    import numpy as np
    import torch

    last = block_names()[-1]
    seen = []
    handle = setup.model.get_submodule(last).register_forward_hook(
        lambda m, a, o: seen.append((o[0] if isinstance(o, tuple) else o).detach().clone())
    )
    worst, exact, row = 0.0, True, 0
    try:
        with h5py.File(h5_path, "r") as f, torch.inference_mode():
            if not f.attrs.get("complete"):
                raise SystemExit(f"value check: {h5_path} is not complete")
            for b in setup.base.batches:
                seen.clear()
                hs = setup.model(**b.inputs, output_hidden_states=True).hidden_states
                ids = b.inputs["input_ids"]
                n, t = ids.shape
                rows = slice(row, row + n * t)
                wants = {name: hs[i + 1] for i, name in enumerate(block_names()[:-1])}
                wants[last] = seen[0]
                for name, want in wants.items():
                    got = f[f"layers/{name}/output"][rows]
                    want = want.reshape(n * t, -1).numpy()
                    if got.shape != want.shape or got.dtype != want.dtype:
                        raise SystemExit(
                            f"value check FAILED: {name} rows {rows.start}..{rows.stop}: "
                            f"{got.dtype}{got.shape} != {want.dtype}{want.shape}"
                        )
                    if not np.array_equal(got, want):
                        exact = False
                        diff = float(np.abs(got.astype(np.float64) - want).max())
                        worst = max(worst, diff)
                        if not np.allclose(got, want, rtol=1e-5, atol=1e-6):
                            raise SystemExit(
                                f"value check FAILED: {name} rows {rows.start}..{rows.stop}: "
                                f"max |diff| {diff:.3g}"
                            )
                sample = np.repeat(np.arange(b.start, b.start + n), t)
                position = np.tile(np.arange(t), n)
                if not (
                    np.array_equal(f["tokens/sample"][rows], sample)
                    and np.array_equal(f["tokens/position"][rows], position)
                    and np.array_equal(f["tokens/id"][rows], ids.reshape(-1).numpy())
                ):
                    raise SystemExit(f"value check FAILED: /tokens rows {rows} out of order")
                row += n * t
            total = f[f"layers/{last}/output"].shape[0]
            if total != row:
                raise SystemExit(f"value check FAILED: {total} token rows, expected {row}")
    finally:
        handle.remove()
    if exact:
        return "values equal"
    return f"values equal within rtol 1e-5, atol 1e-6 (max |diff| {worst:.3g})"


# -- subprocesses: peak RSS of one run, and the peers ------------------------------------------
def child(args, flag: str, name: str, assets: Path) -> dict:
    keep = ("--threads", "--samples", "--seq-len", "--batch", "--seed", "--rounds")
    argv = []
    for k in keep:
        v = getattr(args, k[2:].replace("-", "_"))
        if v is not None:
            argv += [k, str(v)]
    if args.tmp:
        argv += ["--tmp", args.tmp]
    return bc.child_json([__file__, *argv, "--assets", str(assets), flag, name])


def run_child(args, setup, tmp: Path, threads: int) -> None:
    if args.one:
        variants = {n: fn for n, (_, fn) in local_variants(setup).items()}
        if args.one in PEER_BUILD:
            variants[args.one] = PEER_BUILD[args.one](setup)
        fn = variants[args.one]
        base = bc.status_mb("VmRSS")
        fresh = bc.reset_peak()
        bc.timed(fn, tmp / args.one)
        peak = bc.status_mb("VmHWM")
        print(json.dumps({"rss_increase_mb": peak - base, "reset": fresh}))
        return
    fns = {"plain": plain(setup), args.isolated: PEER_BUILD[args.isolated](setup)}
    bc.warm_up(fns, tmp)
    print(json.dumps(bc.rounds(fns, args.rounds, tmp)))


# -- the report --------------------------------------------------------------------------------
def quiet_rounds(times: dict[str, list[dict]], threads: int) -> list[bool]:
    """Per round, whether every variant ran with CPU time >= QUIET x threads x wall."""
    n = len(next(iter(times.values())))
    return [
        all(ts[r]["cpu"] >= QUIET * threads * ts[r]["wall"] for ts in times.values())
        for r in range(n)
    ]


def summarise(times: list[dict], floor: list[dict], quiet: list[bool], tokens, threads) -> dict:
    """Medians of one variant's rounds; ratios are taken per round (against the plain forward of
    the same round), then their median: over all rounds, over the quiet ones, and of CPU time."""
    ratios = bc.ratios(times, floor)
    calm = [x for x, q in zip(ratios, quiet, strict=True) if q]
    return {
        "median_s": bc.median(times),
        "x_plain": statistics.median(ratios),
        "x_quiet": statistics.median(calm) if calm else None,
        "x_cpu": statistics.median(bc.ratios(times, floor, "cpu")),
        "x_durable": statistics.median(bc.ratios(times, floor, "durable")),
        "sys_s": bc.median(times, "sys"),
        "faults_k": bc.median(times, "faults") / 1e3,
        "tokens_per_s": tokens / bc.median(times),
        "cpu_util": statistics.median(t["cpu"] / (threads * t["wall"]) for t in times),
        "mb_written": times[0]["bytes"] / 1e6,
    }


COLUMNS = [
    "variant",
    "median_s",
    "x_plain",
    "x_quiet",
    "x_cpu",
    "x_durable",
    "sys_s",
    "faults_k",
    "tokens_per_s",
    "cpu_util",
    "rss_mb",
    "mb_written",
]


def table_lines(rows: list[dict]) -> list[str]:
    cells = []
    for r in rows:
        rss, calm = r.get("rss_mb"), r["x_quiet"]
        cells.append(
            [
                r["variant"],
                f"{r['median_s']:.2f}",
                f"{r['x_plain']:.3f}",
                "-" if calm is None else f"{calm:.3f}",
                f"{r['x_cpu']:.3f}",
                f"{r['x_durable']:.3f}",
                f"{r['sys_s']:.2f}",
                f"{r['faults_k']:.0f}",
                f"{r['tokens_per_s']:,.0f}",
                f"{r['cpu_util']:.2f}",
                "-" if rss is None else f"{rss:.0f}",
                f"{r['mb_written']:.0f}",
            ]
        )
    return bc.table_lines(COLUMNS, cells)


def target_lines(by_name: dict) -> list[str]:
    out = []

    def mark(name, label, limit):
        if name not in by_name:
            return
        x, calm = by_name[name]["x_plain"], by_name[name]["x_quiet"]
        met = "met" if x <= limit else "NOT met"
        line = f"{label}: {name} {x:.3f}x <= {limit}x: {met}"
        if calm is not None:
            line += f" (quiet rounds alone: {calm:.3f}x, {'met' if calm <= limit else 'NOT met'})"
        out.append(line)

    mark("probe_full", "issue floor, full capture", FULL_FLOOR)
    mark("probe_full", "peers' figure, full capture", PEER_FULL)
    mark("probe_stats", "peers' figure, stats only", PEER_STATS)
    peers = [n for n in ("hidden_states+h5py", *PEERS) if n in by_name]
    if not peers:
        return out
    for key, what in (("x_plain", "wall"), ("x_cpu", "CPU")):
        best = min(peers, key=lambda n: by_name[n][key])
        floor = by_name[best][key]
        mark_at("probe_full_rows_only", f"the best peer ({best}), {what}", floor, key, out, by_name)
        if "probe_stats" in by_name:  # the rows at the peers' cost, plus what statistics take
            limit = floor + by_name["probe_stats"][key] - 1
            mark_at(
                "probe_full", f"the best peer + stats-only's cost, {what}", limit, key, out, by_name
            )
    return out


def mark_at(name: str, label: str, limit: float, key: str, out: list, by_name: dict) -> None:
    if name in by_name:
        x = by_name[name][key]
        out.append(
            f"{label}: {name} {x:.3f}x <= {limit:.3f}x: {'met' if x <= limit else 'NOT met'}"
        )


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    tmp = Path(tempfile.mkdtemp(prefix="probe-bench-tokens-", dir=args.tmp))
    assets = Path(args.assets) if args.assets else tmp / "assets"
    assets.mkdir(parents=True, exist_ok=True)
    try:
        setup = make_setup(args, assets)
        if args.one or args.isolated:
            run_child(args, setup, tmp, threads)
            return
        report(args, setup, tmp, assets, threads)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def report(args, setup, tmp: Path, assets: Path, threads: int) -> None:
    import torch
    import transformers

    tokens = args.samples * args.seq_len
    variants = local_variants(setup)
    fns = {n: fn for n, (_, fn) in variants.items()}
    notes = []
    print(f"warm-up: one run of each of {len(fns)} variants ...", flush=True)
    bc.warm_up(fns, tmp, keep={"probe_full"})
    equal = check_values(setup, tmp / "warm-probe_full" / "probe.h5")
    shutil.rmtree(tmp / "warm-probe_full", ignore_errors=True)
    print(equal, flush=True)
    print(f"timing {len(fns)} variants x {args.rounds} interleaved rounds ...", flush=True)
    times = bc.rounds(fns, args.rounds, tmp, threads)
    quiet = quiet_rounds(times, threads)
    rows = []
    for n, (what, _) in variants.items():
        rows.append(
            {
                "variant": n,
                "what": what,
                **summarise(times[n], times["plain"], quiet, tokens, threads),
            }
        )
    for n, module in PEERS.items():
        if importlib.util.find_spec(module) is None:
            notes.append(f"{n}: skipped, {module} is not installed (pip install {module})")
            continue
        print(f"timing {n} in its own process, interleaved with a plain forward ...", flush=True)
        got = child(args, "--isolated", n, assets)
        if "error" in got:
            notes.append(f"{n}: failed: {got['error']}")
            continue
        calm = quiet_rounds(got, threads)
        rows.append(
            {
                "variant": n,
                "what": PEER_WHAT[n],
                **summarise(got[n], got["plain"], calm, tokens, threads),
            }
        )
        plain_s = bc.median(got["plain"])
        notes.append(f"{n}: ratio to the plain forward timed in its own process ({plain_s:.2f} s)")
    if not args.no_rss:
        print("peak RSS: one run of each variant in a fresh process ...", flush=True)
        for r in rows:
            got = child(args, "--one", r["variant"], assets)
            r["rss_mb"] = got.get("rss_increase_mb")
            if "error" in got:
                notes.append(f"{r['variant']} RSS: failed: {got['error']}")
            elif not got.get("reset"):
                notes.append(f"{r['variant']} RSS: peak not reset, includes the set-up's")
    by_name = {r["variant"]: r for r in rows}
    utils = [t["cpu"] / (threads * t["wall"]) for ts in times.values() for t in ts]
    if min(utils) < QUIET:
        notes.append(
            f"noise: cpu/(threads x wall) went down to {min(utils):.2f} in some runs (a busy "
            f"neighbour); {sum(quiet)} of {len(quiet)} rounds were quiet (every variant >= "
            f"{QUIET}); x_quiet is the median ratio over those"
        )
    header = (
        f"GPT-2-shaped causal LM ({LAYERS} layers, width {WIDTH}, {HEADS} heads, vocab {VOCAB}, "
        f"random init), {args.samples} sequences x {args.seq_len} tokens (no padding), batch "
        f"{args.batch}, the {LAYERS} block outputs; CPU, {threads} torch threads of "
        f"{os.cpu_count()} cores; median of {args.rounds} interleaved rounds, x_plain = median "
        f"of per-round ratios to the plain forward (x_quiet: over the quiet rounds, where every "
        f"variant's CPU time >= {QUIET} x threads x wall; x_cpu: of process CPU time; x_durable: "
        f"of the seconds until the files are on disk, fsync included; sys_s: kernel CPU seconds "
        f"and faults_k: minor page faults (thousands) of a run, medians)"
    )
    versions = (
        f"{datetime.date.today()}, {platform.machine()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}"
    )
    lines = table_lines(rows)
    targets = target_lines(by_name)
    print()
    print(header)
    print(versions)
    print(equal)
    print("\n".join(lines))
    for r in rows:
        print(f"  {r['variant']}: {r['what']}")
    print("targets:")
    for t in targets:
        print("  " + t)
    for n in notes:
        print("note:", n)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        command = " ".join(["python scripts/bench_tokens.py", *sys.argv[1:]])
        body = [
            "# Token models: caching the residual stream",
            "",
            f"_{header}._",
            "",
            f"{versions}; command: `{command.strip()}`",
            "",
            *lines,
            "",
            *[f"- `{r['variant']}`: {r['what']}" for r in rows],
            "",
            f"Value check: {equal} (probe_full's /layers/transformer.h.i/output against "
            "hidden_states[i+1], the last block against a forward hook on transformer.h.5).",
            "",
            "Targets:",
            "",
            *[f"- {t}" for t in targets],
            "",
            *[f"- note: {n}" for n in notes],
        ]
        out.write_text("\n".join(body).rstrip() + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
