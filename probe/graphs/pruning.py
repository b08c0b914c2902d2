"""Pruning an attribution graph and scoring it, on its sparse adjacency: circuit-tracer's
prune_graph and compute_graph_scores (0.5.0) without a nodes x nodes matrix.

Influence: the rows of |A| normalised to sum 1, the power series w A + w A^2 + ... seeded with the
logit probabilities w (a graph is acyclic, so the series ends). Nodes are kept, most influential
first, up to `node_threshold` of the total influence (tokens and logits always); the edges of the
graph on those nodes are scored by their normalised weight x (their target's influence + its
logit weight) and kept up to `edge_threshold` of the total score; then, until nothing changes,
feature and error nodes without a kept outgoing edge and feature nodes without a kept incoming
edge are dropped, with their edges. Replacement score: the share of the tokens' influence in the
tokens' and errors' together; completeness score: the influence-weighted share of the nodes'
normalised inputs that come from non-error nodes. All in float64.
"""

from __future__ import annotations

from typing import TypeVar

import torch

from probe.errors import ConfigError
from probe.graphs.graph_data import GraphData

G = TypeVar("G", bound=GraphData)  # the graph given is the graph returned


def _check(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise ConfigError(f"graph.{name}={value!r}: a fraction of the influence in [0, 1]")
    return float(value)


class _Sparse:
    """A graph's adjacency as COO arrays, its |weights| normalised by row in float64."""

    def __init__(self, rows: torch.Tensor, cols: torch.Tensor, values: torch.Tensor, n: int):
        self.rows, self.cols, self.n = rows, cols, n
        a = values.abs().double()
        sums = torch.zeros(n, dtype=torch.float64).index_add_(0, rows, a).clamp(min=1e-10)
        self.norm = a / sums[rows]

    def influence(self, weights: torch.Tensor, max_iter: int = 1000) -> torch.Tensor:
        """sum_k weights A^k (k >= 1) on the normalised adjacency."""
        current = self._times(weights)
        total = current.clone()
        for _ in range(max_iter):
            if not current.any():
                return total
            current = self._times(current)
            total += current
        raise ConfigError(
            f"graphs: influence did not converge after {max_iter} steps; the adjacency has a "
            "cycle (an attribution graph is acyclic)"
        )

    def _times(self, v: torch.Tensor) -> torch.Tensor:
        """v @ A."""
        return torch.zeros(self.n, dtype=torch.float64).index_add_(
            0, self.cols, self.norm * v[self.rows]
        )


def find_threshold(scores: torch.Tensor, threshold: float, length: int | None = None) -> float:
    """The score that keeps `threshold` of the total (circuit-tracer's find_threshold) over
    `scores` followed by `length - len(scores)` zeros (the entries a sparse matrix leaves out)."""
    length = scores.numel() if length is None else length
    ordered = torch.sort(scores, descending=True).values
    cumulative = torch.cumsum(ordered, 0) / ordered.sum()
    index = int(torch.searchsorted(cumulative, torch.tensor(threshold, dtype=cumulative.dtype)))
    index = min(index, length - 1)
    return float(ordered[index]) if index < ordered.numel() else 0.0


def _logit_weights(graph: GraphData) -> torch.Tensor:
    w = torch.zeros(graph.n_nodes, dtype=torch.float64)
    w[graph.n_nodes - graph.n_logits :] = graph.logit_probs.double().cpu()
    return w


def _coo(graph: GraphData) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, columns, values) of the graph's adjacency, on the CPU."""
    a = graph.adjacency.coalesce()
    rows, cols = a.indices().cpu()
    return rows, cols, a.values().cpu()  # float32: _Sparse keeps only the float64 norm


def prune(graph: G, node_threshold: float = 0.8, edge_threshold: float = 0.98) -> G:
    """`graph` with `influence`, `cumulative`, `node_kept`, `edge_kept` and `scores` filled (the
    same object, returned)."""
    node_threshold = _check("node_threshold", node_threshold)
    edge_threshold = _check("edge_threshold", edge_threshold)
    n, n_logits, n_pos, n_f = graph.n_nodes, graph.n_logits, graph.n_pos, graph.n_features
    n_fe = n - n_logits - n_pos  # features and errors
    rows, cols, values = _coo(graph)
    weights = _logit_weights(graph)
    full = _Sparse(rows, cols, values, n)
    influence = full.influence(weights)

    node_mask = influence >= find_threshold(influence, node_threshold)
    node_mask[n_fe:] = True
    inside = node_mask[rows] & node_mask[cols]
    pruned = _Sparse(rows, cols, torch.where(inside, values, 0.0), n)
    edge_influence = pruned.influence(weights) + weights
    scores = pruned.norm * edge_influence[rows]
    threshold = find_threshold(scores[scores > 0], edge_threshold, n * n)
    if threshold > 0:
        edge_mask = scores >= threshold
        while True:
            old = node_mask.clone()
            edge_mask &= node_mask[rows] & node_mask[cols]
            has_out = torch.zeros(n, dtype=torch.bool)
            has_out[cols[edge_mask]] = True
            has_in = torch.zeros(n, dtype=torch.bool)
            has_in[rows[edge_mask]] = True
            node_mask[:n_fe] &= has_out[:n_fe]
            node_mask[:n_f] &= has_in[:n_f]
            if torch.equal(node_mask, old):
                break
    else:  # the threshold reached the zeros: every entry passes (circuit-tracer's edge case)
        edge_mask = torch.ones(rows.shape[0], dtype=torch.bool)

    ordered, order = torch.sort(influence, descending=True)
    cumulative = torch.zeros(n, dtype=torch.float64)
    cumulative[order] = torch.cumsum(ordered, 0) / ordered.sum()

    graph.influence = influence
    graph.cumulative = cumulative
    graph.node_kept = node_mask
    graph.edge_kept = edge_mask
    graph.scores = graph_scores(graph, full, influence, weights)
    return graph


def graph_scores(
    graph: GraphData,
    full: _Sparse | None = None,
    influence: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> dict[str, float]:
    """The replacement and completeness scores (circuit-tracer's compute_graph_scores)."""
    n = graph.n_nodes
    if full is None:
        full = _Sparse(*_coo(graph), n)
    weights = _logit_weights(graph) if weights is None else weights
    influence = full.influence(weights) if influence is None else influence
    err0 = graph.n_features
    err1 = err0 + graph.n_errors
    tok1 = err1 + graph.n_pos
    tokens, errors = influence[err1:tok1].sum(), influence[err0:err1].sum()
    replacement = float(tokens / (tokens + errors))
    from_errors = (full.cols >= err0) & (full.cols < err1)
    error_share = torch.zeros(n, dtype=torch.float64).index_add_(
        0, full.rows[from_errors], full.norm[from_errors]
    )
    output = influence + weights
    completeness = float(((1 - error_share) * output).sum() / output.sum())
    return {"replacement": replacement, "completeness": completeness}
