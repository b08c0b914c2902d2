"""The planted problem at the issue's full size (probe.testing.planted: d_model 64, n_inner 256, 2
blocks, 4096 sequences of 32 tokens), fitted by `python -m probe.fit` with the defaults except
`--width 256 --epochs 30` (and `--k` the planted L0 for topk, batchtopk and jumprelu's target):
held-out FVU, L0, dead share and the share of planted encoder directions found by a learned encoder
row (cosine >= 0.9), per activation and block. Figures in docs/bench/fit_planted.md.

`--kind clt` fits one cross-layer transcoder per activation instead (`--width` per layer) and
adds each block's ce_recovered (that block's MLP output replaced by everything the CLT writes
into it) and the row `all` (every block at once); `--variant NAME=FLAGS` (repeatable) fits each
activation once more per variant with those extra probe.fit flags, so configurations are
measured side by side in one run.

    python scripts/bench_fit_planted.py [--dir DIR] [--activations relu topk ...] [--kind clt]
        [--variant lr3e-3="--lr 3e-3"] [-- FIT FLAGS]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import time
from pathlib import Path

import pandas as pd
import torch
from safetensors.torch import load_file

from probe.fit import main as fit_main
from probe.testing.planted import (
    PlantedSpec,
    capture_run,
    directions_found,
    make_planted,
    mlp_losses,
    planted_encoders,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/planted_bench"))
    parser.add_argument(
        "--activations", nargs="*", default=["relu", "jumprelu", "topk", "batchtopk"]
    )
    parser.add_argument("--sequences", type=int, default=PlantedSpec().sequences)
    parser.add_argument("--epochs", type=float, default=30)
    parser.add_argument("--kind", default="plt", choices=["plt", "clt"])
    parser.add_argument(
        "--variant", action="append", default=[], metavar="NAME=FLAGS",
        help="one more fit per activation with these probe.fit flags (repeatable)",
    )  # fmt: skip
    parser.add_argument("fit", nargs=argparse.REMAINDER, help="more probe.fit flags after --")
    args = parser.parse_args()
    spec = PlantedSpec(sequences=args.sequences)
    root = args.dir / f"s{spec.sequences}"
    if not (root / "run" / "probe.h5").is_file():
        t = time.perf_counter()
        planted = make_planted(root, spec)
        capture_run(planted, root / "run")
        print(f"built and captured in {time.perf_counter() - t:.0f} s")
    ids = torch.load(root / "ids.pt")["input_ids"]
    losses = mlp_losses(root / "model", ids[:1024])
    print(
        "next-token CE over 1024 sequences: " + ", ".join(f"{k} {v:.3f}" for k, v in losses.items())
    )
    encoders = planted_encoders(root / "model")
    k = round(spec.fire_rate * spec.n_inner)
    extra = [a for a in args.fit if a != "--"]
    logging.getLogger("probe.fit").setLevel(logging.WARNING)
    variants = [("default", [])] + [
        (v.split("=", 1)[0], v.split("=", 1)[1].split()) for v in args.variant
    ]
    rows = []
    for activation in args.activations:
        for name, more in variants:
            out = root / f"fit_{args.kind}_{activation}_{name}"
            flags = [str(root / "run"), "--out", str(out), "--width", str(spec.n_inner),
                     "--epochs", str(args.epochs), "--activation", activation, "--kind",
                     args.kind, *extra, *more]  # fmt: skip
            if activation != "relu":
                flags += ["--k", str(k)]
            if out.exists():
                import shutil

                shutil.rmtree(out)
            t = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()):
                assert fit_main(flags) == 0
            seconds = time.perf_counter() - t
            fit = pd.read_csv(out / "fit.csv")
            for _, r in fit.iterrows():
                if str(r["layer"]) == "all":
                    rows.append({"activation": activation, "variant": name, "layer": "all",
                                 "ce_recovered": r["ce_recovered"]})  # fmt: skip
                    continue
                layer = int(r["layer"])
                if args.kind == "clt":
                    learned = load_file(str(out / f"W_enc_{layer}.safetensors"))[f"W_enc_{layer}"]
                else:
                    learned = load_file(str(out / f"layer_{layer}.safetensors"))["W_enc"]
                rows.append({"activation": activation, "variant": name, "layer": layer,
                             "fvu": r["fvu"], "l0": r["l0"], "dead": r["dead"],
                             "found": directions_found(encoders[layer], learned),
                             "ce_recovered": r["ce_recovered"], "steps": int(r["steps"]),
                             "seconds": seconds})  # fmt: skip
            print(pd.DataFrame(rows[-len(fit) :]).to_string(index=False), flush=True)
    table = pd.DataFrame(rows)
    with pd.option_context("display.float_format", "{:.4f}".format):
        print(table.to_string(index=False))


if __name__ == "__main__":
    main()
