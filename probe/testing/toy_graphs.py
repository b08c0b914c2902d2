"""Hand-made attribution graphs for tests of what is built on AttributionGraph (files, tables,
runs): a graph decided by a prompt's token ids alone, a pruning that fills what pruning fills,
and a QK table decided by the graph. None computes anything real: they stand in for
probe.graphs.attribution, probe.graphs.pruning and probe.graphs.qk_attribution where those are
not under test."""

from __future__ import annotations

import pandas as pd
import torch

from probe.graphs.attribution_graph import AttributionGraph
from probe.graphs.graph_data import QK_COLUMNS


def toy_graph(tokens: torch.Tensor, n_layers: int = 2, vocab: int = 40, density: float = 0.3,
              names=None) -> AttributionGraph:  # fmt: skip
    """A graph of `tokens` (1-D ids): features at every layer and position chosen by the token
    (one or two of 5), two logits, edges between random pairs of nodes with weights drawn from
    a generator seeded by the tokens; `names(ids)` gives the token strings (default: the ids)."""
    tokens = tokens.long().cpu()
    n_pos = len(tokens)
    rows = sorted(
        {(layer, p, (int(t) * 7 + layer * 3) % 5) for layer in range(n_layers) for p, t in
         enumerate(tokens)} | {(layer, p, (int(t) + layer) % 5) for layer in range(n_layers)
                               for p, t in enumerate(tokens)}
    )  # fmt: skip
    features = torch.tensor(rows, dtype=torch.int64).reshape(-1, 3)
    activations = 1 + ((tokens[features[:, 1]] + features[:, 2]) % 3).float() * 0.5
    last = int(tokens[-1])
    logit_tokens = torch.tensor([(last + 1) % vocab, (last + 2) % vocab])
    name = names or (lambda ids: [str(i) for i in ids])
    n = len(rows) + n_layers * n_pos + n_pos + 2
    g = torch.Generator().manual_seed(int(tokens.sum()) * 31 + n_pos)
    mask = torch.rand(n, n, generator=g) < density
    mask.fill_diagonal_(False)
    weights = torch.randn(n, n, generator=g) * mask
    return AttributionGraph(
        tokens=tokens,
        token_strings=name(tokens.tolist()),
        n_layers=n_layers,
        features=features,
        activations=activations.float(),
        logit_tokens=logit_tokens,
        logit_probs=torch.tensor([0.6, 0.3]),
        logit_strings=name(logit_tokens.tolist()),
        adjacency=weights.float().to_sparse().coalesce(),
        floor=0.0,
        active_features=len(rows) + 1,
    )


def toy_prune(graph: AttributionGraph, node_threshold: float = 0.8,
              edge_threshold: float = 0.98) -> AttributionGraph:  # fmt: skip
    """`graph` with influence (each node's total |weight| out), node_kept (tokens, logits and
    the nodes at or above the `1 - node_threshold` quantile of influence), edge_kept (edges
    between kept nodes at or above the `1 - edge_threshold` quantile of |weight|) and two
    scores filled."""
    a = graph.adjacency.coalesce()
    target, source = a.indices()
    weight = a.values().double().abs()
    influence = torch.zeros(graph.n_nodes, dtype=torch.float64).index_add_(0, source, weight)
    kept = influence >= torch.quantile(influence, 1 - node_threshold)
    kept[graph.offsets["token"] :] = True
    edge_kept = kept[target] & kept[source] & (weight >= torch.quantile(weight, 1 - edge_threshold))
    graph.influence, graph.node_kept, graph.edge_kept = influence, kept, edge_kept
    graph.scores = {"replacement": float(kept.double().mean()),
                    "completeness": float(edge_kept.double().mean())}  # fmt: skip
    return graph


def toy_qk(graph: AttributionGraph, heads: int = 2) -> pd.DataFrame:
    """A QK table (QK_COLUMNS) of `graph`: per layer and head, the last position attending to
    itself and to position 0, each pair a token cell, a bias cell, a `rest` cell and a
    query-side marginal, values drawn from a generator seeded by the graph's tokens."""
    n_pos, token = graph.n_pos, graph.offsets["token"]
    g = torch.Generator().manual_seed(int(graph.tokens.sum()) * 17 + n_pos)
    q, rows = n_pos - 1, []
    for layer in range(graph.n_layers):
        for head in range(heads):
            for k in sorted({0, q}):
                cells = torch.randn(3, generator=g, dtype=torch.float64).tolist()
                score, pattern = sum(cells), float(torch.rand(1, generator=g, dtype=torch.float64))
                pair, tail = (layer, head, q, k), (score, pattern)
                rows += [
                    (*pair, token + q, token + k, f"token@{q}", f"token@{k}", cells[0], *tail),
                    (*pair, -1, -1, "bias", "bias", cells[1], *tail),
                    (*pair, -1, -1, "rest", "rest", cells[2], *tail),
                    (*pair, token + q, -1, f"token@{q}", "*", cells[0] + cells[1], *tail),
                ]
    return pd.DataFrame(rows, columns=list(QK_COLUMNS))
