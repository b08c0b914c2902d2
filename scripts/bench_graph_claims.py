"""The graph's claim in the live model, measured on a trained model: the planted problem
(probe.testing.planted: a GPT-2 of 2 blocks whose ReLU MLPs are dictionaries of 256 known
directions, its training sequences sampled from itself), dictionaries fitted by `python -m
probe.fit` from a run of its sequences (the defaults, `--width 256`, a modest `--epochs`; `--k 8`
for topk and batchtopk): per-layer transcoders (`--sets relu topk`) and cross-layer transcoders
(`--sets clt:topk clt:batchtopk`, `--kind clt`, 256 features a layer), then a graph for each of
`--prompts` prompts of 16-32 tokens sampled from the model (another seed than the training
sequences), and on each `probe.graphs.graph_claims.graph_claims`: the top 1, 5 and 10 features by
direct edge to the answer and by total contribution, in each of `--orders` (positive: the largest
first; negative: the most negative first, predicted to raise the answer; absolute), zeroed in the
live model, in the graph's frozen linear model, and with the MLPs live and attention patterns
and norm scales frozen, the patterns alone frozen or the norm scales alone. Prints the fits, the
largest distance between the frozen model's change and the total prediction, and per (set,
ranking, order, N) the median and quartiles over the prompts of live/direct, live/total,
frozen-attention/total, frozen-patterns/total, frozen-norms/total and raw-logit/total, the
pooled ratios (the sum of the live changes over the sum of the predictions) and the share of
prompts where the answer moves the predicted way; then the gap between frozen attention and
live split (gap_split): what is left of it with the patterns alone frozen and with the norm
scales alone, and the share of rows each closes alone, per group, by a single feature's layer
and whether it sits at the last position, and for sets by where they sit (all at the last
position, none there, mixed); writes every row to DIR/s{SEQUENCES}/graph_claims_e{EPOCHS}.csv.
Figures: docs/bench/graph_claims.md.

    python scripts/bench_graph_claims.py [--dir DIR] [--sequences 2048] [--epochs 10] \\
        [--prompts 20] [--sets relu topk clt:topk clt:batchtopk] \\
        [--orders positive negative absolute]
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
from probe.graphs.feature_zeroing import live_logits
from probe.graphs.graph_claims import ORDERS, graph_claims
from probe.graphs.prompt_graph import attribution_graph
from probe.models.transcoder_files import load_transcoders
from probe.testing.planted import PlantedSpec, capture_run, make_planted, sample

TOP = (1, 5, 10)
RATIOS = ("live_over_direct", "live_over_total", "frozen_attention_over_total",
          "frozen_patterns_over_total", "frozen_norms_over_total", "logit_over_total")  # fmt: skip


def build(root: Path, spec: PlantedSpec) -> None:
    """The planted model and a run capturing its MLPs' inputs and outputs (once)."""
    if (root / "run" / "probe.h5").is_file():
        return
    t = time.perf_counter()
    planted = make_planted(root, spec)
    capture_run(planted, root / "run")
    print(f"built and captured in {time.perf_counter() - t:.0f} s")


def fit(root: Path, kind: str, activation: str, epochs: float, k: int) -> Path:
    """`python -m probe.fit --kind kind` on the run with the defaults, width 256 (the planted
    count; a CLT's per layer) and `epochs`; `--k k` for the activations that take one. Reused
    when its fit.csv exists."""
    name = f"{activation}_e{epochs:g}" if kind == "plt" else f"{kind}_{activation}_e{epochs:g}"
    out = root / f"claims_{name}"
    if (out / "fit.csv").is_file():
        return out
    takes_k = activation != "relu"
    flags = [str(root / "run"), "--out", str(out), "--kind", kind, "--width", "256", "--epochs",
             str(epochs), "--activation", activation] + (["--k", str(k)] if takes_k else [])  # fmt: skip
    t = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        if fit_main(flags) != 0:
            raise SystemExit(f"probe.fit {' '.join(flags)} failed")
    print(f"fit {kind} {activation}: {time.perf_counter() - t:.0f} s")
    return out


def prompts(model, n: int, seed: int) -> list[torch.Tensor]:
    """`n` prompts of 16-32 tokens sampled from the model (first token uniform)."""
    ids = sample(model, n, 32, seed)
    lengths = np.random.default_rng(seed).integers(16, 33, n)
    return [ids[i, : int(lengths[i])] for i in range(n)]


def final_norm_spreads(model, ids: torch.Tensor, tset, features: str) -> tuple[float, float]:
    """The standard deviation of the final norm's input at the last position, clean and with
    `features` ("layer/pos/feature;...") zeroed live: the spread the norm divides by."""
    seen = []
    handle = model.transformer.ln_f.register_forward_pre_hook(
        lambda _m, args: seen.append(float(args[0][0, -1].std()))
    )
    try:
        live_logits(model, ids, tset)
        zeroed = [tuple(map(int, place.split("/"))) for place in features.split(";")]
        live_logits(model, ids, tset, zeroed)  # type: ignore[arg-type]
    finally:
        handle.remove()
    return seen[0], seen[1]


def spread_range(values: pd.Series) -> str:
    return f"{values.median():.2f} [{values.min():.2f}, {values.max():.2f}]"


def quartiles(values: pd.Series) -> str:
    q1, q2, q3 = np.nanquantile(values.to_numpy(dtype=float), [0.25, 0.5, 0.75])
    return f"{q2:.2f} [{q1:.2f}, {q3:.2f}]"


def where_zeroed(every: pd.DataFrame) -> pd.Series:
    """Per row, where its zeroed features sit: `last` (all at the last position), `earlier`
    (none there) or `mixed`."""
    at_last = [
        [int(place.split("/")[1]) == tokens - 1 for place in features.split(";")]
        for features, tokens in zip(every.features, every.tokens, strict=True)
    ]
    return pd.Series(
        ["last" if all(a) else "earlier" if not any(a) else "mixed" for a in at_last],
        index=every.index,
    )


GAP_FLOOR = 0.05  # a row whose |frozen_attention - live| is below this has no gap to split
CLOSES = 0.25  # a freeze closes a row's gap where at most this share of it is left


def gap_split(group: pd.DataFrame) -> pd.Series:
    """How the gap between the model with attention patterns and norm scales frozen (the MLPs
    live) and the live model, G = frozen_attention - live, splits over the group's rows: `gap`,
    sum |G| over the summed |total prediction|; `left_patterns` and `left_norms`, the gap left
    with the patterns alone frozen (sum |frozen_attention - frozen_patterns|) or the norm scales
    alone (sum |frozen_attention - frozen_norms|), over sum |G| (0: that freeze closes it all;
    1: nothing; above 1: it moves the answer further off); then the share of the rows with a gap
    (|G| >= GAP_FLOOR) that the patterns alone close (at most CLOSES of |G| left), that the
    norms alone close, and that neither closes alone (both needed: their interaction)."""
    gap = group.frozen_attention - group.live
    left_patterns = (group.frozen_attention - group.frozen_patterns).abs()
    left_norms = (group.frozen_attention - group.frozen_norms).abs()
    some = gap.abs() >= GAP_FLOOR
    by_patterns = some & (left_patterns <= CLOSES * gap.abs())
    by_norms = some & (left_norms <= CLOSES * gap.abs())
    n = max(int(some.sum()), 1)
    return pd.Series({
        "rows": len(group), "with_gap": int(some.sum()),
        "gap": gap.abs().sum() / group.total.abs().sum(),
        "left_patterns": left_patterns.sum() / gap.abs().sum(),
        "left_norms": left_norms.sum() / gap.abs().sum(),
        "patterns_close": (by_patterns & ~by_norms).sum() / n,
        "norms_close": (by_norms & ~by_patterns).sum() / n,
        "either_closes": (by_patterns & by_norms).sum() / n,
        "neither_closes": (some & ~by_patterns & ~by_norms).sum() / n,
    })  # fmt: skip


def parse_set(name: str) -> tuple[str, str]:
    """("plt", activation) for "ACTIVATION", ("clt", activation) for "clt:ACTIVATION"."""
    kind, _, activation = name.rpartition(":")
    if kind not in ("", "clt") or not activation:
        raise SystemExit(f"--sets {name!r}: give ACTIVATION (per-layer) or clt:ACTIVATION")
    return kind or "plt", activation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/planted_claims"))
    parser.add_argument("--sequences", type=int, default=2048)
    parser.add_argument("--epochs", type=float, default=10)
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--seed", type=int, default=2026, help="the prompts' sampling seed")
    parser.add_argument(
        "--sets", nargs="*", default=["relu", "topk", "clt:topk", "clt:batchtopk"],
        help="ACTIVATION: per-layer transcoders; clt:ACTIVATION: a cross-layer transcoder",
    )  # fmt: skip
    parser.add_argument("--orders", nargs="*", default=list(ORDERS))
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
    for name in args.sets:
        kind, activation = parse_set(name)
        label = activation if kind == "plt" else f"clt {activation}"
        folder = fit(root, kind, activation, args.epochs, k)
        table = pd.read_csv(folder / "fit.csv")
        fits.append(table.assign(set=label))
        tset = load_transcoders(folder)
        t = time.perf_counter()
        for i, ids in enumerate(texts):
            graph = attribution_graph(model, ids, tset)
            claims = graph_claims(model, graph, tset, top=TOP, orders=args.orders)
            claims.insert(0, "prompt", i)
            claims.insert(0, "set", label)
            claims["tokens"] = len(ids)
            claims["graph_features"] = graph.n_features
            claims["answer_prob"] = float(graph.logit_probs[0])
            claims["replacement"] = graph.scores["replacement"]
            claims["completeness"] = graph.scores["completeness"]
            spreads = [final_norm_spreads(model, ids, tset, f) for f in claims.features]
            claims["final_norm_spread"] = [clean for clean, _ in spreads]
            claims["final_norm_spread_zeroed"] = [zeroed for _, zeroed in spreads]
            rows.append(claims)
        print(f"graphs and claims, {label}: {time.perf_counter() - t:.0f} s")
    every = pd.concat(rows, ignore_index=True)
    every["logit_over_total"] = every.live_logit / every.total
    out = root / f"graph_claims_e{args.epochs:g}.csv"
    every.to_csv(out, index=False)
    print(f"rows: {out}")
    fit_table = pd.concat(fits)
    columns = ["set", "layer", "fvu", "l0", "dead", "ce_recovered"]
    print(fit_table[[c for c in columns if c in fit_table]].to_string(index=False))
    per_prompt = every.drop_duplicates(["set", "prompt"])
    for label, group in per_prompt.groupby("set", sort=False):
        print(f"{label}: {len(group)} prompts, {group.tokens.min()}-{group.tokens.max()} "
              f"tokens, {quartiles(group.graph_features)} feature nodes, answer probability "
              f"{quartiles(group.answer_prob)}, replacement {quartiles(group.replacement)}, "
              f"completeness {quartiles(group.completeness)}")  # fmt: skip
    print("per prompt, live/total by ranking, order and N (the CSV holds every column)")
    with pd.option_context("display.width", 250, "display.float_format", "{:.2f}".format):
        for label, group in every.groupby("set", sort=False):
            table = group.pivot_table(index=["prompt", "tokens", "graph_features", "replacement"],
                                      columns=["order", "ranking", "top"],
                                      values="live_over_total")  # fmt: skip
            print(f"{label}:")
            print(table.to_string())
    off = (every.frozen - every.total).abs()
    print(f"frozen linear model against the total prediction: largest |difference| "
          f"{off.max():.2e}, largest relative {(off / every.total.abs()).max():.2e}")  # fmt: skip
    # the answer moved the order's way: down for the features holding it up (positive, absolute),
    # up for those holding it down (negative)
    every["moved"] = np.where(every.order == "negative", every.live > 0, every.live < 0)
    groups = every.groupby(["set", "ranking", "order", "top"], sort=False)
    summary = groups.agg(**{r: (r, quartiles) for r in RATIOS}).reset_index()
    pooled = groups.apply(
        lambda g: pd.Series(
            {
                "pooled_direct": g.live.sum() / g.direct.sum(),
                "pooled_total": g.live.sum() / g.total.sum(),
                "direct": g.direct.median(),
                "total": g.total.median(),
                "live": g.live.median(),
                "moved": g.moved.mean(),
            }
        ),  # fmt: skip
        include_groups=False,
    ).reset_index(drop=True)
    print(
        "median [quartiles] over the prompts; pooled: the sum of the live changes over the sum of"
    )
    print("the predictions; direct, total, live: the median changes of the answer; moved: the")
    print("share of prompts where the answer moved the order's way (falls, rises for negative)")
    with pd.option_context("display.width", 250, "display.float_format", "{:.2f}".format):
        print(pd.concat([summary, pooled], axis=1).to_string(index=False))
    # the gap that attention and norms make, split: the patterns' part, the norms', the rest
    every["where"] = where_zeroed(every)
    every["layer"] = [int(f.split("/")[0]) if ";" not in f else -1 for f in every.features]
    print("the gap G = frozen_attention - live (attention patterns and norm scales frozen, or")
    print("nothing, the MLPs live in both): gap, sum |G| / sum |total|; left_patterns and")
    print("left_norms, the gap left with the patterns alone or the norm scales alone frozen, over")
    print(f"sum |G|; of the rows with |G| >= {GAP_FLOOR} (with_gap), the share where freezing the")
    print(f"patterns alone leaves at most {CLOSES} of |G| (and the norms alone do not), the norms")
    print("alone, either, and neither (the two interact); where: the zeroed features all at the")
    print("last position, none there, or mixed; layer: a single feature's (-1: a set)")
    with pd.option_context("display.width", 250, "display.float_format", "{:.2f}".format):
        for keys, rows in ((["order", "ranking", "top"], every),
                           (["order", "ranking", "layer", "where"], every[every.top == 1]),
                           (["order", "ranking", "where"], every[every.top > 1]),
                           (["set", "order", "ranking", "top"], every)):  # fmt: skip
            split = rows.groupby(keys, sort=False).apply(gap_split, include_groups=False)
            print(split.to_string())
    # where the single feature sits: a last-layer feature at the last position reaches the
    # answer through the final norm alone, so there live/frozen-attention is that norm's doing
    single = every[every.top == 1].copy()
    place = single.features.str.split("/", expand=True).astype(int)
    single["layer"], single["last_position"] = place[0], place[1] == single.tokens - 1
    single["spread_kept"] = single.final_norm_spread_zeroed / single.final_norm_spread
    print("top 1: the feature's layer and whether it is at the last position; spread_kept: the")
    print("final norm's input spread at the last position zeroed over clean, median [range]")
    print(
        single.groupby(["set", "ranking", "order", "layer", "last_position"])
        .agg(
            prompts=("prompt", "size"),
            live_over_total=("live_over_total", "median"),
            frozen_attention_over_total=("frozen_attention_over_total", "median"),
            frozen_patterns_over_total=("frozen_patterns_over_total", "median"),
            frozen_norms_over_total=("frozen_norms_over_total", "median"),
            spread_kept=("spread_kept", spread_range),
        )  # fmt: skip
        .round(2)
        .to_string()
    )


if __name__ == "__main__":
    main()
