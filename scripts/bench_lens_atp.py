"""Benchmark: attribution patching against the exact patching grid, and the logit lens against a
plain forward, on the GPT-2-shaped model of bench_patching.py (6 layers, width 256, vocab 5000).

    python scripts/bench_lens_atp.py                      # 64 pairs x 32 tokens, 3 rounds
    python scripts/bench_lens_atp.py --rounds 5 --threads 1 --out docs/bench/lens_atp.md

Grid: every block's output at every position (6 x 32 = 192 cells), logit difference at the last
position; the pipeline with intervene.grid.method exact, then atp, cells x pairs per second; the
agreement of their cells (Spearman, top-10 recall) from one run with both. Lens: the pipeline
with probes=none and lens=logit over every position, and at the last position alone, against a
plain forward of the same batches and against the pipeline with nothing to do (probes=none: its
fixed cost per run); no logits stored. Interleaved rounds after one warm-up each.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

import bench_common as bc  # first: it puts the repository root on sys.path
import bench_patching

ATP_TARGET, LENS_TARGET = 20.0, 1.3  # the issue's: atp >= 20x exact; the lens <= 1.3x forward


def parse_args(argv=None):
    p = bc.token_parser(__doc__, rounds=3)
    p.add_argument("--pairs", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=32)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import pandas as pd
    import torch

    from probe.launch.run import build_run, run
    from probe.testing.compose import make_cfg

    if args.threads:
        torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="probe-bench-lens-atp-", dir=args.tmp))
    model_dir, pairs_path, pairs = bench_patching.write_assets(tmp, args)
    common = ["model=hf", f"model.name={model_dir}", "model.task=causal_lm", "dataset=pairs",
              f"dataset.path={pairs_path}", f"dataset.batch_size={args.pairs}", "probes=none"]  # fmt: skip
    grid = [*common, "intervene=patch_grid", "intervene.metrics=[logit_diff]"]
    cfgs = {
        "exact": make_cfg(*grid, "intervene.grid.method=exact"),
        "atp": make_cfg(*grid, "intervene.grid.method=atp"),
        "probe_none": make_cfg(*common),
        "lens_all": make_cfg(*common, "lens=logit"),
        "lens_last": make_cfg(*common, "lens=logit", "lens.positions=last"),
    }
    prepared = {k: build_run(c) for k, c in cfgs.items()}
    model = prepared["lens_all"].model.eval()
    clean = pairs["clean_ids"]

    def plain(out):
        with torch.inference_mode():
            model(input_ids=clean)

    fns = {"plain": plain}
    for name, cfg in cfgs.items():
        fns[name] = lambda out, cfg=cfg, p=prepared[name]: run(cfg, run_dir=out, prepared=p)
    bc.warm_up(fns, tmp)
    times = bc.rounds(fns, args.rounds, tmp, torch.get_num_threads())
    both = run(make_cfg(*grid, "intervene.grid.method=[exact,atp]"), run_dir=tmp / "both")
    agreement = pd.read_csv(both.run_dir / "patching_agreement.csv")
    cells = bc.LAYERS * args.seq_len
    rate = {k: cells * args.pairs / bc.median(times[k]) for k in ("exact", "atp")}
    lens = {
        k: statistics.median(bc.ratios(times[k], times["plain"])) for k in ("lens_all", "lens_last")
    }
    beside = {k: statistics.median(bc.ratios(times[k], times["probe_none"])) for k in lens}
    rows = [[k, f"{bc.median(v):.3f}", f"{statistics.median(bc.ratios(v, times['plain'])):.2f}",
             f"{rate[k]:,.0f}" if k in rate else "-"] for k, v in times.items()]  # fmt: skip
    head = (
        f"GPT-2 shape {bc.LAYERS}x{bc.WIDTH}, vocab {bc.VOCAB}; {args.pairs} pairs x "
        f"{args.seq_len} tokens in one batch; grid {cells} cells (block outputs x positions); "
        f"{torch.get_num_threads()} threads; median of {args.rounds} interleaved rounds"
    )
    lines = [head, *bc.table_lines(["case", "median_s", "x_plain", "cells_x_pairs_per_s"], rows)]
    lines += [f"agreement (one run with both): {r.method} {r.metric} on {r.layer_type}: Spearman "
              f"{r.spearman:.3f}, top-10 recall {r.top10_recall:.2f}" for r in agreement.itertuples()]  # fmt: skip
    speed = rate["atp"] / rate["exact"]
    lines.append(f"target: atp >= {ATP_TARGET}x the exact grid's cells x pairs/s: {speed:.1f}x: "
                 f"{'met' if speed >= ATP_TARGET else 'NOT met'}")  # fmt: skip
    for k, x in lens.items():
        lines.append(f"target: {k} <= {LENS_TARGET}x a plain forward: {x:.2f}x: "
                     f"{'met' if x <= LENS_TARGET else 'NOT met'} ({beside[k]:.2f}x the pipeline "
                     "run with nothing to do, probes=none)")  # fmt: skip
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("# Lens and attribution patching benchmark\n\n" + "\n".join(
            f"- {ln}" if not ln.startswith("|") else ln for ln in lines) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
