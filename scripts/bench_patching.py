"""Benchmark: an activation-patching grid (every block's output at every position) against a hand loop.

    python scripts/bench_patching.py                       # 64 pairs x 32 tokens, 3 rounds
    python scripts/bench_patching.py --rounds 5 --threads 1 --out docs/bench/patching.md

A GPT-2-shaped model (6 layers, width 256, 4 heads, vocab 5000, seeded random init, written with
save_pretrained) and seeded clean/corrupt pairs (a pairs .pt, all pairs in one batch); a 6 x T grid
of block outputs denoised from clean into corrupt, logit difference at the last position. Variants,
interleaved per round after one warm-up each, over the same model object: the hand loop of plain
hooks (the floor, as in FIELD-NOTES), the same with logits_to_keep=1, the pipeline
(intervene=patch_grid, stack 1 and 2, its loop alone via a prepared plan) and TransformerLens when
it imports. Values are checked once against the hand loop.
"""

from __future__ import annotations

import cProfile
import datetime
import io
import json
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import bench_common as bc  # first: it puts the repository root on sys.path
from bench_common import HEADS, LAYERS, VOCAB, WIDTH

CORRUPTED = 3  # positions at which corrupt differs from clean
TARGET = 1.1  # the target: the pipeline within 1.1x of the hand loop
RTOL, ATOL = 1e-4, 1e-6  # the value check (atol only for logit differences near 0)
FLOOR = "hand_loop"
WHAT = {
    "hand_loop": "plain hooks: 1 clean forward cached, 1 patched forward per cell (full logits)",
    "hand_loop_keep1": "the same with logits_to_keep=1 (reference)",
    "probe": "pipeline, intervene=patch_grid, stack 1",
    "probe_stack2": "pipeline, intervene.grid.stack=2 (reference)",
    "transformer_lens": "TransformerLens patching.get_act_patch_resid_pre (192 cells)",
}


def parse_args(argv=None):
    p = bc.token_parser(__doc__, rounds=3)
    p.add_argument("--pairs", type=int, default=64, help="clean/corrupt pairs, one batch (64)")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per pair half (default 32)")
    p.add_argument("--profile", action="store_true", help="profile one pipeline run regardless")
    return p.parse_args(argv)


# -- the model and the pairs -------------------------------------------------------------------
def write_assets(root: Path, args) -> tuple[Path, Path, dict]:
    """A seeded random GPT-2 written with save_pretrained, and a pairs .pt: clean ids, corrupt
    ids differing at CORRUPTED positions (the same ones in every pair, never the last), one
    answer and one wrong id per pair."""
    import torch

    model_dir = root / "model"
    bc.save_gpt2(model_dir, max(32, args.seq_len), args.seed)
    g = torch.Generator().manual_seed(args.seed + 1)
    n, t = args.pairs, args.seq_len
    clean = torch.randint(0, VOCAB, (n, t), generator=g)
    corrupt = clean.clone()
    where = torch.randperm(t - 1, generator=g)[: min(CORRUPTED, t - 1)]
    shift = torch.randint(1, VOCAB, (n, len(where)), generator=g)
    corrupt[:, where] = (clean[:, where] + shift) % VOCAB  # a different id at each
    pairs = {
        "clean_ids": clean,
        "corrupt_ids": corrupt,
        "answer": torch.randint(0, VOCAB, (n,), generator=g),
        "wrong": torch.randint(0, VOCAB, (n,), generator=g),
    }
    pairs_path = root / "pairs.pt"
    torch.save(pairs, pairs_path)
    return model_dir, pairs_path, pairs


# -- the variants ------------------------------------------------------------------------------
def hand_loop(model, pairs: dict, keep_last: bool = False) -> dict:
    """The floor: plain forward hooks on every block, one clean forward recording each block's
    output, the corrupt forward (the metric's baseline), then one forward of the corrupt ids per
    (block, position) with a hook putting the clean value at that position; the logit difference
    at the last position per pair. {"cells": (cells, N), "target": (N,), "source": (N,)}."""
    import torch

    blocks = list(model.transformer.h)
    clean, corrupt = pairs["clean_ids"], pairs["corrupt_ids"]
    rows = torch.arange(len(clean))
    answer, wrong = pairs["answer"], pairs["wrong"]
    kw = {"logits_to_keep": 1} if keep_last else {}

    def diff(ids) -> torch.Tensor:
        x = model(input_ids=ids, **kw).logits[:, -1].double()
        return x[rows, answer] - x[rows, wrong]

    def first(o):
        return o[0] if isinstance(o, tuple) else o

    seen: dict[int, torch.Tensor] = {}
    with torch.inference_mode():
        handles = [
            b.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(i, first(o).clone()))
            for i, b in enumerate(blocks)
        ]
        try:
            source = diff(clean)
        finally:
            for h in handles:
                h.remove()
        target = diff(corrupt)
        cells = []
        for i, block in enumerate(blocks):
            src = seen[i]
            for p in range(clean.shape[1]):

                def patch(m, a, o, src=src, p=p):
                    first(o)[:, p] = src[:, p]  # in place: inference mode, nothing reads it later
                    return o

                h = block.register_forward_hook(patch)
                try:
                    cells.append(diff(corrupt))
                finally:
                    h.remove()
    return {"cells": torch.stack(cells).numpy(), "target": target.numpy(), "source": source.numpy()}


def probe_cfg(model_dir: Path, pairs_path: Path, batch: int, stack: int):
    from hydra import compose, initialize_config_dir

    from probe.config import config_dir

    overrides = [
        "print_summary=false",
        "progress=false",
        "model=hf",
        f"model.name={model_dir}",
        "model.task=causal_lm",
        "dataset=pairs",
        f"dataset.path={pairs_path}",
        f"dataset.batch_size={batch}",
        "probes=none",
        "intervene=patch_grid",
        "intervene.metrics=[logit_diff]",
        f"intervene.grid.stack={stack}",
        "device=cpu",
    ]
    with initialize_config_dir(version_base="1.3", config_dir=config_dir()):
        return compose("config", overrides=overrides)


def transformer_lens_variant(pairs: dict, seq_len: int, seed: int) -> tuple[Callable | None, str]:
    """TransformerLens's own layer x position patching of the residual stream (resid_pre: each
    block's input, the same 6 x T cells) on a HookedTransformer of the same shape, seeded random
    weights; (None, why) where transformer_lens does not import."""
    try:
        import torch
        from transformer_lens import HookedTransformer, HookedTransformerConfig, patching
    except Exception as e:  # noqa: BLE001 - any import failure means skip
        return None, (
            f"transformer_lens: skipped, it does not import ({type(e).__name__}: {e}); "
            "pip install transformer_lens to time it"
        )
    cfg = HookedTransformerConfig(
        n_layers=LAYERS,
        d_model=WIDTH,
        n_heads=HEADS,
        d_head=WIDTH // HEADS,
        d_mlp=4 * WIDTH,
        d_vocab=VOCAB,
        n_ctx=max(32, seq_len),
        act_fn="gelu_new",
        normalization_type="LN",
        seed=seed,
        device="cpu",
    )
    model = HookedTransformer(cfg).eval()
    clean, corrupt = pairs["clean_ids"], pairs["corrupt_ids"]
    rows = torch.arange(len(clean))
    answer, wrong = pairs["answer"], pairs["wrong"]

    def metric(logits):
        x = logits[:, -1].double()
        return (x[rows, answer] - x[rows, wrong]).mean()

    def fn(out: Path):
        with torch.inference_mode():
            _, cache = model.run_with_cache(clean)
            return patching.get_act_patch_resid_pre(model, corrupt, cache, metric)

    return fn, "transformer_lens: resid_pre (block inputs), a scalar metric per cell (its API)"


# -- the value checks --------------------------------------------------------------------------
def check_values(run_dir: Path, hand: dict, hand_keep1: dict, seq_len: int) -> list[str]:
    """Every cell of the pipeline's /patching/logit_diff equals the hand loop's, and the last
    block at the last position gives normalized 1 in patching.csv; raises SystemExit if not."""
    import h5py
    import numpy as np
    import pandas as pd

    lines, failed = [], []
    with h5py.File(run_dir / "probe.h5", "r") as f:
        got = f["patching/logit_diff"][:]  # (samples, cells)
        cells = json.loads(f.attrs["patching_cells"])
        target, source = f["patching/logit_diff_target"][:], f["patching/logit_diff_source"][:]
    order = [int(c["layer"].rsplit(".", 1)[1]) * seq_len + c["position"] for c in cells]
    for name, ref in (("hand_loop", hand), ("hand_loop_keep1", hand_keep1)):
        want = ref["cells"][order].T
        ok = got.shape == want.shape and np.allclose(got, want, rtol=RTOL, atol=ATOL)
        ok = ok and np.allclose(target, ref["target"], rtol=RTOL, atol=ATOL)
        ok = ok and np.allclose(source, ref["source"], rtol=RTOL, atol=ATOL)
        err = float(np.abs(got - want).max()) if got.shape == want.shape else float("nan")
        lines.append(
            f"values: probe /patching/logit_diff {got.shape} vs {name}: "
            f"{'EQUAL' if ok else 'DIFFERENT'} (rtol {RTOL:g}, atol {ATOL:g}; max |diff| "
            f"{err:.2e}; target and source columns too)"
        )
        if not ok:
            failed.append(name)
    table = pd.read_csv(run_dir / "patching.csv")
    last = table[
        (table.layer == f"transformer.h.{LAYERS - 1}")
        & (table.position == seq_len - 1)
        & (table.metric == "logit_diff")
    ]
    norm = float(last.normalized.iloc[0]) if len(last) == 1 else float("nan")
    ok = abs(norm - 1) <= RTOL
    lines.append(
        f"values: patching.csv transformer.h.{LAYERS - 1} at position {seq_len - 1}: normalized "
        f"{norm:.8f} ({'is 1' if ok else 'NOT 1'}, tolerance {RTOL:g})"
    )
    if not ok:
        failed.append("normalized")
    for line in lines:
        print(line, flush=True)
    if failed:
        raise SystemExit(f"value check failed: {', '.join(failed)}")
    return lines


# -- the profile -------------------------------------------------------------------------------
PARTS = [  # (label, file suffix, function name): where a pipeline run spends its time
    tuple(part.split(" @ "))
    for part in (
        "model forwards (GPT2LMHeadModel) @ transformers/models/gpt2/modeling_gpt2.py @ forward",
        "grid hook: Grid._patched @ probe/intervene/grid.py @ _patched",
        "  Region.mask @ probe/intervene/patch_steer.py @ mask",
        "metrics.value (per cell) @ probe/intervene/metrics.py @ value",
        "Interventions._cells @ probe/intervene/passes.py @ _cells",
        "Grid.run_cells @ probe/intervene/grid.py @ run_cells",
        "capture.begin/end @ probe/hooks/capture.py @ begin",
        "writer.put @ probe/store/writer.py @ put",
        "writer.close @ probe/store/writer.py @ close",
        "ProbeWriter() @ probe/store/writer.py @ __init__",
        "report: patching_table @ probe/intervene/grid.py @ patching_table",
        "report: heatmap @ probe/intervene/grid.py @ heatmap",
        "summary_frame @ probe/read/summaries.py @ summary_frame",
    )
]


def profile_probe(fn: Callable, out: Path, hand_s: float) -> list[str]:
    """cProfile of one pipeline run: the top functions by cumulative time, and the parts."""
    out.mkdir(parents=True, exist_ok=True)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    fn(out)
    prof.disable()
    wall = time.perf_counter() - t0
    shutil.rmtree(out, ignore_errors=True)
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("cumulative").print_stats(30)
    lines = [f"profile: one pipeline run (stack 1) under cProfile, {wall:.2f} s wall"]
    lines += [f"  (the hand loop's median, unprofiled: {hand_s:.2f} s)"]
    raw = stats.stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
    parts = {}
    for (path, _, name), (_, calls, _, cum, _) in raw.items():
        for label, suffix, fname in PARTS:
            # the outermost of same-named functions (e.g. every module's forward): the largest
            if path.endswith(suffix) and name == fname and cum > parts.get(label, (0, -1.0))[1]:
                parts[label] = (calls, cum)
    for label, _, _ in PARTS:
        if label in parts:
            calls, cum = parts[label]
            lines.append(
                f"  {label:<34} {cum:7.3f} s  {100 * cum / wall:5.1f}%  {calls:6d} calls  "
                f"{1e3 * cum / max(calls, 1):8.3f} ms/call"
            )
    label = PARTS[0][0]
    if label in parts:
        calls, cum = parts[label]
        lines.append(
            f"  outside the model forwards: {wall - cum:.3f} s ({100 * (wall - cum) / wall:.1f}%, "
            f"{1e3 * (wall - cum) / max(calls, 1):.3f} ms per forward)"
        )
    lines.append("  top 30 by cumulative time:")
    lines += ["    " + ln for ln in text.getvalue().splitlines() if ln.strip()][:60]
    for line in lines:
        print(line)
    return lines


# -- the table ---------------------------------------------------------------------------------
def table_rows(got: dict, rss: dict, threads: int, work: int) -> list[dict]:
    rows = []
    for name, runs in got.items():
        util = [r["cpu"] / (threads * r["wall"]) for r in runs]
        med = bc.median(runs)
        rows.append(
            {
                "variant": name,
                "median_s": f"{med:.2f}",
                "x_hand_loop": f"{statistics.median(bc.ratios(runs, got[FLOOR])):.3f}",
                "cells_x_pairs_per_s": f"{work / med:.0f}",
                "cpu_util": f"{statistics.median(util):.2f}",
                "max_rss_mb": f"{rss[name]:.0f}",
                "what": WHAT[name],
            }
        )
    return rows


def render(rows: list[dict]) -> str:
    cols = list(rows[0])
    width = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols}
    lines = ["  ".join(c.ljust(width[c]) for c in cols)]
    lines += ["  ".join(r[c].ljust(width[c]) for c in cols) for r in rows]
    return "\n".join(ln.rstrip() for ln in lines)


# -- main --------------------------------------------------------------------------------------
def main(argv=None) -> None:
    args = parse_args(argv)
    import torch
    import transformers

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    from probe.launch.run import build_run, run

    tmp = Path(tempfile.mkdtemp(prefix="probe-bench-patching-", dir=args.tmp))
    try:
        model_dir, pairs_path, pairs = write_assets(tmp, args)
        cfgs = {k: probe_cfg(model_dir, pairs_path, args.pairs, k) for k in (1, 2)}
        prepared = build_run(cfgs[1])  # model and batches once; stack only changes the loop
        model = prepared.model.eval()  # the hand loops run on the pipeline's own model object
        variants: dict[str, Callable] = {
            "hand_loop": lambda out: hand_loop(model, pairs),
            "hand_loop_keep1": lambda out: hand_loop(model, pairs, keep_last=True),
            "probe": lambda out: run(cfgs[1], run_dir=out, prepared=prepared),
            "probe_stack2": lambda out: run(cfgs[2], run_dir=out, prepared=prepared),
        }
        notes = []
        tl, why = transformer_lens_variant(pairs, args.seq_len, args.seed)
        if tl is not None:
            variants["transformer_lens"] = tl
        notes.append(why)
        print(why, flush=True)
        cells = LAYERS * args.seq_len
        work = cells * args.pairs

        rss = {"setup": bc.peak_rss_mb()}
        print(f"max RSS after setup (process maximum): {rss['setup']:.0f} MB", flush=True)

        def after(name: str) -> None:
            rss[name] = bc.peak_rss_mb()
            print(f"warm-up {name:<18} max RSS after it (process maximum): {rss[name]:.0f} MB")

        # one warm-up each; its outputs serve the checks
        warm = bc.warm_up(variants, tmp, keep={"probe"}, after=after)
        checks = check_values(
            tmp / "warm-probe", warm["hand_loop"], warm["hand_loop_keep1"], args.seq_len
        )
        shutil.rmtree(tmp / "warm-probe", ignore_errors=True)

        print(
            f"timing {len(variants)} variants x {args.rounds} interleaved rounds, {threads} threads"
        )
        got = bc.rounds(variants, args.rounds, tmp, threads)
        rss["end"] = bc.peak_rss_mb()
        print(f"max RSS at the end (process maximum): {rss['end']:.0f} MB")
        rows = table_rows(got, rss, threads, work)
        ratio = float(next(r["x_hand_loop"] for r in rows if r["variant"] == "probe"))
        verdict = [
            f"target: probe within {TARGET}x of the hand loop: {ratio:.3f}x: "
            f"{'met' if ratio <= TARGET else 'NOT met'}"
        ]
        if "transformer_lens" in got:
            p_s, tl_s = bc.median(got["probe"]), bc.median(got["transformer_lens"])
            verdict.append(
                f"target: probe faster than TransformerLens: {p_s:.2f} s vs {tl_s:.2f} s: "
                f"{'met' if p_s < tl_s else 'NOT met'}"
            )
        else:
            verdict.append(
                "target: probe faster than TransformerLens: not measured (not installed)"
            )
        for name in ("probe", "probe_stack2"):  # against the like-for-like floor
            per = bc.ratios(got[name], got["hand_loop_keep1"])
            notes.append(
                f"{name} / hand_loop_keep1 (both logits_to_keep=1) per round: "
                f"{', '.join(f'{x:.3f}' for x in per)} (median {statistics.median(per):.3f})"
            )
        per_round = "; ".join(
            n + " " + ", ".join(f"{t['wall']:.1f}" for t in ts) for n, ts in got.items()
        )
        notes.append(f"seconds per round: {per_round}")
        low = [r["variant"] for r in rows if float(r["cpu_util"]) < 0.9]
        if low:
            notes.append(
                f"cpu_util below 0.9 for {', '.join(low)}: a neighbour may have taken the cores; "
                "those figures are suspect"
            )
        header = (
            f"{LAYERS} layers x {args.seq_len} positions = {cells} cells (block outputs), "
            f"{args.pairs} pairs of {args.seq_len} tokens in one batch, logit_diff at the last "
            f"position; GPT-2 shape {LAYERS}x{WIDTH}, {HEADS} heads, vocab {VOCAB}; CPU, "
            f"{threads} threads; median of {args.rounds} interleaved rounds after a warm-up"
        )
        print(header)
        print(render(rows))
        for line in verdict + notes:
            print(line)
        prof = []
        if args.profile or ratio > TARGET:
            hand_s = bc.median(got[FLOOR])
            prof = profile_probe(variants["probe"], tmp / "profile", hand_s)
        if args.out:
            cmd = "python " + " ".join(
                [str(Path(sys.argv[0]).relative_to(bc.ROOT)) if Path(sys.argv[0]).is_absolute()
                 else sys.argv[0], *sys.argv[1:]]
            )  # fmt: skip
            head = [
                f"# Patching grid benchmark ({datetime.date.today().isoformat()})",
                "",
                f"`{cmd}`: torch {torch.__version__}, transformers {transformers.__version__}, "
                f"{os.cpu_count()} cores, {threads} torch threads.",
                "",
                f"_{header}_",
            ]
            extra = [
                "x_hand_loop: median of per-round ratios to the hand loop of the same round",
                "cpu_util: process CPU time / (threads x wall); near 1 means the cores were ours",
                "max_rss_mb: peak RSS (VmHWM) after the variant's warm-up, the process maximum so far "
                f"(after setup {rss['setup']:.0f} MB, at the end {rss['end']:.0f} MB)",
                *checks,
                *verdict,
                *notes,
            ]
            text = bc.markdown(head, list(rows[0]), [r.values() for r in rows], extra)
            if prof:
                text += "\n```\n" + "\n".join(prof) + "\n```\n"
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(text)
            print(f"wrote {args.out}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
