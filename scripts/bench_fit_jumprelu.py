"""JumpReLU transcoder variants on the planted problem (probe.testing.planted; the run that
scripts/bench_fit_planted.py captures): the trainer's own loop (`train_step`) over one block's rows
held in memory, with the fit's held-out split (whole samples, --test-fraction 0.1, seed 0) and
position-0 rows left out; per variant the held-out FVU, L0, dead share and the share of planted
encoder directions a learned encoder row matches at cosine >= 0.9. Figures in
docs/bench/fit_planted.md.

    OMP_NUM_THREADS=1 python scripts/bench_fit_jumprelu.py [--run DIR] [--block 0] [--epochs 30]
        [--k 8] [--variants default "bandwidth 0.05" ...]

--run is the folder bench_fit_planted.py builds (its `run` and `model` inside).
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import replace
from pathlib import Path

import h5py
import pandas as pd
import torch

from probe.analysis.fit.fit_sites import held_out
from probe.analysis.fit.measures import evaluate
from probe.analysis.fit.options import FitOptions
from probe.analysis.fit.trainer_base import adam, train_step
from probe.analysis.fit.transcoder_trainer import TrainingTranscoder
from probe.testing.planted import directions_found, planted_encoders

# FitOptions overrides of each variant (on top of --activation jumprelu --width 256 --k 8). The
# variants with knobs the trainer no longer has (unit decoder rows tied to the encoder, thresholds
# learnt linearly, a per-row L0 target, the kernel's gradient to the pre-activations, the
# pre-activation loss) were measured with this script at the commit that had them (8570aef).
VARIANTS: dict[str, dict] = {
    "default": {},
    "threshold 0.01": {"threshold": 0.01},
    "threshold 0.1": {"threshold": 0.1},
    "bandwidth 0.05": {"bandwidth": 0.05},
    "sparsity 10": {"sparsity": 10.0},
}


def rows(run: Path, block: int) -> tuple[torch.Tensor, ...]:
    """(x, y) of the training rows and of the held-out rows of `block`."""
    with h5py.File(run / "probe.h5", "r") as f:
        layer = f"layers/transformer.h.{block}.mlp"
        x = torch.from_numpy(f[f"{layer}/input"][:]).float()
        y = torch.from_numpy(f[f"{layer}/output"][:]).float()
        sample = f["tokens/sample"][:]
        position = f["tokens/position"][:]
        n = len(f["samples/index"])
    held = torch.from_numpy(held_out(sample, n, 0.1, 0))
    keep = torch.from_numpy(position != 0)
    train, test = keep & ~held, keep & held
    return x[train], y[train], x[test], y[test]


def fit(options: FitOptions, data, block: int, epochs: float) -> tuple[dict, TrainingTranscoder]:
    x, y, xt, yt = data
    total_rows = len(x) / 0.87  # the fit's batches count held-out and position-0 rows too
    batches = math.ceil(total_rows / options.batch_size)
    batch = math.ceil(len(x) / batches)
    total = math.ceil(epochs * batches)
    torch.manual_seed(0)
    model = TrainingTranscoder(x.shape[1], y.shape[1], options, seed=block, total_steps=total)
    opt = adam(model.parameters(), options.learning_rate(model.width))
    g = torch.Generator().manual_seed(block)
    step = 0
    while step < total:
        order = torch.randperm(len(x), generator=g)
        for lo in range(0, len(x), batch):
            i = order[lo : lo + batch]
            if step == 0:
                model.start(x[i], y[i])
            train_step(model, opt, x[i], y[i])
            step += 1
            if step == total:
                break
    t = model.transcoder(block)
    m = evaluate(t, [(xt[lo : lo + 4096], yt[lo : lo + 4096]) for lo in range(0, len(xt), 4096)])
    m["steps"] = total
    return m, model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, default=Path("/tmp/planted_bench/s4096"))
    parser.add_argument("--block", type=int, default=0)
    parser.add_argument("--epochs", type=float, default=30)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = rows(args.run / "run", args.block)
    encoders = planted_encoders(args.run / "model")[args.block]
    base = FitOptions(activation="jumprelu", width=256, k=args.k)
    out = []
    for name in args.variants:
        options = replace(base, **VARIANTS[name])
        t0 = time.perf_counter()
        m, model = fit(options, data, args.block, args.epochs)
        found = directions_found(encoders, model.transcoder(args.block).W_enc.T)
        out.append({"variant": name, "fvu": m["fvu"], "l0": m["l0"], "dead": m["dead"],
                    "found": found, "steps": m["steps"],
                    "seconds": time.perf_counter() - t0})  # fmt: skip
        print(pd.DataFrame(out[-1:]).to_string(index=False, header=len(out) == 1), flush=True)
    print("| variant | FVU | L0 | dead | found | steps | seconds |\n|---|---|---|---|---|---|---|")
    for r in out:
        print(
            f"| {r['variant']} | {r['fvu']:.4f} | {r['l0']:.2f} | {r['dead']:.3f} | "
            f"{r['found']:.3f} | {r['steps']} | {r['seconds']:.0f} |"
        )


if __name__ == "__main__":
    main()
