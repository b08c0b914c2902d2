"""Edge and node scores over a dataset of pairs: every method on the same batches, accumulated
as float64 sums, sums of squares and counts, so batches, runs and ranks merge exactly.

    parts = parts_of(model)
    scores = attribute(parts, loader, methods=["eap", "exact"], metric=AnswerMetric("logit_diff"))
    scores["eap"].edges        # (E,) mean score per edge, in parts.graph.edges order
    scores["eap"].nodes        # (S,) per sender: its total effect
    scores["eap"].top(20)      # [(edge name, score)] by absolute score

A score is the metric's change when the edge is ablated (estimated by the gradient methods, by
a patched forward for `exact`), averaged over pairs: negative for an edge the answer needs. A
node's score is the sum of its out-edges' scores for the gradient methods (exactly the gradient
with respect to its write: every path out of a sender starts at one of its edges) and its own
patched forward for `exact`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from probe.circuits import eap as gradient
from probe.circuits.component_graph import ComponentGraph
from probe.circuits.context import BatchContext
from probe.circuits.exact import PER_FORWARD, exact_edges, exact_nodes
from probe.circuits.parts import Parts
from probe.circuits.receiver_grads import CHUNK_BYTES
from probe.circuits.task import Ablation, AnswerMetric, pair_batch
from probe.errors import ConfigError
from probe.intervene.metrics import check_logits
from probe.shared_checks import check_exact, check_steps, circuit_methods

STEPS = 5


@dataclass(init=False)
class EdgeScores:
    """One method's scores: per edge and per sender, sums and sums of squares over samples (of
    each sample's score) and the number of samples (sums not given start at zero)."""

    graph: ComponentGraph
    method: str
    edge_sum: np.ndarray
    edge_sumsq: np.ndarray
    node_sum: np.ndarray
    node_sumsq: np.ndarray
    count: int

    def __init__(
        self,
        graph: ComponentGraph,
        method: str,
        edge_sum: np.ndarray | None = None,
        edge_sumsq: np.ndarray | None = None,
        node_sum: np.ndarray | None = None,
        node_sumsq: np.ndarray | None = None,
        count: int = 0,
    ) -> None:
        e, s = graph.n_edges, graph.n_senders
        self.graph, self.method, self.count = graph, method, count
        self.edge_sum = np.zeros(e) if edge_sum is None else edge_sum
        self.edge_sumsq = np.zeros(e) if edge_sumsq is None else edge_sumsq
        self.node_sum = np.zeros(s) if node_sum is None else node_sum
        self.node_sumsq = np.zeros(s) if node_sumsq is None else node_sumsq

    def add(self, edges: torch.Tensor, nodes: torch.Tensor) -> None:
        """Add per-sample scores: edges (N, E), nodes (N, S)."""
        e, n = edges.double(), nodes.double()
        self.edge_sum += e.sum(0).cpu().numpy()
        self.edge_sumsq += e.square().sum(0).cpu().numpy()
        self.node_sum += n.sum(0).cpu().numpy()
        self.node_sumsq += n.square().sum(0).cpu().numpy()
        self.count += len(e)

    def merge(self, other: EdgeScores) -> EdgeScores:
        """The scores of both sets of samples (same graph and method)."""
        if other.graph != self.graph or other.method != self.method:
            raise ConfigError(
                f"circuits: cannot merge {other.method} scores of another graph into {self.method}'s"
            )
        return EdgeScores(
            self.graph, self.method, self.edge_sum + other.edge_sum,
            self.edge_sumsq + other.edge_sumsq, self.node_sum + other.node_sum,
            self.node_sumsq + other.node_sumsq, self.count + other.count,
        )  # fmt: skip

    @property
    def edges(self) -> np.ndarray:
        """(E,) the mean score of each edge."""
        return self.edge_sum / max(self.count, 1)

    @property
    def nodes(self) -> np.ndarray:
        """(S,) the mean score of each sender."""
        return self.node_sum / max(self.count, 1)

    @property
    def edge_std(self) -> np.ndarray:
        """(E,) the standard deviation of the per-sample scores."""
        mean = self.edges
        return np.sqrt(np.maximum(self.edge_sumsq / max(self.count, 1) - mean**2, 0))

    def top(self, k: int, absolute: bool = True) -> list[tuple[str, float]]:
        """The k edges of largest score (by magnitude, or most negative first when not
        `absolute`: the edges whose ablation lowers the metric most), ties by edge order."""
        key = -np.abs(self.edges) if absolute else self.edges
        order = np.argsort(key, kind="stable")[:k]
        names = self.graph.edges
        return [(names[i], float(self.edges[i])) for i in order]


def node_sums(graph: ComponentGraph, edges: torch.Tensor) -> torch.Tensor:
    """(N, S) per-sample sums of each sender's out-edges' scores."""
    out = torch.zeros(len(edges), graph.n_senders, dtype=edges.dtype, device=edges.device)
    index = torch.as_tensor(graph.edge_sender, device=edges.device)
    return out.index_add_(1, index, edges)


@dataclass(frozen=True)
class ScoreOptions:
    """What a scoring method may be tuned by: `steps` of the integrated-gradient methods,
    `max_exact` edges at most for `exact`, `per_forward` patched variants per forward, and
    `budget` bytes of a chunk of writes and gradients."""

    steps: int = STEPS
    max_exact: int | None = None
    per_forward: int = PER_FORWARD
    budget: int = CHUNK_BYTES


Scores = tuple[torch.Tensor, torch.Tensor]  # per sample: edges (N, E), nodes (N, S)


@dataclass(frozen=True)
class CircuitMethod:
    """One way of scoring a graph's edges on a batch of pairs: `score(ctx, options)` gives the
    per-sample (edges, nodes) scores; `fits(ablation)` refuses an ablation kind it cannot serve
    (ConfigError); `check(graph, options)` refuses a graph before the first batch."""

    score: Callable[[BatchContext, ScoreOptions], Scores]
    fits: Callable[[str], None] | None = None
    check: Callable[[ComponentGraph, ScoreOptions], None] | None = None


def _from_edges(edges: Callable[[BatchContext, ScoreOptions], torch.Tensor]) -> Callable:
    """A gradient method's score: its edges, and per sender the sum of its out-edges."""

    def score(ctx: BatchContext, o: ScoreOptions) -> Scores:
        found = edges(ctx, o)
        return found, node_sums(ctx.parts.graph, found)

    return score


def _exact(ctx: BatchContext, o: ScoreOptions) -> Scores:
    edges = exact_edges(ctx, per_forward=o.per_forward, budget=o.budget)
    return edges, exact_nodes(ctx, o.per_forward, o.budget)


# name -> method, in the order they run (eap's clean run serves the rest): the one list
# circuit.method names (a run checks its names here before it builds the model)
METHODS: dict[str, CircuitMethod] = {
    "eap": CircuitMethod(_from_edges(lambda ctx, o: gradient.eap(ctx, o.budget))),
    "eap_ig_inputs": CircuitMethod(
        _from_edges(lambda ctx, o: gradient.eap_ig_inputs(ctx, o.steps, o.budget)),
    ),
    "eap_ig_activations": CircuitMethod(
        _from_edges(lambda ctx, o: gradient.eap_ig_activations(ctx, o.steps, o.budget))
    ),
    "exact": CircuitMethod(_exact, check=lambda graph, o: check_exact(graph.n_edges, o.max_exact)),
}


def register_method(name: str, method: CircuitMethod) -> CircuitMethod:
    """Add a scoring method under `name` (run after those before it); returns it."""
    METHODS[name] = method
    return method


def check_methods(methods: str | Sequence[str], ablation: Ablation | str) -> list[str]:
    """The methods (one or a list), known to the registry and fit for the ablation (or its
    kind), in the order they run: probe.shared_checks.circuit_methods' checks, the ones the
    run's parse makes, then each registered method's own `fits`."""
    kind = ablation if isinstance(ablation, str) else ablation.kind
    methods = circuit_methods(methods, kind, known=tuple(METHODS))
    for m in methods:
        fits = METHODS[m].fits
        if fits is not None:
            fits(kind)
    return methods


def check_graph(methods: Sequence[str], graph: ComponentGraph, options: ScoreOptions) -> None:
    """Each method's refusal of `graph` before the first batch (`exact` over more edges than
    `circuit.max_exact`)."""
    for m in methods:
        check = METHODS[m].check
        if check is not None:
            check(graph, options)


def score_batch(
    ctx: BatchContext,
    method: str,
    steps: int = STEPS,
    per_forward: int = PER_FORWARD,
    budget: int = CHUNK_BYTES,
) -> Scores:
    """One method's per-sample (edges (N, E), nodes (N, S)) scores on one batch. The method, the
    steps and circuit.max_exact are checked once before the batches (`attribute`, the run's
    start-up): nothing a batch holds changes them."""
    return METHODS[method].score(ctx, ScoreOptions(steps, None, per_forward, budget))


def attribute(
    parts: Parts,
    batches: Iterable[dict],
    methods: Sequence[str] | str = ("eap",),
    metric: AnswerMetric | None = None,
    ablation: Ablation | None = None,
    steps: int = STEPS,
    max_exact: int | None = None,
    per_forward: int = PER_FORWARD,
    budget: int = CHUNK_BYTES,
) -> dict[str, EdgeScores]:
    """Each method's scores over `batches` (dataset=pairs batches: input_ids, corrupt_ids,
    attention_mask, answer, wrong). `steps`: the integrated-gradient methods' steps;
    `max_exact`: refuse `exact` over more edges; `per_forward`: exact variants per forward;
    `budget`: bytes of a chunk of writes and gradients."""
    metric = metric or AnswerMetric()
    ablation = ablation or Ablation()
    methods = check_methods(methods, ablation)  # (one method as a string too)
    check_steps(steps)
    options = ScoreOptions(steps, max_exact, per_forward, budget)
    check_graph(methods, parts.graph, options)  # (once: no batch changes the edges)
    check_logits(parts.model, f"circuit.metric={metric.name}")
    out = {m: EdgeScores(parts.graph, m) for m in methods}
    for batch in batches:
        ctx = BatchContext(parts, pair_batch(parts.model, batch, metric), metric, ablation)
        ctx.check()  # the first batch's clean run checks the residual sum
        for m in methods:
            out[m].add(*METHODS[m].score(ctx, options))
    return out
