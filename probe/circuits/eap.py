"""Edge scores from gradients: EAP and its integrated-gradients variants, per sample.

Every score estimates how the metric moves when the edge alone is ablated:
score(u->v) = (a_u - z_u) . dM/dx_v, with z_u the sender's clean write, a_u its ablated write
(the corrupt half's, a mean, zero) and x_v the receiver's input (before its norm).

- `eap` (Syed et al. 2023): the gradient on the clean run. Two forwards (clean with gradients,
  corrupt without) and one backward per batch; exact where the metric is linear in x_v.
- `eap_ig_inputs` (Hanna et al. 2024): the gradient averaged over `steps` runs whose input
  (the `input` node's write) moves from the corrupt half's to the clean one:
  dM/dx_v at input = a + k/m (z - a), k = 1..m (the paper's right Riemann sum; hannamw/EAP-IG's
  code takes k = 0..m-1). Counterfactual ablation only, as there.
- `eap_ig_activations`: integrated gradients along each sender's own path: the gradient at
  v averaged over `steps` runs in which the senders of u's group (the input; one layer's heads
  together; one MLP) write a + k/m (z - a), k = 1..m, everything else recomputed. An edge's
  score uses the runs of its own sender's group only (hannamw/EAP-IG's code averages every
  receiver's gradient over the runs of all groups): (1 + 2 x layers) x steps backwards a batch.

At one step both variants take the gradient where every sender writes its clean value: they
equal `eap` to float rounding.
"""

from __future__ import annotations

import numpy as np
import torch

from probe.circuits.context import BatchContext
from probe.circuits.receiver_grads import CHUNK_BYTES, contract, gradient_run

GRADIENT_METHODS = ("eap", "eap_ig_inputs", "eap_ig_activations")


def _size(ctx: BatchContext) -> tuple[int, int]:
    return tuple(ctx.batch.clean["input_ids"].shape[:2])


def eap(ctx: BatchContext, budget: int = CHUNK_BYTES) -> torch.Tensor:
    """(N, E) per-sample EAP edge scores of the batch."""
    logits = {}

    def score(output):
        logits["clean"] = ctx.batch.logits(ctx.metric, output)
        return ctx.metric(logits["clean"], logits["clean"].detach(), ctx.batch.side)

    states, grads, _ = gradient_run(ctx.parts, ctx.batch.clean, score)
    ctx.set_clean(states, logits["clean"])
    diff = ctx.sources.minus(states)  # the corrupt run (no gradients), a mean, or zeros
    return contract(ctx.parts, diff, grads, _size(ctx), budget=budget)


def _interpolate(source: torch.Tensor, clean: torch.Tensor, alpha: float):
    def replace(own: torch.Tensor) -> torch.Tensor:
        value = source + alpha * (clean - source)
        return value.expand_as(own).to(own.dtype)

    return replace


def eap_ig_inputs(ctx: BatchContext, steps: int, budget: int = CHUNK_BYTES) -> torch.Tensor:
    """(N, E) per-sample EAP-IG scores, integrating along the input's path (counterfactual
    ablation only: probe.shared_checks.circuit_methods refuses the others before the batches)."""
    clean, sources = ctx.clean_states, ctx.sources
    diff = sources.minus(clean)
    total: torch.Tensor | None = None
    for k in range(1, steps + 1):
        replace = {"input": _interpolate(sources.input, clean.input, k / steps)}
        _, grads, _ = gradient_run(ctx.parts, ctx.batch.clean, ctx.score, replace)
        part = contract(ctx.parts, diff, grads, _size(ctx), budget=budget)
        total = part if total is None else total + part
    assert total is not None  # steps >= 1 (probe.shared_checks)
    return total / steps


def sender_groups(graph) -> list[tuple[str, np.ndarray]]:
    """(replace key, sender indices) of each group interpolated together: the input, each
    layer's heads, each MLP."""
    out = [("input", np.array([0]))]
    for layer in range(graph.layers):
        out.append((f"heads{layer}", graph.head(layer, 0) + np.arange(graph.heads)))
        out.append((f"mlp{layer}", np.array([graph.mlp(layer)])))
    return out


def _state(states, key: str) -> torch.Tensor:
    if key == "input":
        return states.input
    if key.startswith("heads"):
        return states.heads[int(key[5:])]
    return states.mlp[int(key[3:])]


def eap_ig_activations(ctx: BatchContext, steps: int, budget: int = CHUNK_BYTES) -> torch.Tensor:
    """(N, E) per-sample EAP-IG scores, integrating along each sender group's own path."""
    clean, sources = ctx.clean_states, ctx.sources
    diff = sources.minus(clean)
    total: torch.Tensor | None = None
    for key, senders in sender_groups(ctx.parts.graph):
        for k in range(1, steps + 1):
            alpha = k / steps
            replace = {key: _interpolate(_state(sources, key), _state(clean, key), alpha)}
            _, grads, _ = gradient_run(ctx.parts, ctx.batch.clean, ctx.score, replace)
            part = contract(ctx.parts, diff, grads, _size(ctx), senders, budget)
            total = part if total is None else total + part
    assert total is not None  # steps >= 1 (probe.shared_checks)
    return total / steps
