"""Benchmark: examples per unit (stats.topk) and SAE latents, against a statistics-only run.

    python scripts/bench_topk.py                       # 256 x 128 tokens, batch 32, 3 rounds
    python scripts/bench_topk.py --samples 128 --rounds 2 --out docs/bench/topk.md

The GPT-2-shaped model of the token benchmarks (6 blocks, width 256) over seeded random ids,
interleaved per round after one warm-up each, over the same materialised batches: a plain forward;
the residual stream statistics-only (`store=stats probes=residual`); the same with
`stats.topk=20` on every block; with an SAE of 16x width (4096 latents, seeded random, SAELens
layout) on block 3 (its latents and error get statistics); both (the latents get top-20 too);
the statistics-only run with a bare hook doing the SAE's encode and decode (its arithmetic alone);
and the top-k of the six blocks
computed after a full run from its stored rows (the floor a post-hoc pass pays, the full run not
counted). Then the peak RSS of the top-k run in fresh processes at N and 8N samples: flat in the
number of tokens. Target: top-k and SAE latents within 1.15x the statistics-only run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import bench_common as bc  # first: it puts the repository root on sys.path

POSITIONS, LATENTS, K = 128, 16 * bc.WIDTH, 20
TARGET = 1.15


def write_assets(root: Path, samples: int, seed: int) -> tuple[Path, Path, Path]:
    import torch
    from safetensors.torch import save_file

    model_dir, ids, sae = root / "model", root / f"ids{samples}.pt", root / "sae"
    if not (model_dir / "config.json").exists():
        bc.save_gpt2(model_dir, POSITIONS, seed)
    g = torch.Generator().manual_seed(seed)
    ids_t = torch.randint(0, bc.VOCAB, (samples, POSITIONS), generator=g)
    torch.save({"input_ids": ids_t, "attention_mask": torch.ones_like(ids_t)}, ids)
    if not sae.exists():
        sae.mkdir()
        d = bc.WIDTH
        weights = {"W_enc": torch.randn(d, LATENTS, generator=g) / d**0.5,
                   "b_enc": torch.randn(LATENTS, generator=g) * 0.1 - 0.3,
                   "W_dec": torch.randn(LATENTS, d, generator=g) / LATENTS**0.5,
                   "b_dec": torch.zeros(d)}  # fmt: skip
        save_file(weights, sae / "sae_weights.safetensors")
        cfg = {
            "architecture": "standard",
            "d_in": d,
            "d_sae": LATENTS,
            "apply_b_dec_to_input": True,
        }
        (sae / "cfg.json").write_text(json.dumps(cfg))
    return model_dir, ids, sae


def overrides(model_dir: Path, ids: Path, batch: int) -> list[str]:
    return ["model=hf", f"model.name={model_dir}", "model.task=causal_lm", "dataset=tokens",
            f"dataset.path={ids}", f"dataset.batch_size={batch}", "probes=residual"]  # fmt: skip


def examples(sae: Path) -> list[str]:
    return [f"stats.topk={K}", "probes.residual.exclude=[transformer.h.3]",
            "+probes.latents.layers=[transformer.h.3]",
            f"+probes.latents.sae={sae}", "+probes.latents.rows=tokens"]  # fmt: skip


def posthoc(h5: Path):
    """The same top-k of every block from a full run's stored rows (probe.stats.topk's merge)."""
    import h5py
    import numpy as np
    import torch

    from probe.hooks.batch_topk import POSITION_BITS, TopKSpec, partial, stored_keys
    from probe.stats.topk import TopKState

    spec = TopKSpec(top=K)
    with h5py.File(h5, "r") as f:
        sample = f["tokens/sample"][:].astype(np.int64)
        base = (sample << POSITION_BITS) + f["tokens/position"][:]
        for i in range(bc.LAYERS):
            ds, state = f[f"layers/transformer.h.{i}/output"], TopKState(spec)
            for lo in range(0, len(ds), 1 << 16):
                block = torch.from_numpy(ds[lo : lo + (1 << 16)])
                found = stored_keys(block, 1, torch.from_numpy(base[lo : lo + len(block)]))
                state.merge(
                    {k: (v.numpy(), i.numpy()) for k, (v, i) in partial(*found, spec).items()}
                )


def child_rss(args, samples: int, root: Path) -> dict:
    """Peak RSS above the loaded model of one top-k run (this script with --child)."""
    return bc.child_json(
        [__file__, "--child", str(samples), "--root", str(root), "--batch", str(args.batch)]
    )


def run_child(samples: int, root: Path, batch: int) -> None:
    from probe.testing import oracles

    model_dir, ids, sae = write_assets(root, samples, 0)
    setup = oracles.make_setup(overrides(model_dir, ids, batch))
    case = oracles.probe_case(setup, "store.mode=stats", *examples(sae))
    bc.reset_peak()
    base = bc.status_mb("VmRSS")
    with tempfile.TemporaryDirectory() as out:
        case(Path(out))
    print(json.dumps({"samples": samples, "rss_mb": bc.peak_rss_mb() - base}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument("--root", default=None)
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    root = Path(args.root or tempfile.mkdtemp(prefix="bench_topk_"))
    if args.child is not None:
        return run_child(args.child, root, args.batch)
    import torch

    from probe.testing import oracles

    model_dir, ids, sae = write_assets(root, args.samples, 0)
    setup = oracles.make_setup(overrides(model_dir, ids, args.batch))

    def plain(out: Path) -> None:
        with torch.inference_mode():
            for b in setup.base.batches:
                setup.model(**b.inputs)

    stats_case = oracles.probe_case(setup, "store.mode=stats")

    def stats_and_hand_sae(out: Path) -> None:
        """The statistics-only run with the SAE's own arithmetic in a bare hook (encode, decode;
        what any tool running this SAE pays): the floor under the SAE variants."""
        from safetensors.torch import load_file

        w = load_file(sae / "sae_weights.safetensors")

        def hook(module, args, output):
            x = output[0] if isinstance(output, tuple) else output
            latents = torch.relu((x - w["b_dec"]) @ w["W_enc"] + w["b_enc"])
            _ = latents @ w["W_dec"] + w["b_dec"]

        block = setup.base.model.get_submodule("transformer.h.3")
        handle = block.register_forward_hook(hook)
        try:
            stats_case(out)
        finally:
            handle.remove()

    full = oracles.probe_case(setup)
    stored = full(root / "full")
    variants = {
        "plain": plain,
        "stats": stats_case,
        "stats+hand sae": stats_and_hand_sae,
        "stats+topk": oracles.probe_case(setup, "store.mode=stats", f"stats.topk={K}"),
        "stats+sae": oracles.probe_case(setup, "store.mode=stats", *examples(sae)[1:]),
        "stats+topk+sae": oracles.probe_case(setup, "store.mode=stats", *examples(sae)),
        "posthoc topk": lambda out: posthoc(stored),
    }
    bc.warm_up(variants, root)
    times = bc.rounds(variants, args.rounds, root, threads=torch.get_num_threads())
    rss = [child_rss(args, n, root) for n in (args.samples, 8 * args.samples)]
    rows = []
    for name, runs in times.items():
        to_plain = statistics.median(bc.ratios(runs, times["plain"]))
        to_stats = statistics.median(bc.ratios(runs, times["stats"]))
        rows.append((name, f"{bc.median(runs):.3f}", f"{to_plain:.2f}", f"{to_stats:.2f}"))
    ratio = statistics.median(bc.ratios(times["stats+topk+sae"], times["stats"]))
    alone = statistics.median(bc.ratios(times["stats+topk"], times["stats"]))
    arithmetic = statistics.median(bc.ratios(times["stats+hand sae"], times["stats"]))
    beyond = statistics.median(bc.ratios(times["stats+topk+sae"], times["stats+hand sae"]))
    head = [f"# bench_topk ({datetime.date.today()}, {platform.machine()}, {os.cpu_count()} cores)", "",
            f"{args.samples} x {POSITIONS} tokens, batch {args.batch}, {bc.LAYERS} blocks of width "
            f"{bc.WIDTH}; stats.topk={K} on every block, an SAE of {LATENTS} latents on block 3; "
            f"{args.rounds} rounds, medians."]  # fmt: skip
    notes = [
        f"top-k and SAE latents at {ratio:.3f}x the statistics-only run (target {TARGET}x): "
        + ("met" if ratio <= TARGET else "not met")
        + f"; top-k alone {alone:.3f}x",
        f"the SAE's own arithmetic (a bare encode/decode hook) {arithmetic:.3f}x the statistics-only "
        f"run; top-k and SAE latents at {beyond:.3f}x that run",
        "peak RSS above the loaded model of the top-k run: "
        + ", ".join(
            f"{r.get('samples')} samples {r.get('rss_mb', float('nan')):.0f} MB" for r in rss
        ),
        "posthoc topk: the six blocks' top-k from a full run's stored rows, the full run not counted",
    ]
    text = bc.markdown(head, ["variant", "seconds", "x plain", "x stats"], rows, notes)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    sys.exit(main())
