"""The metric's gradient at every receiver's input from one backward, and its product with the
senders' writes, a chunk of rows and positions at a time.

A receiver reads the residual stream before its norm. The MLPs and the logits read it once: a
forward pre-hook gives their norm a copy of its input, whose gradient is the receiver's alone.
An attention head's query, key and value inputs are three receivers that read the same residual
through the same norm, so no single tensor holds their gradients apart; the backward gives the
gradient at the projections' outputs (the queries, keys and values, each head's columns apart),
and each receiver's input gradient follows exactly from it by the chain rule through its own
columns of the projection and through the norm (a vector-Jacobian product of the norm at the
run's residual, recomputed per chunk): the same numbers a model with a separate copy of the
residual per head and per q/k/v would give (tests/circuits hold them equal to one), at the cost
of one projection and one norm per chunk rather than 3 x heads copies of the attention input.

`contract` then gives every edge's score per sample: (ablated - clean write of the sender) .
(gradient at the receiver's input), summed over positions; the writes are rebuilt from the
compact sender states per chunk (probe.circuits.states.writes), so no tensor larger than
rows x positions x (senders + receivers) x width of one chunk is built.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from probe.circuits.component_graph import ReceiverGroup
from probe.circuits.parts import Parts
from probe.circuits.states import Recorder, SenderStates, writes
from probe.errors import ModelError
from probe.hooks.forward import call
from probe.hooks.hookset import HookSet

CHUNK_BYTES = 256 * 2**20


class ReceiverTaps:
    """Hooks keeping what the receivers' gradients are taken at: each attention norm's input,
    each query/key/value projection's output, and the copies the MLP norms and the final norm
    read."""

    def __init__(self, parts: Parts, hooks: HookSet):
        self.parts = parts
        self.attn_in: dict[int, torch.Tensor] = {}
        self.proj: dict[tuple[int, int], torch.Tensor] = {}
        self.mlp_in: dict[int, torch.Tensor] = {}
        self.final: list[torch.Tensor] = []
        for i, layer in enumerate(parts.layers):
            hooks.forward_pre(layer.attn_norm, self._keep_attn(i), name=f"attn norm {i}")
            for p, proj in enumerate(layer.projections):
                hooks.forward(proj.module, self._keep_proj(i, p), name=proj.name)
            hooks.forward_pre(layer.mlp_norm, self._copy(self.mlp_in, i), name=f"mlp norm {i}")
        hooks.forward_pre(parts.final_norm, self._copy_final, name="final norm")

    def _keep_attn(self, layer: int):
        def hook(module, args):
            self.attn_in.setdefault(layer, args[0].detach())

        return hook

    def _keep_proj(self, layer: int, p: int):
        def hook(module, args, output):
            self.proj.setdefault((layer, p), output)

        return hook

    def _copy(self, into: dict, layer: int):
        def hook(module, args):
            own = args[0].clone()  # the receiver's own use of the residual
            into.setdefault(layer, own)
            return (own, *args[1:])

        return hook

    def _copy_final(self, module, args):
        own = args[0].clone()
        self.final.append(own)
        return (own, *args[1:])

    def tensors(self) -> list[torch.Tensor]:
        parts = self.parts
        n = len(parts.layers)
        keys = [(i, p) for i in range(n) for p in range(len(parts.layers[i].projections))]
        missing = [k for k in keys if k not in self.proj] + [
            i for i in range(n) if i not in self.mlp_in or i not in self.attn_in
        ]
        if missing or len(self.final) != 1:
            raise ModelError(
                "circuits: the forward did not call each norm and projection of the graph once "
                f"(missing {missing[:4]}, final norm called {len(self.final)} times); check "
                "model.anatomy"
            )
        return [self.proj[k] for k in keys] + [self.mlp_in[i] for i in range(n)] + self.final


@dataclass
class ReceiverGrads:
    """The backward's gradients: per layer the attention norm's input and each projection's
    output gradient, each MLP norm's input gradient, the final norm's input gradient."""

    attn_in: list[torch.Tensor]
    proj: list[list[torch.Tensor]]
    mlp: list[torch.Tensor]
    final: torch.Tensor

    def group(self, parts: Parts, group, rows: slice, positions: slice, dtype) -> torch.Tensor:
        """(n, t, receivers, D): the gradient at each of the group's receivers' inputs."""
        if group.kind == "mlp":
            return self.mlp[group.layer][rows, positions].to(dtype)[:, :, None]
        if group.kind == "logits":
            return self.final[rows, positions].to(dtype)[:, :, None]
        return attention_input_grads(parts, group.layer, self, rows, positions, dtype)


def attention_input_grads(parts: Parts, layer: int, grads: ReceiverGrads, rows, positions, dtype):
    """Each attention receiver's input gradient: its columns of the projection-output gradient
    back through its rows of the projection's weight, then through the norm at the residual."""
    x = grads.attn_in[layer][rows, positions].to(dtype)
    n, t, d = x.shape
    count = parts.graph.heads + 2 * parts.graph.kv_heads
    through = torch.zeros(n, t, count, d, dtype=dtype, device=x.device)
    for proj, g in zip(parts.layers[layer].projections, grads.proj[layer], strict=True):
        w, _ = proj.weight()
        cols = proj.columns.to(x.device)
        g = g[rows, positions].to(dtype)[:, :, cols]  # (n, t, r, head_dim)
        through[:, :, proj.receivers.to(x.device)] = torch.einsum(
            "ntrk,rkd->ntrd", g, w.to(dtype)[cols]
        )
    return norm_vjp(parts.layers[layer].attn_norm, x, through)


def norm_vjp(norm, x: torch.Tensor, cotangents: torch.Tensor) -> torch.Tensor:
    """(n, t, r, D): the vector-Jacobian products of `norm` at x (n, t, D) with r cotangents
    each (a norm acts on the last dim, so it runs once on r copies; its hooks are skipped)."""
    with torch.enable_grad():
        xs = x.detach().unsqueeze(2).expand(cotangents.shape).clone().requires_grad_(True)
        y = norm.forward(xs.to(_dtype(norm, xs)))
        (g,) = torch.autograd.grad(y, xs, cotangents.to(y.dtype))
    return g


def _dtype(module, x):
    p = next(module.parameters(), None)
    return x.dtype if p is None else p.dtype


def gradient_run(parts: Parts, inputs: dict, score, replace: dict | None = None):
    """One forward with gradients and one backward of `score(output)` (a function of the
    model's output giving (N,) per-sample values): the run's sender states, the receivers'
    gradients and the values. `replace`: sender values to use instead of the run's own
    (probe.circuits.states.Recorder)."""
    hooks = HookSet("circuit gradients")
    with hooks, torch.enable_grad():
        recorder = Recorder(parts, hooks, replace, leaf=True)
        taps = ReceiverTaps(parts, hooks)
        values = score(call(parts.model, inputs))
        wanted = taps.tensors()
        found = torch.autograd.grad(values.sum(), wanted, allow_unused=True)
    grads = [torch.zeros_like(w) if g is None else g for g, w in zip(found, wanted, strict=True)]
    n = len(parts.layers)
    per_layer: list[list[torch.Tensor]] = []
    k = 0
    for i in range(n):
        count = len(parts.layers[i].projections)
        per_layer.append(grads[k : k + count])
        k += count
    received = ReceiverGrads(
        [taps.attn_in[i] for i in range(n)], per_layer, grads[k : k + n], grads[k + n]
    )
    return recorder.states(), received, values.detach()


def chunks(rows: int, positions: int, per_token: int, budget: int = CHUNK_BYTES):
    """(rows, positions) slices covering a rows x positions batch, each of at most `budget`
    bytes at `per_token` bytes a token (one token at least)."""
    tokens = max(1, budget // max(per_token, 1))
    step_t = min(positions, tokens)
    step_n = max(1, min(rows, tokens // step_t))
    for n0 in range(0, rows, step_n):
        for t0 in range(0, positions, step_t):
            yield slice(n0, min(rows, n0 + step_n)), slice(t0, min(positions, t0 + step_t))


@torch.no_grad()
def contract(
    parts: Parts,
    diff: SenderStates,
    grads: ReceiverGrads,
    size: tuple[int, int],
    senders: np.ndarray | None = None,
    budget: int = CHUNK_BYTES,
) -> torch.Tensor:
    """(N, E) float64 per-sample edge scores: for every edge from one of `senders` (default
    all), the sender's write of `diff` (ablated minus clean states) dotted with the gradient at
    the receiver's input, summed over positions; other edges 0."""
    graph = parts.graph
    n, t = size
    senders = np.arange(graph.n_senders) if senders is None else np.unique(senders)
    device = grads.final.device
    dtype = torch.promote_types(grads.final.dtype, torch.float32)
    out = torch.zeros(n, graph.n_edges, dtype=torch.float64, device=device)
    # per group: how many of the chosen senders it reads (a prefix), their edges
    plan: list[tuple[ReceiverGroup, int, torch.Tensor]] = []
    for g in graph.groups:
        k = int((senders < g.senders).sum())
        if k:
            r = np.arange(len(g.receivers))[:, None]
            index = g.edges.start + r * g.senders + senders[:k][None, :]
            plan.append((g, k, torch.as_tensor(index.reshape(-1), device=device)))
    widest = max(len(g.receivers) for g, _, _ in plan) if plan else 0
    per_token = 4 * parts.width * (len(senders) + 3 * widest) * max(1, dtype.itemsize // 4)
    for rows, positions in chunks(n, t, per_token, budget):
        # (n, senders, t x D): a group's senders are a prefix, so each product reads a view
        w = writes(parts, diff, senders, rows, positions, dtype, senders_first=True)
        w = w.reshape(*w.shape[:2], -1)
        for g, k, edges in plan:
            received = grads.group(parts, g, rows, positions, dtype)  # (n, t, r, D)
            received = received.permute(0, 2, 1, 3).reshape(len(received), len(g.receivers), -1)
            block = torch.bmm(received, w[:, :k].transpose(1, 2))  # (n, r, k)
            out[rows].index_add_(1, edges, block.reshape(len(block), -1).double())
    return out
