"""Pruning and scores on the sparse adjacency equal circuit-tracer's dense prune_graph and
compute_graph_scores: a numpy transcription of them here, and circuit-tracer itself where it
imports (its 0.5.0 source unpacked at $PROBE_CIRCUIT_TRACER_SRC, as .ci/run does)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from probe.errors import ConfigError
from probe.graphs.attribution_graph import AttributionGraph
from probe.graphs.pruning import prune
from probe.testing.peers import circuit_tracer_source


def random_graph(seed: int, n_f=30, n_layers=2, n_pos=5, n_logits=3, density=0.3):
    """An acyclic graph of circuit-tracer's shape: feature rows read earlier features, errors and
    tokens; logit rows read every non-logit node."""
    rng = np.random.default_rng(seed)
    n = n_f + (n_layers + 1) * n_pos + n_logits
    a = np.zeros((n, n))
    for i in range(n_f):
        cols = np.r_[np.arange(i), np.arange(n_f, n - n_logits)]
        pick = cols[rng.random(len(cols)) < density]
        a[i, pick] = rng.normal(size=len(pick)) * rng.lognormal(size=len(pick))
    for i in range(n - n_logits, n):
        cols = np.arange(n - n_logits)
        pick = cols[rng.random(len(cols)) < density * 2]
        a[i, pick] = rng.normal(size=len(pick))
    probs = rng.dirichlet(np.ones(n_logits)) * 0.95
    feats = torch.tensor(
        [[min(i * n_layers // n_f, n_layers - 1), 1 + i % (n_pos - 1), i] for i in range(n_f)]
    )
    graph = AttributionGraph(
        tokens=torch.arange(n_pos), token_strings=[str(i) for i in range(n_pos)],
        n_layers=n_layers, features=feats, activations=torch.ones(n_f),
        logit_tokens=torch.arange(n_logits), logit_probs=torch.tensor(probs, dtype=torch.float32),
        logit_strings=[str(i) for i in range(n_logits)],
        adjacency=torch.tensor(a, dtype=torch.float32).to_sparse().coalesce(),
    )  # fmt: skip
    return graph, a.astype(np.float32).astype(np.float64), graph.logit_probs.double().numpy()


def dense_prune(a, probs, n_f, n_pos, n_layers, node_t, edge_t):
    """circuit-tracer's prune_graph and compute_graph_scores (0.5.0), transcribed densely."""
    n, n_logits = a.shape[0], len(probs)

    def normalise(m):
        m = np.abs(m)
        return m / np.clip(m.sum(1, keepdims=True), 1e-10, None)

    def influence(m, w):
        current = w @ m
        total = current.copy()
        while current.any():
            current = current @ m
            total += current
        return total

    def threshold(scores, t):
        s = np.sort(scores)[::-1]
        cum = np.cumsum(s) / s.sum()
        return s[min(int(np.searchsorted(cum, t)), len(cum) - 1)]

    w = np.zeros(n)
    w[-n_logits:] = probs
    node_inf = influence(normalise(a), w)
    node_mask = node_inf >= threshold(node_inf, node_t)
    node_mask[-n_logits - n_pos :] = True
    pruned = a.copy()
    pruned[~node_mask] = 0
    pruned[:, ~node_mask] = 0
    norm_p = normalise(pruned)
    edge_scores = norm_p * (influence(norm_p, w) + w)[:, None]
    edge_mask = edge_scores >= threshold(edge_scores.flatten(), edge_t)
    old = node_mask.copy()
    node_mask[: -n_logits - n_pos] &= edge_mask[:, : -n_logits - n_pos].any(0)
    node_mask[:n_f] &= edge_mask[:n_f].any(1)
    while not (node_mask == old).all():
        old[:] = node_mask
        edge_mask[~node_mask] = False
        edge_mask[:, ~node_mask] = False
        node_mask[: -n_logits - n_pos] &= edge_mask[:, : -n_logits - n_pos].any(0)
        node_mask[:n_f] &= edge_mask[:n_f].any(1)
    e0, e1 = n_f, n_f + n_pos * n_layers
    norm = normalise(a)
    tok, err = node_inf[e1 : e1 + n_pos].sum(), node_inf[e0:e1].sum()
    out = node_inf + w
    completeness = ((1 - norm[:, e0:e1].sum(-1)) * out).sum() / out.sum()
    return node_inf, node_mask, edge_mask, tok / (tok + err), completeness


def edge_mask_of(graph):
    dense = torch.zeros(graph.n_nodes, graph.n_nodes, dtype=torch.bool)
    r, c = graph.adjacency.indices()
    dense[r[graph.edge_kept], c[graph.edge_kept]] = True
    return dense.numpy()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("thresholds", [(0.8, 0.98), (0.5, 0.7), (0.95, 0.999)])
def test_sparse_prune_equals_the_dense_transcription(seed, thresholds):
    graph, a, probs = random_graph(seed)
    prune(graph, *thresholds)
    inf, node_mask, edge_mask, replacement, completeness = dense_prune(
        a, probs, graph.n_features, graph.n_pos, graph.n_layers, *thresholds
    )
    np.testing.assert_allclose(graph.influence.numpy(), inf, rtol=1e-12, atol=1e-15)
    assert (graph.node_kept.numpy() == node_mask).all()
    # stored entries: kept exactly where the dense mask is (a dense-only True is a zero entry)
    assert (edge_mask_of(graph) == (edge_mask & (a != 0))).all()
    assert graph.scores["replacement"] == pytest.approx(replacement, rel=1e-12)
    assert graph.scores["completeness"] == pytest.approx(completeness, rel=1e-12)
    assert 0 < graph.node_kept.sum() < graph.n_nodes


@pytest.mark.parametrize("seed", range(4))
def test_prune_equals_circuit_tracer(seed):
    if circuit_tracer_source() is None:
        pytest.skip("circuit-tracer's source is not unpacked at $PROBE_CIRCUIT_TRACER_SRC")
    ct = pytest.importorskip("circuit_tracer.graph")
    graph, a, probs = random_graph(seed)
    prune(graph)
    peer = SimpleNamespace(
        input_tokens=graph.tokens, logit_targets=list(range(graph.n_logits)),
        selected_features=torch.arange(graph.n_features), adjacency_matrix=torch.tensor(a),
        logit_probabilities=torch.tensor(probs), cfg=SimpleNamespace(n_layers=graph.n_layers),
    )  # fmt: skip
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # the peer's zeros() take the default dtype
    try:
        node_mask, edge_mask, cumulative = ct.prune_graph(peer, 0.8, 0.98)
        replacement, completeness = ct.compute_graph_scores(peer)
    finally:
        torch.set_default_dtype(default)
    assert torch.equal(graph.node_kept, node_mask)
    assert (edge_mask_of(graph) == (edge_mask.numpy() & (a != 0))).all()
    torch.testing.assert_close(graph.cumulative, cumulative, rtol=1e-12, atol=1e-15)
    assert graph.scores["replacement"] == pytest.approx(replacement, rel=1e-12)
    assert graph.scores["completeness"] == pytest.approx(completeness, rel=1e-12)


def test_the_method_prunes_and_thresholds_are_checked():
    graph, _, _ = random_graph(0)
    assert graph.prune(node_threshold=0.5) is graph and graph.node_kept is not None
    with pytest.raises(ConfigError, match=r"graph.edge_threshold=1.5"):
        graph.prune(edge_threshold=1.5)
