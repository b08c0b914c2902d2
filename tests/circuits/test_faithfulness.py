"""Circuits cut from scores and their faithfulness: topn and greedy against a hand enumeration of
their definitions (by edge names and paths, not the graph's arrays), MIB's sizes and areas against
MIB's own loops written out, and faithfulness of the full, empty and planted circuits from real
patched forwards."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
import torch

from probe.circuits.component_graph import ComponentGraph
from probe.circuits.cut import (
    SIZES,
    check_sizes,
    edge_counts,
    greedy,
    importance,
    prune,
    select,
    topn,
)
from probe.circuits.exact import evaluate_dataset
from probe.circuits.faithfulness import Curve, areas, faithfulness, plan
from probe.circuits.parts import parts_of
from probe.circuits.scores import attribute
from probe.errors import ConfigError
from probe.testing.toy_circuits import HEADS, overrides, pairs, planted
from probe.testing.toy_circuits import ROUTE_EDGES as EDGES
from probe.testing.toy_circuits import planted_pairs as batch
from tests.circuits.test_hand import build

# One layer of one head: 8 edges. Written as a table by hand.
TABLE = {
    "input->a0.h0<q>": 0.9, "input->a0.h0<k>": 0.85, "input->a0.h0<v>": 0.1,
    "input->m0": 0.5, "a0.h0->m0": 0.02, "input->logits": 0.3, "a0.h0->logits": 0.01,
    "m0->logits": 0.4,
}  # fmt: skip


def key_of(graph: ComponentGraph, table: dict) -> np.ndarray:
    return np.array([table[e] for e in graph.edges])


def names(graph: ComponentGraph, keep: np.ndarray) -> set[str]:
    return {graph.edges[i] for i in np.nonzero(keep)[0]}


def test_topn_and_greedy_select_what_the_hand_worked_table_says():
    graph = ComponentGraph(1, 1, 1)
    key = key_of(graph, TABLE)
    # topn(3) takes q, k and input->m0: a0.h0 and m0 then lead nowhere, so pruning empties it
    assert names(graph, topn(graph, key, 3)) == set()
    assert names(graph, topn(graph, key, 4)) == {"input->m0", "m0->logits"}
    # greedy starts at the logits: m0->logits, then m0's inputs join the candidates
    assert names(graph, greedy(graph, key, 3)) == {"m0->logits", "input->m0", "input->logits"}
    assert names(graph, greedy(graph, key, 1)) == set()  # m0 reads nothing: pruned
    assert names(graph, select(graph, key, 8, "greedy")) == set(graph.edges)
    with pytest.raises(ConfigError, match="circuit.select='best'"):
        select(graph, key, 1, "best")


def node_of(receiver: str, kv_group: int) -> list[str]:
    """The nodes a receiver name feeds (a key/value head feeds its query heads)."""
    if receiver == "logits" or receiver.startswith("m"):
        return [receiver]
    head, kind = receiver[:-3], receiver[-2]
    layer, h = head.split(".h")
    if kind == "q":
        return [head]
    return [f"{layer}.h{j}" for j in range(int(h) * kv_group, (int(h) + 1) * kv_group)]


def on_a_path(edges: set[str], kv_group: int) -> set[str]:
    """The edges of `edges` on some path input -> ... -> logits, by search over names."""
    out = {}
    for e in edges:
        s, r = e.split("->")
        out.setdefault(s, []).extend((e, n) for n in node_of(r, kv_group))
    from_input = {"input"}
    frontier = ["input"]
    while frontier:
        for _, n in out.get(frontier.pop(), []):
            if n not in from_input:
                from_input.add(n)
                frontier.append(n)
    to_logits = {"logits"}
    changed = True
    while changed:
        changed = False
        for s, targets in out.items():
            if s not in to_logits and any(n in to_logits for _, n in targets):
                to_logits.add(s)
                changed = True
    return {
        e for s, targets in out.items() for e, n in targets
        if s in from_input and n in to_logits
    }  # fmt: skip


def hand_greedy(graph: ComponentGraph, table: dict, n: int, kv_group: int) -> set[str]:
    """The definition step by step: the best edge into a node already in the circuit (the logits
    at first) joins, and its sender with it."""
    nodes, chosen = {"logits"}, set()
    for _ in range(n):
        candidates = [
            e for e in graph.edges
            if e not in chosen and set(node_of(e.split("->")[1], kv_group)) & nodes
        ]  # fmt: skip
        best = max(candidates, key=lambda e: (table[e], -graph.edges.index(e)))
        chosen.add(best)
        nodes.add(best.split("->")[0])
    return on_a_path(chosen, kv_group)


@pytest.mark.parametrize("absolute", [True, False])
def test_topn_and_greedy_equal_a_hand_enumeration_on_grouped_query_attention(absolute):
    graph = ComponentGraph(2, 4, 2)  # a key/value head serves two query heads
    scores = np.random.default_rng(3).normal(size=graph.n_edges)
    key = importance(scores, "logit_diff", absolute)
    table = dict(zip(graph.edges, key, strict=True))
    order = sorted(graph.edges, key=lambda e: -table[e])
    for n in (1, 5, 12, 30, 60, graph.n_edges):
        assert names(graph, topn(graph, key, n)) == on_a_path(set(order[:n]), 2), n
        assert names(graph, greedy(graph, key, n)) == hand_greedy(graph, table, n, 2), n
    kept = greedy(graph, key, 30)
    assert (prune(graph, kept) == kept).all()


def test_signed_importance_puts_the_edges_the_answer_needs_first():
    scores = np.array([-2.0, 1.0, -0.5, 3.0])
    assert list(np.argsort(-importance(scores, "logit_diff", False))) == [0, 2, 1, 3]
    assert list(np.argsort(-importance(scores, "kl", False))) == [3, 1, 2, 0]
    assert list(np.argsort(-importance(scores, "answer_prob", True))) == [3, 0, 1, 2]


def test_sizes_are_mibs_and_bad_sizes_are_named():
    percentages = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)  # MIB's, as fractions
    for n in (32491, 1108, 97):
        assert list(edge_counts(SIZES, n)) == [int(p * n) for p in percentages]
    for bad in ([0], [150], [-1, 5], [], ["x"]):
        with pytest.raises(ConfigError, match=re.escape(f"circuit.sizes={bad!r}")):
            check_sizes(bad)
    assert check_sizes([50, 0.1, 100]) == (0.1, 50.0, 100.0)


def mib_areas(faithfulnesses):
    """MIB_circuit_track/evaluation.py's loop, as written there (log_scale=False)."""
    percentages = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1)
    area_under = area_from_1 = 0.0
    for i in range(len(faithfulnesses) - 1):
        x_1, x_2 = percentages[i], percentages[i + 1]
        trapezoidal = (x_2 - x_1) * ((abs(1.0 - faithfulnesses[i])) + (abs(1.0 - faithfulnesses[i + 1]))) / 2  # fmt: skip
        area_from_1 += trapezoidal
        trapezoidal = (x_2 - x_1) * ((faithfulnesses[i] + faithfulnesses[i + 1]) / 2)
        area_under += trapezoidal
    return area_under, area_from_1


def test_cpr_and_cmd_equal_mibs_loop_on_a_hand_made_curve():
    curve = [-0.2, 0.1, 0.3, 0.6, 1.3, 0.9, 1.05, 0.97, 1.0]  # below 0 and above 1: no clipping
    cpr, cmd = areas(SIZES, curve)
    want = mib_areas([*curve, 1.0])  # MIB's curve ends at 100%, faithfulness 1
    assert (cpr, cmd) == pytest.approx(want, rel=1e-12)
    # by hand, the last trapezoid alone: from 50% to 100% at faithfulness 1 and 1
    assert areas([50], [1.0]) == pytest.approx((0.5, 0.0))
    assert areas([50], [0.0]) == pytest.approx((0.25, 0.25))
    assert areas([20, 100], [0.5, 1.0]) == areas([20], [0.5])
    assert np.isnan(faithfulness([1.0], 2.0, 2.0)).all()


def test_full_and_empty_circuits_score_one_and_zero_by_construction():
    """On a tiny Llama, every size below one edge is the empty circuit (the corrupt run's
    metric) and 100% the full one (the clean run's), read here from plain forwards."""
    model = build("llama")
    parts = parts_of(model)
    b1, b2 = pairs(50, n=3, seed=1), pairs(50, n=2, seed=2)
    scores = attribute(parts, [b1, b2], ["eap"])
    circuits = plan(parts.graph, {"eap": scores["eap"].edges}, [0.01, 10, 100], "greedy", True,
                    "logit_diff")  # fmt: skip
    values = evaluate_dataset(parts, [b1, b2], circuits.keep)
    curve = circuits.curves(values)["eap"]
    metric = []
    with torch.no_grad():
        for ids in ("input_ids", "corrupt_ids"):
            rows = []
            for b in (b1, b2):
                logits = model(b[ids]).logits[:, -1].double()
                r = torch.arange(len(logits))
                rows.append(logits[r, b["answer"][:, 0]] - logits[r, b["wrong"][:, 0]])
            metric.append(torch.cat(rows).mean().item())
    # (float32 forwards batched otherwise: the logits' last bits, about 1e-6 of the metric)
    assert curve.full == pytest.approx(metric[0], rel=1e-5, abs=1e-6)
    assert curve.empty == pytest.approx(metric[1], rel=1e-5, abs=1e-6)
    assert abs(curve.full - curve.empty) > 0.1
    assert curve.asked == (0, int(0.1 * parts.graph.n_edges), parts.graph.n_edges)
    f = curve.faithfulness
    assert f[0] == 0 and f[2] == 1  # exactly: the same numbers
    assert 0 < curve.edges[1] <= curve.asked[1]
    cpr, cmd = curve.areas
    assert (cpr, cmd) == pytest.approx(areas([0.01, 10, 100], f))


def test_the_planted_circuit_is_faithful_and_the_empty_one_is_not():
    parts = parts_of(planted(), overrides(HEADS))
    pairs_ = batch()
    scores = attribute(parts, [pairs_], ["eap", "exact"])
    n = parts.graph.n_edges
    four = 4.5 / n * 100  # int(size / 100 x edges) = 4: the route's edges
    circuits = plan(parts.graph, {m: s.edges for m, s in scores.items()}, [0.1 / n, four],
                    "greedy", False, "logit_diff")  # fmt: skip
    curves = circuits.curves(evaluate_dataset(parts, [pairs_], circuits.keep))
    for method, curve in curves.items():
        route = circuits.keep[circuits.rows[method][1]]
        assert names(parts.graph, route) == set(EDGES), method
        np.testing.assert_allclose(curve.faithfulness, [0.0, 1.0], atol=1e-6)
        assert curve.edges == (0, 4)
    assert len(circuits.keep) == 3  # the methods' circuits are one: evaluated once
    assert isinstance(curves["eap"], Curve)


def test_every_cut_of_a_small_table_is_connected():
    graph = ComponentGraph(2, 2, 1, parallel=True)
    key = np.random.default_rng(0).random(graph.n_edges)
    for n, how in itertools.product(range(0, graph.n_edges + 1, 7), ("topn", "greedy")):
        kept = select(graph, key, n, how)
        assert names(graph, kept) == on_a_path(names(graph, kept), 2)
        assert kept.sum() <= n
