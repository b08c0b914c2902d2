"""Circuits cut from edge scores, as hannamw/EAP-IG (`eap/graph.py`) and MIB cut them.

- `edge_counts`: a size in percent of the graph's edges becomes int(size / 100 x edges) edges
  (MIB's `int(pct * n_scored_items)`).
- `importance`: what ranks edges. Absolute: |score|. Signed: the edges whose ablation moves the
  metric away from the clean run's first: the most negative scores for a metric that rises with
  the answer (logit_diff, answer_logprob, answer_prob), the most positive for a distance from the
  clean run (kl, output_change). (EAP-IG scores a loss, the negated logit difference, and takes
  the largest: the same edges.)
- `topn`: the n edges of largest importance (`apply_topn`), ties by edge order.
- `greedy`: grown from the logits backwards (`apply_greedy`): the candidates are the edges into
  the logits; the best candidate joins, and when its sender joins the circuit for the first time
  the edges into that sender's receivers (a head's q, k and v, an MLP's input) become
  candidates; n times. Every edge it picks leads to the logits.
- `prune`: what both do last (`prune`): nodes without an edge in (the input excepted) or out
  (the logits excepted) leave, with their edges, until nothing changes: what remains is exactly
  the edges on some path from the input to the logits. A circuit may hold fewer edges than asked.

Nodes are senders (by graph index) and the logits; a head's inputs are its own q receiver and
its key/value head's k and v receivers (grouped-query attention: a key/value receiver feeds every
head of its group).
"""

from __future__ import annotations

import heapq

import numpy as np

from probe.circuits.component_graph import ComponentGraph
from probe.config import CIRCUIT_SELECTS
from probe.errors import ConfigError

SELECTS = CIRCUIT_SELECTS
SIZES = (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50)  # MIB's, in percent of the edges
RISES_WITH_ANSWER = ("logit_diff", "answer_logprob", "answer_prob")


def check_sizes(sizes) -> tuple[float, ...]:
    """Sizes in percent, each in (0, 100], sorted; a ConfigError names a bad one."""
    try:
        out = tuple(sorted(float(s) for s in sizes))
    except (TypeError, ValueError):
        raise ConfigError(
            f"circuit.sizes={list(sizes)!r} must be numbers: percents of the graph's edges in "
            "(0, 100], e.g. [0.1, 1, 10, 50]"
        ) from None
    bad = [s for s in out if not 0 < s <= 100]
    if bad or not out:
        raise ConfigError(
            f"circuit.sizes={list(sizes)!r}: each size is a percent of the graph's edges in "
            f"(0, 100]{f'; {bad[0]:g} is not' if bad else ''}; e.g. circuit.sizes=[0.1,1,10,50]"
        )
    return tuple(dict.fromkeys(out))


def edge_counts(sizes, n_edges: int) -> np.ndarray:
    """The number of edges MIB takes at each size (percent): int(size / 100 x n_edges)."""
    return np.array([int(s / 100 * n_edges) for s in check_sizes(sizes)], dtype=np.int64)


def importance(scores: np.ndarray, metric: str, absolute: bool) -> np.ndarray:
    """(E,) larger first: |score|, or the signed score turned so that an edge the answer needs
    ranks high (negated for a metric that rises with the answer)."""
    scores = np.asarray(scores, dtype=np.float64)
    if absolute:
        return np.abs(scores)
    return -scores if metric in RISES_WITH_ANSWER else scores


def topn(graph: ComponentGraph, key: np.ndarray, n: int) -> np.ndarray:
    """(E,) bool: the n edges of largest `key`, ties by edge order, pruned."""
    _check_count(graph, n)
    keep = np.zeros(graph.n_edges, dtype=bool)
    keep[np.argsort(-np.asarray(key), kind="stable")[:n]] = True
    return prune(graph, keep)


def greedy(graph: ComponentGraph, key: np.ndarray, n: int) -> np.ndarray:
    """(E,) bool: n edges grown from the logits backwards (see the module), pruned."""
    _check_count(graph, n)
    key = np.asarray(key, dtype=np.float64)
    feeds = graph.feeds[:, :-1]
    heap: list[tuple[float, int]] = []
    pushed = np.zeros(graph.n_receivers, dtype=bool)
    joined = np.zeros(graph.n_senders, dtype=bool)

    def push(receiver: int) -> None:
        if not pushed[receiver]:
            pushed[receiver] = True
            for e in graph.receiver_edges(receiver):
                heapq.heappush(heap, (-key[e], e))

    push(graph.n_receivers - 1)  # the logits
    keep = np.zeros(graph.n_edges, dtype=bool)
    for _ in range(n):
        _, e = heapq.heappop(heap)
        keep[e] = True
        s = graph.edge_sender[e]
        if not joined[s]:
            joined[s] = True
            for r in np.nonzero(feeds[:, s])[0]:
                push(int(r))
    return prune(graph, keep)


def prune(graph: ComponentGraph, keep: np.ndarray) -> np.ndarray:
    """(E,) bool: `keep` without the edges on no path from the input to the logits."""
    keep = np.asarray(keep, dtype=bool).copy()
    feeds = graph.feeds
    sender, receiver = graph.edge_sender, graph.edge_receiver
    while True:
        has_out = np.zeros(graph.n_senders, dtype=bool)
        has_out[sender[keep]] = True
        read = np.zeros(graph.n_receivers, dtype=bool)
        read[receiver[keep]] = True
        # numpy's stub: any over an axis is an array (its type allows a scalar)
        has_in = feeds[read].any(0)[:-1]  # type: ignore[index]
        has_in[0] = True  # the input reads nothing
        nodes = np.append(has_out & has_in, True)  # the logits stay
        live = (feeds & nodes).any(1)  # receivers of a node that stays
        pruned = keep & nodes[sender] & live[receiver]
        if (pruned == keep).all():
            return keep
        keep = pruned


def select(graph: ComponentGraph, key: np.ndarray, n: int, how: str = "topn") -> np.ndarray:
    """(E,) bool: the circuit of `n` edges by `how` (topn or greedy), pruned."""
    if how == "topn":
        return topn(graph, key, n)
    if how == "greedy":
        return greedy(graph, key, n)
    raise ConfigError(f"circuit.select={how!r} is unknown; choose from {', '.join(SELECTS)}")


def circuits(graph: ComponentGraph, key: np.ndarray, sizes, how: str = "topn") -> np.ndarray:
    """(len(sizes), E) bool: one circuit per size (percent of the edges), sizes ascending."""
    counts = edge_counts(sizes, graph.n_edges)
    if len(key) != graph.n_edges:
        raise ConfigError(f"circuits: {len(key)} scores for a graph of {graph.n_edges} edges")
    return np.stack([select(graph, key, int(n), how) for n in counts])


def _check_count(graph: ComponentGraph, n: int) -> None:
    if not 0 <= n <= graph.n_edges:
        raise ConfigError(f"circuits: {n} edges asked of a graph of {graph.n_edges}")
