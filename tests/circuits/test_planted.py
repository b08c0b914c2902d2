"""A planted circuit: a small transformer whose weights carry the answer (the token at position 0)
through three chosen heads, each moving it into the next one's value input, while every other
head and MLP reads and writes a subspace the answer never touches. EAP and exact patching put the
route's four edges on top; the circuit of those edges alone gives the clean metric, the empty
circuit the corrupt one, the full circuit the clean one."""

from __future__ import annotations

import numpy as np
import torch

from probe.circuits.context import BatchContext
from probe.circuits.exact import evaluate, evaluate_dataset
from probe.circuits.parts import parts_of
from probe.circuits.scores import attribute
from probe.circuits.task import Ablation, AnswerMetric, pair_batch
from probe.testing.toy_circuits import HEADS, ROUTE_EDGES, overrides, planted, planted_pairs


def test_the_top_edges_are_the_planted_route_and_the_circuit_is_faithful():
    parts = parts_of(planted(), overrides(HEADS))
    pairs = planted_pairs()
    scores = attribute(parts, [pairs], ["eap", "exact"])
    for method in ("eap", "exact"):
        top = [name for name, _ in scores[method].top(4)]
        assert sorted(top) == sorted(ROUTE_EDGES), (method, scores[method].top(6))
        values = np.sort(np.abs(scores[method].edges))[::-1]
        assert values[3] > 100 * values[4]  # nothing else carries the answer
    # the route's heads are the top nodes too
    nodes = np.array(parts.graph.senders)[np.argsort(-np.abs(scores["exact"].nodes))[:4]]
    assert set(nodes) == {"input", "a0.h1", "a1.h2", "a2.h0"}
    metric = AnswerMetric()
    ctx = BatchContext(parts, pair_batch(parts.model, pairs, metric), metric, Ablation())
    graph = parts.graph
    keep = np.zeros((3, graph.n_edges), dtype=bool)
    keep[0] = True  # the full model
    keep[1, [graph.edge_index(e) for e in ROUTE_EDGES]] = True  # the route alone
    got = evaluate(ctx, keep).double().mean(1).numpy()  # and the empty circuit
    with torch.no_grad():
        corrupt = parts.model(pairs["corrupt_ids"])[:, -1].double()
    rows = torch.arange(len(corrupt))
    corrupt = (corrupt[rows, pairs["answer"][:, 0]] - corrupt[rows, pairs["wrong"][:, 0]]).mean()
    clean = ctx.clean_metric.mean().item()
    assert clean > 0.1
    np.testing.assert_allclose(got, [clean, clean, corrupt.item()], rtol=1e-5, atol=1e-6)
    halves = [{k: v[i : i + 3] for k, v in pairs.items()} for i in (0, 3)]
    np.testing.assert_allclose(evaluate_dataset(parts, halves, keep), got, rtol=1e-6)
