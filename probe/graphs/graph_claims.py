"""The graph's claim in the live model: zero the features a graph says carry the answer, and
measure how far the answer moves against how far the graph says it would.

The answer is one of the graph's logit nodes (`target`, 0: the most probable token), whose
value is circuit-tracer's: the logit minus the mean logit at the last position. For each feature
node the graph gives two contributions to it:

- **direct**: the adjacency entry from the feature to the answer (its write carried to the
  logit by the frozen attention and norms, other features cut);
- **total**: activation x the answer's derivative with respect to the activation through the
  graph's linear model (every path: the feature's edges into later features, each of those
  moving its activation by the change of its pre-activation, as an active feature does, and on
  to the answer); equivalently the change zeroing the feature alone makes in that model, with
  the sign flipped.

Zeroing a set S of features the graph predicts the answer moves by `-sum(direct)` (direct) or by
`total_change(S)` (total: the linear model's change with every feature of S held at 0, so a
path through two of them counts once; for one feature, minus its total contribution).
`graph_claims` ranks the features by either contribution in one or more orders (ORDERS:
`positive`, the features the graph says hold the answer up, the largest first; `negative`,
those it says hold the answer down, the most negative first, whose zeroing it predicts raises
the answer: a test of its negative edges; `absolute`, either sign, the largest magnitude first),
zeroes the top N in the live model (probe.graphs.feature_zeroing.live_logits; a cross-layer
transcoder's feature loses its writes into its own layer and every later one), in the graph's
frozen linear model (frozen_logits, where the change equals the total prediction to rounding)
and with attention and norms frozen but the MLPs live (frozen_logits(mlps="live"): between the
two, it says whether the gap is the MLPs' nonlinearity or the frozen attention and norms), and
with the MLPs live and only one of the two frozen (`frozen_patterns`: the attention patterns,
every norm's scale live; `frozen_norms`: the norms' scales, the patterns live), which splits the
part of the gap that attention and norms make:

    frozen_attention - live = (frozen_patterns - live) + (frozen_norms - live) + interaction

the first the patterns' part (what freezing them alone closes), the second the norms' part,
the interaction `frozen_attention + live - frozen_patterns - frozen_norms` what neither closes
alone. It gives one row per (ranking, order, N):

    from probe.graphs.graph_claims import graph_claims
    table = graph_claims(model, graph, transcoders, top=(1, 5, 10), orders=ORDERS)
    table[["ranking", "order", "top", "direct", "total", "live", "live_over_total"]]
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch

from probe.errors import ConfigError
from probe.graphs.feature_zeroing import Place, frozen_logits, live_logits
from probe.graphs.graph_data import GraphData
from probe.graphs.prompt_graph import transcoder_set

RANKINGS = ("direct", "total")
# the order a ranking takes its features in: the largest contribution first (positive), the most
# negative first (negative), the largest magnitude first (absolute)
ORDERS = ("positive", "negative", "absolute")
CLAIM_COLUMNS = (
    "ranking",  # the contribution the features were ranked by (RANKINGS)
    "order",  # the order they were taken in (ORDERS)
    "top",  # N asked for
    "zeroed",  # features zeroed (N, or fewer where the graph has fewer of the order's sign)
    "features",  # their places, "layer/pos/feature" joined by ";"
    "direct",  # the change of the answer (logit - mean logit) the direct edges predict
    "total",  # the change the graph's linear model predicts through every path
    "live",  # the change measured in the live model
    "live_logit",  # the change of the answer's raw logit in the live model
    "frozen",  # the change measured in the graph's frozen linear model (NaN: not run)
    "frozen_attention",  # the change with attention and norms frozen, the MLPs live (NaN: not run)
    "frozen_patterns",  # the change with the attention patterns alone frozen, norms and MLPs live
    "frozen_norms",  # the change with the norms' scales alone frozen, patterns and MLPs live
    "live_over_direct",
    "live_over_total",
    "frozen_over_total",
    "frozen_attention_over_total",
    "frozen_patterns_over_total",
    "frozen_norms_over_total",
)
# the frozen columns: (frozen_logits' MLPs, what it freezes); each one record and one replay per row
FROZEN_MODELS = {
    "frozen": ("linear", ("patterns", "norms")),
    "frozen_attention": ("live", ("patterns", "norms")),
    "frozen_patterns": ("live", ("patterns",)),
    "frozen_norms": ("live", ("norms",)),
}


def _feature_entries(graph: GraphData, target: int):
    """The answer's row over the feature nodes (n_f,) and the feature-to-feature entries
    (targets, sources, weights), float64 on the CPU."""
    a = graph.adjacency.coalesce()
    rows, cols = a.indices().cpu()
    values = a.values().double().cpu()
    n_f = graph.n_features
    answer = graph.offsets["logit"] + target
    to_answer = (rows == answer) & (cols < n_f)
    direct = torch.zeros(n_f, dtype=torch.float64).index_put_(
        (cols[to_answer],), values[to_answer], accumulate=True
    )
    inner = (rows < n_f) & (cols < n_f)
    return direct, rows[inner], cols[inner], values[inner]


def answer_contributions(graph: GraphData, target: int = 0) -> pd.DataFrame:
    """One row per feature node (`node`, `layer`, `pos`, `feature`, `activation`) with its
    `direct` and `total` contribution to the answer (the module docstring)."""
    _check_target(graph, target)
    direct, rows, cols, values = _feature_entries(graph, target)
    act = graph.activations.double().cpu()
    per_unit = values / act[rows]  # an entry per unit of its target's activation
    total = direct.clone()
    for _ in range(graph.n_features + 1):  # acyclic: settles within the longest path
        new = direct.clone().index_add_(0, cols, total[rows] * per_unit)
        if torch.equal(new, total):
            break
        total = new
    places = graph.features.cpu().numpy().reshape(-1, 3)
    return pd.DataFrame({
        "node": np.arange(graph.n_features), "layer": places[:, 0], "pos": places[:, 1],
        "feature": places[:, 2], "activation": act.numpy(), "direct": direct.numpy(),
        "total": total.numpy(),
    })  # fmt: skip


def direct_change(graph: GraphData, nodes: Sequence[int], target: int = 0) -> float:
    """The answer's change the direct edges predict when feature nodes `nodes` are zeroed:
    minus the sum of their edges to the answer."""
    _check_target(graph, target)
    direct, *_ = _feature_entries(graph, target)
    return -float(direct[list(nodes)].sum())


def total_change(graph: GraphData, nodes: Sequence[int], target: int = 0) -> float:
    """The answer's change in the graph's linear model when feature nodes `nodes` are held at
    0: each other feature's activation moves by its pre-activation's move (the entries from the
    features that moved), and the answer by its entries from them all."""
    _check_target(graph, target)
    direct, rows, cols, values = _feature_entries(graph, target)
    act = graph.activations.double().cpu()
    held = torch.zeros(graph.n_features, dtype=torch.bool)
    held[list(nodes)] = True
    start = torch.where(held, -1.0, 0.0).double()  # each feature's move over its activation
    moved = start.clone()
    for _ in range(graph.n_features + 1):
        new = torch.zeros_like(moved).index_add_(0, rows, values * moved[cols]) / act
        new = torch.where(held, start, new)
        if torch.equal(new, moved):
            break
        moved = new
    return float((direct * moved).sum())


def graph_claims(
    model: torch.nn.Module,
    graph: GraphData,
    transcoders,
    *,
    top: Sequence[int] = (1, 5, 10),
    rankings: Sequence[str] = RANKINGS,
    orders: Sequence[str] = ("positive",),
    target: int = 0,
    frozen: bool = True,
    overrides: dict | None = None,
) -> pd.DataFrame:
    """One row per (ranking, order, N) (CLAIM_COLUMNS): the first N features of `graph` by their
    contribution to the answer (logit node `target`) by `ranking`, taken in `order` (ORDERS:
    `positive`, those above 0, the largest first; `negative`, those below 0, the most negative
    first; `absolute`, the largest magnitude first; no row for an order no feature has), zeroed
    in `model`, the live change against the graph's direct and total predictions; with
    `frozen`, also in the graph's frozen linear model and, the MLPs live, with attention
    patterns and norms' scales frozen, with the patterns alone and with the scales alone
    (FROZEN_MODELS). `graph` is `model`'s on its tokens through `transcoders` (a per-layer
    TranscoderSet or a CrossLayerTranscoder, whose zeroed feature loses its writes into every
    layer from its own on; or the path of its YAML or folder); `overrides` are `model.anatomy`
    keys."""
    tops = _check_top(top)
    rankings = _check_choices("ranking", rankings, RANKINGS)
    orders = _check_choices("order", orders, ORDERS)
    _check_target(graph, target)
    tset = transcoder_set(transcoders)
    if graph.n_features == 0:
        raise ConfigError("graph claims: the graph has no feature nodes to zero")
    tset.to(device=next(model.parameters()).device)
    tokens = graph.tokens
    token = int(graph.logit_tokens[target])
    clean = live_logits(model, tokens, tset, overrides=overrides)
    _check_graph_of(model, graph, clean, target)
    contributions = answer_contributions(graph, target)
    places: list[Place] = [tuple(p) for p in graph.features.tolist()]
    cases = []  # (ranking, order, N, the chosen feature nodes)
    for ranking in rankings:
        for order in orders:
            ranked = ranked_nodes(contributions[ranking].to_numpy(), order)
            cases += [(ranking, order, n, [int(i) for i in ranked[:n]]) for n in tops
                      if len(ranked)]  # fmt: skip
    zeroings = [[places[i] for i in chosen] for *_, chosen in cases]
    frozen_moves = {}
    for column, (mlps, freeze) in FROZEN_MODELS.items():
        if frozen:
            logits = frozen_logits(model, tokens, tset, places, zeroings, mlps=mlps,
                                   freeze=freeze, overrides=overrides)  # fmt: skip
            frozen_moves[column] = [
                _answer(z, token) - _answer(logits[0], token) for z in logits[1:]
            ]
        else:
            frozen_moves[column] = [float("nan")] * len(cases)
    rows = []
    for i, ((ranking, order, n, chosen), zeroed) in enumerate(zip(cases, zeroings, strict=True)):
        live = live_logits(model, tokens, tset, zeroed, overrides=overrides)
        direct = direct_change(graph, chosen, target)
        total = total_change(graph, chosen, target)
        moved = _answer(live, token) - _answer(clean, token)
        row = {
            "ranking": ranking, "order": order, "top": n, "zeroed": len(chosen),
            "features": ";".join(f"{a}/{b}/{c}" for a, b, c in zeroed),
            "direct": direct, "total": total, "live": moved,
            "live_logit": float(live[token] - clean[token]),
            "live_over_direct": _ratio(moved, direct), "live_over_total": _ratio(moved, total),
        }  # fmt: skip
        for column, moves in frozen_moves.items():
            row[column] = moves[i]
            row[f"{column}_over_total"] = _ratio(moves[i], total)
        rows.append(row)
    return pd.DataFrame(rows, columns=list(CLAIM_COLUMNS))


def ranked_nodes(contributions: np.ndarray, order: str) -> np.ndarray:
    """The feature nodes in `order` (ORDERS) of their `contributions`: those above 0, the
    largest first (positive); those below 0, the most negative first (negative); those not 0,
    the largest magnitude first (absolute); ties in node order."""
    key, keep = {
        "positive": (-contributions, contributions > 0),
        "negative": (contributions, contributions < 0),
        "absolute": (-np.abs(contributions), contributions != 0),
    }[order]
    ranked = np.argsort(key, kind="stable")
    return ranked[keep[ranked]]


def _answer(logits: torch.Tensor, token: int) -> float:
    """The graph's logit node's value: the token's logit minus the mean logit."""
    logits = logits.double()
    return float(logits[token] - logits.mean())


def _ratio(measured: float, predicted: float) -> float:
    return measured / predicted if predicted != 0 else float("nan")


def _check_graph_of(model, graph: GraphData, clean: torch.Tensor, target: int) -> None:
    """The model's clean answer probability is the graph's, or the graph is another model's or
    another prompt's (refused by name)."""
    got = float(torch.softmax(clean.double(), -1)[int(graph.logit_tokens[target])])
    want = float(graph.logit_probs[target])
    if abs(got - want) > 2e-3 + 2e-2 * want:  # (low precision: the batch of copies rounds)
        raise ConfigError(
            f"graph claims: the model gives the graph's answer token "
            f"{graph.logit_strings[target]!r} probability {got:.6g} on the graph's tokens, the "
            f"graph {want:.6g}; pass the model and transcoders the graph was attributed with"
        )


def _check_top(top) -> list[int]:
    values = [top] if isinstance(top, int) else list(top)
    bad = [n for n in values if isinstance(n, bool) or not isinstance(n, int) or n <= 0]
    if bad or not values:
        raise ConfigError(
            f"graph claims: top={top!r}; give the numbers of features to zero, each at least 1 "
            "(e.g. top=(1, 5, 10))"
        )
    return values


def _check_choices(what: str, given, known) -> list[str]:
    """`given` (one name or several) as a list, each one of `known`: ConfigError naming the first
    unknown one, or saying that none was given."""
    values = [given] if isinstance(given, str) else list(given)
    if not values:
        raise ConfigError(f"graph claims: no {what} given; choose from {', '.join(known)}")
    unknown = [v for v in values if v not in known]
    if unknown:
        raise ConfigError(
            f"graph claims: {what} {unknown[0]!r} is unknown; choose from {', '.join(known)}"
        )
    return values


def _check_target(graph: GraphData, target: int) -> None:
    if isinstance(target, bool) or not isinstance(target, int) or not 0 <= target < graph.n_logits:
        raise ConfigError(
            f"graph claims: target={target!r}; the graph has {graph.n_logits} logit nodes, so "
            f"give an index in [0, {graph.n_logits})"
        )
