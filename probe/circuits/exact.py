"""Exact edge patching, node patching, path patching and the evaluation of a circuit, per
sample, from patched forwards (probe.circuits.ablate).

- `exact_edges`: one patched forward per edge (run in variants of `per_forward` edges at a time):
  that edge's sender's write replaced by its ablated value in that receiver's input alone; the
  score is the metric's change from the clean run.
- `exact_nodes`: one per sender, every edge out of it replaced (the node's total effect).
- `evaluate`: the metric with every edge outside a circuit ablated (the circuit's own edges
  read the run's values), one variant per circuit.
- `evaluate_dataset`: `evaluate` averaged over a dataset of pairs.
- `path_patch`: a sender's effect through a named set of receivers only: each named receiver
  reads the sender's ablated value and every other sender frozen at its clean value; nothing
  else reads the sender's change; downstream of the receivers everything is recomputed.
"""

from __future__ import annotations

import numpy as np
import torch

from probe.circuits.ablate import Table, edge_masks, kept_masks, node_masks, rewritten
from probe.circuits.context import BatchContext
from probe.circuits.receiver_grads import CHUNK_BYTES
from probe.circuits.task import Ablation, AnswerMetric, pair_batch
from probe.errors import ConfigError
from probe.shared_checks import check_exact

PER_FORWARD = 16


def _variants(ctx: BatchContext, masks: torch.Tensor, tables_of, budget: int) -> torch.Tensor:
    """(variants, N) metric of each variant's patched forward."""
    batch = ctx.batch
    inputs, tokens, side = batch.repeated(len(masks))
    output = rewritten(ctx.parts, inputs, tables_of(masks), len(masks), budget)
    logits = ctx.metric.logits(output, tokens, batch.kept)
    reference = ctx.reference.repeat(len(masks), 1)
    return ctx.metric(logits, reference, side).reshape(len(masks), batch.size)


def _looped(ctx, count: int, make_masks, tables_of, per_forward: int, budget: int):
    out = []
    for start in range(0, count, per_forward):
        masks = make_masks(np.arange(start, min(count, start + per_forward)))
        out.append(_variants(ctx, masks, tables_of, budget))
    return torch.cat(out, 0) if out else torch.zeros(0, ctx.batch.size, dtype=torch.float64)


def _ablated(ctx: BatchContext):
    return lambda masks: [Table(ctx.sources, masks.to(ctx.reference.device))]


def exact_edges(
    ctx: BatchContext,
    edges: np.ndarray | None = None,
    per_forward: int = PER_FORWARD,
    max_exact: int | None = None,
    budget: int = CHUNK_BYTES,
) -> torch.Tensor:
    """(N, len(edges)) the metric's change when each edge alone is ablated (default: every
    edge of the graph)."""
    graph = ctx.parts.graph
    edges = np.arange(graph.n_edges) if edges is None else np.asarray(edges, dtype=np.int64)
    check_exact(len(edges), max_exact)
    values = _looped(
        ctx,
        len(edges),
        lambda i: edge_masks(ctx.parts, edges[i]),
        _ablated(ctx),
        per_forward,
        budget,
    )
    return (values - ctx.clean_metric[None]).T


def exact_nodes(
    ctx: BatchContext, per_forward: int = PER_FORWARD, budget: int = CHUNK_BYTES
) -> torch.Tensor:
    """(N, senders) the metric's change when each sender's every out-edge is ablated."""
    senders = np.arange(ctx.parts.graph.n_senders)
    values = _looped(
        ctx, len(senders), lambda i: node_masks(ctx.parts, senders[i]), _ablated(ctx),
        per_forward, budget,
    )  # fmt: skip
    return (values - ctx.clean_metric[None]).T


def evaluate(
    ctx: BatchContext, keep: np.ndarray, per_forward: int = PER_FORWARD, budget: int = CHUNK_BYTES
) -> torch.Tensor:
    """(circuits, N) the metric with every edge outside each circuit ablated; `keep` (E,) or
    (circuits, E) bool, True for the circuit's edges. All kept: the clean metric; none kept:
    the model with every edge ablated."""
    keep = np.atleast_2d(np.asarray(keep, dtype=bool))
    return _looped(
        ctx, len(keep), lambda i: kept_masks(ctx.parts, keep[i]), _ablated(ctx), per_forward, budget
    )


def path_patch(
    ctx: BatchContext, sender: str, receivers: list[str], budget: int = CHUNK_BYTES
) -> torch.Tensor:
    """(N,) the metric's change when `sender`'s ablated value reaches `receivers` (receiver
    names, e.g. ["a2.h3<v>", "m4"]) and nothing else: each named receiver reads its clean input
    with the sender's write replaced, its other senders frozen at their clean values."""
    graph = ctx.parts.graph
    s = graph.sender_index(sender)
    if not receivers:
        raise ConfigError("circuits: path patching needs at least one receiver")
    index = [graph.receiver_index(r) for r in receivers]
    own = torch.zeros(1, graph.n_senders, graph.n_receivers)
    frozen = torch.zeros_like(own)
    for r, name in zip(index, receivers, strict=True):
        reads = graph.group_of(r).senders
        if s >= reads:
            raise ConfigError(f"circuits: {name} does not read {sender}; no path runs through it")
        own[0, s, r] = 1
        frozen[0, :reads, r] = 1
        frozen[0, s, r] = 0
    device = ctx.reference.device
    tables = [Table(ctx.sources, own.to(device)), Table(ctx.clean_states, frozen.to(device))]
    batch = ctx.batch
    output = rewritten(ctx.parts, batch.clean, tables, 1, budget)
    values = ctx.metric(batch.logits(ctx.metric, output), ctx.reference, batch.side)
    return values - ctx.clean_metric


def evaluate_dataset(
    parts,
    batches,
    keep: np.ndarray,
    metric=None,
    ablation=None,
    per_forward: int = PER_FORWARD,
    budget: int = CHUNK_BYTES,
) -> np.ndarray:
    """(circuits,) each circuit's metric averaged over every pair of `batches` (dataset=pairs
    batches), every edge outside it ablated: `evaluate` summed over batches in float64."""
    metric, ablation = metric or AnswerMetric(), ablation or Ablation()
    total: np.ndarray | None = None
    count = 0
    for batch in batches:
        ctx = BatchContext(parts, pair_batch(parts.model, batch, metric), metric, ablation)
        ctx.check()
        summed = evaluate(ctx, keep, per_forward, budget).double().sum(1).cpu().numpy()
        total = summed if total is None else total + summed
        count += ctx.batch.size
    if not count or total is None:
        raise ConfigError("circuits: no pairs to evaluate the circuit on")
    return total / count
