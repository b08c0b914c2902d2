"""The graph's claim in the live model, measured on a trained model: the planted problem
(probe.testing.planted: a GPT-2 of 2 blocks whose ReLU MLPs are dictionaries of 256 known
directions, its training sequences sampled from itself), transcoders fitted by `python -m
probe.fit` from a run of its sequences (the defaults, `--width 256`, a modest `--epochs`; `--k 8`
for topk), then a graph for each of `--prompts` prompts of 16-32 tokens sampled from the model
(another seed than the training sequences), and on each `probe.graphs.graph_claims.graph_claims`:
the top 1, 5 and 10 features by direct edge to the answer and by total contribution zeroed in the
live model and in the graph's frozen linear model. Prints the fits, and per (activation,
ranking, N) the median and quartiles over the prompts of live/direct, live/total and
frozen/total; writes every row to DIR/graph_claims.csv. Figures: docs/bench/graph_claims.md.

    python scripts/bench_graph_claims.py [--dir DIR] [--sequences 2048] [--epochs 10] \\
        [--prompts 20] [--activations relu topk]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from probe.fit import main as fit_main
from probe.graphs.graph_claims import graph_claims
from probe.graphs.prompt_graph import attribution_graph
from probe.models.transcoder_files import load_transcoders
from probe.testing.planted import PlantedSpec, capture_run, make_planted, sample

TOP = (1, 5, 10)
RATIOS = ("live_over_direct", "live_over_total", "frozen_over_total", "logit_over_total")


def build(root: Path, spec: PlantedSpec) -> None:
    """The planted model and a run capturing its MLPs' inputs and outputs (once)."""
    if (root / "run" / "probe.h5").is_file():
        return
    t = time.perf_counter()
    planted = make_planted(root, spec)
    capture_run(planted, root / "run")
    print(f"built and captured in {time.perf_counter() - t:.0f} s")


def fit(root: Path, activation: str, epochs: float, k: int) -> Path:
    """`python -m probe.fit` on the run with the defaults, width 256 (the planted count) and
    `epochs`; `--k k` for the activations that take one. Reused when its fit.csv exists."""
    out = root / f"claims_{activation}_e{epochs:g}"
    if (out / "fit.csv").is_file():
        return out
    flags = [str(root / "run"), "--out", str(out), "--width", "256", "--epochs", str(epochs),
             "--activation", activation] + (["--k", str(k)] if activation != "relu" else [])  # fmt: skip
    t = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        if fit_main(flags) != 0:
            raise SystemExit(f"probe.fit {' '.join(flags)} failed")
    print(f"fit {activation}: {time.perf_counter() - t:.0f} s")
    return out


def prompts(model, n: int, seed: int) -> list[torch.Tensor]:
    """`n` prompts of 16-32 tokens sampled from the model (first token uniform)."""
    ids = sample(model, n, 32, seed)
    lengths = np.random.default_rng(seed).integers(16, 33, n)
    return [ids[i, : int(lengths[i])] for i in range(n)]


def quartiles(values: pd.Series) -> str:
    q1, q2, q3 = np.nanquantile(values.to_numpy(dtype=float), [0.25, 0.5, 0.75])
    return f"{q2:.2f} [{q1:.2f}, {q3:.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/planted_claims"))
    parser.add_argument("--sequences", type=int, default=2048)
    parser.add_argument("--epochs", type=float, default=10)
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--seed", type=int, default=2026, help="the prompts' sampling seed")
    parser.add_argument("--activations", nargs="*", default=["relu", "topk"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("probe.fit").setLevel(logging.WARNING)
    spec = PlantedSpec(sequences=args.sequences)
    root = args.dir / f"s{spec.sequences}"
    build(root, spec)
    k = round(spec.fire_rate * spec.n_inner)
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(root / "model").eval()
    texts = prompts(model, args.prompts, args.seed)
    rows, fits = [], []
    for activation in args.activations:
        folder = fit(root, activation, args.epochs, k)
        table = pd.read_csv(folder / "fit.csv")
        fits.append(table.assign(activation=activation))
        tset = load_transcoders(folder)
        t = time.perf_counter()
        for i, ids in enumerate(texts):
            graph = attribution_graph(model, ids, tset)
            claims = graph_claims(model, graph, tset, top=TOP)
            claims.insert(0, "prompt", i)
            claims.insert(0, "activation", activation)
            claims["tokens"] = len(ids)
            claims["graph_features"] = graph.n_features
            claims["answer_prob"] = float(graph.logit_probs[0])
            claims["replacement"] = graph.scores["replacement"]
            claims["completeness"] = graph.scores["completeness"]
            rows.append(claims)
        print(f"graphs and claims, {activation}: {time.perf_counter() - t:.0f} s")
    every = pd.concat(rows, ignore_index=True)
    every["logit_over_total"] = every.live_logit / every.total
    every.to_csv(root / "graph_claims.csv", index=False)
    print(f"rows: {root / 'graph_claims.csv'}")
    fit_table = pd.concat(fits)
    columns = ["activation", "layer", "fvu", "l0", "dead", "ce_recovered"]
    print(fit_table[[c for c in columns if c in fit_table]].to_string(index=False))
    per_prompt = every.drop_duplicates(["activation", "prompt"])
    for activation, group in per_prompt.groupby("activation", sort=False):
        print(f"{activation}: {len(group)} prompts, {group.tokens.min()}-{group.tokens.max()} "
              f"tokens, {quartiles(group.graph_features)} feature nodes, answer probability "
              f"{quartiles(group.answer_prob)}, replacement {quartiles(group.replacement)}, "
              f"completeness {quartiles(group.completeness)}")  # fmt: skip
    summary = (
        every.groupby(["activation", "ranking", "top"], sort=False)
        .agg(
            **{r: (r, quartiles) for r in RATIOS},
            direct=("direct", "median"),
            total=("total", "median"),
            live=("live", "median"),
        )  # fmt: skip
        .reset_index()
    )
    print("median [quartiles] over the prompts; direct, total, live: median changes of the answer")
    with pd.option_context("display.width", 200, "display.float_format", "{:.3f}".format):
        print(summary.to_string(index=False))


if __name__ == "__main__":
    main()
