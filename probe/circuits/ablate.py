"""Forwards with chosen edges replaced: exact edge patching, path patching and the evaluation of
a circuit (every edge outside it ablated).

An edge u->r is replaced by rewriting r's input alone: x_r + (a_u - z_u), where z_u is what u
wrote on this very run and a_u the value the edge carries instead (the corrupt half's, a mean,
zero, or a frozen clean value). Every other reader of u, and r's other senders, keep their own
run's values; everything downstream is recomputed. MLP and logits receivers get the rewritten
input through their norm's pre-hook; an attention receiver (one head's q, k or v) gets its own
columns of the projection recomputed from its rewritten input (through the norm), the other
columns left as the run computed them.

Several variants run as one forward: the batch is repeated, variant-major, and `Table.mask`
says per variant which (sender, receiver) pairs read the table's values. The rewrite is built a
chunk of positions and variants at a time, for only the senders and receivers the masks touch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from probe.circuits.parts import Parts
from probe.circuits.receiver_grads import CHUNK_BYTES, chunks
from probe.circuits.states import Recorder, SenderStates, writes
from probe.errors import ConfigError
from probe.hooks.forward import call
from probe.hooks.hookset import HookSet


@dataclass
class Table:
    """Values ablated edges carry: `states` (rows: the batch's N, or 1 to broadcast) and `mask`
    (variants, senders, receivers): 1 where that variant's receiver reads the sender from here."""

    states: SenderStates
    mask: torch.Tensor


class Rewriter:
    """Hooks (through a HookSet) that rewrite receivers' inputs on a run of `variants` x N rows."""

    def __init__(
        self, parts: Parts, hooks: HookSet, tables: list[Table], variants: int, budget: int
    ):
        self.parts, self.tables, self.variants, self.budget = parts, tables, variants, budget
        self.recorder = Recorder(parts, hooks)
        graph = parts.graph
        self.plan = {}
        for g in graph.groups:
            receivers = np.arange(g.receivers.start, g.receivers.stop)
            touched = torch.zeros(g.senders, len(receivers), dtype=torch.bool)
            for table in tables:
                m = table.mask[:, : g.senders, g.receivers.start : g.receivers.stop].detach().cpu()
                touched |= (m != 0).any(0)
            senders = np.nonzero(touched.any(1).numpy())[0]
            active = np.nonzero(touched.any(0).numpy())[0]
            if len(active):
                self.plan[(g.kind, g.layer)] = (g, senders, active)
        self.attn_in: dict[int, torch.Tensor] = {}
        self.values: dict[int, dict] = {}  # per layer: the rewritten projection columns
        for i, layer in enumerate(parts.layers):
            if ("attn", i) in self.plan:
                hooks.forward_pre(layer.attn_norm, self._keep(i), name=f"attn norm {i}")
                for p, proj in enumerate(layer.projections):
                    hooks.forward(proj.module, self._projection(i, p), name=proj.name)
            if ("mlp", i) in self.plan:
                hooks.forward_pre(layer.mlp_norm, self._input(("mlp", i)), name=f"mlp norm {i}")
        if ("logits", graph.layers) in self.plan:
            hooks.forward_pre(
                parts.final_norm, self._input(("logits", graph.layers)), name="final norm"
            )

    def _states(self) -> SenderStates:
        r = self.recorder
        n = self.parts.graph.layers
        heads, mlp = [r.heads.get(i) for i in range(n)], [r.mlp.get(i) for i in range(n)]
        # partial states: a sender this pass did not record is None (`writes` reads none of them)
        return SenderStates(r.input, heads, mlp)  # type: ignore[arg-type]

    def added(self, key, x: torch.Tensor, active: np.ndarray, rows: slice, positions: slice):
        """(rows, t, len(active), D): what the active receivers of group `key` add to their
        input over a chunk: sum over tables and senders of mask x (table - run) writes. A sparse
        mask (one edge a variant: exact patching) builds the writes of its few (variant,
        sender, receiver) terms alone."""
        g, senders, _ = self.plan[key]
        n = x.shape[0] // self.variants
        v0, v1 = rows.start // n, rows.stop // n
        dtype = torch.promote_types(x.dtype, torch.float32)
        run = self._states()
        t, d = x[:1, positions].shape[1], x.shape[-1]
        total = torch.zeros(v1 - v0, len(active), n, t, d, dtype=dtype, device=x.device)
        picked = torch.as_tensor(senders), torch.as_tensor(g.receivers.start + active)
        own = None
        for table in self.tables:
            mask = table.mask[v0:v1][:, picked[0]][:, :, picked[1]].to(x.device, dtype)
            terms = mask.nonzero().tolist()
            if not terms:
                continue
            if 8 * len(terms) >= mask.numel():  # dense: every sender's write, one product
                if own is None:
                    own = writes(self.parts, run, senders, rows, positions, dtype)
                    own = own.reshape(v1 - v0, n, *own.shape[1:])  # (b, n, t, senders, D)
                theirs = writes(self.parts, table.states, senders, slice(None), positions, dtype)
                total += torch.einsum("bntsd,bsr->brntd", theirs[None] - own, mask)
                continue
            their: dict[int, torch.Tensor] = {}  # per sender, and per (variant, sender)
            mine: dict[tuple[int, int], torch.Tensor] = {}
            for b, s, r in terms:
                if s not in their:
                    w = writes(
                        self.parts, table.states, senders[s : s + 1], slice(None), positions, dtype
                    )
                    their[s] = w[:, :, 0]
                if (b, s) not in mine:
                    at = slice(rows.start + b * n, rows.start + (b + 1) * n)
                    mine[b, s] = writes(self.parts, run, senders[s : s + 1], at, positions, dtype)[
                        :, :, 0
                    ]
                total[b, r] += mask[b, s, r] * (their[s] - mine[b, s])
        return total.permute(0, 2, 3, 1, 4).reshape(-1, t, len(active), d)

    def _chunks(self, x: torch.Tensor, key, receivers: int):
        g, senders, _ = self.plan[key]
        n = x.shape[0] // self.variants
        per_token = 4 * self.parts.width * (2 * len(senders) + 3 * receivers)
        for rows, positions in chunks(self.variants, x.shape[1], per_token * n, self.budget):
            yield slice(rows.start * n, rows.stop * n), positions

    def _input(self, key):
        def hook(module, args):
            x = args[0]
            new = x.clone()
            _, _, active = self.plan[key]
            for rows, positions in self._chunks(x, key, 1):
                add = self.added(key, x, active, rows, positions)[:, :, 0]
                new[rows, positions] += add.to(x.dtype)
            return (new, *args[1:])

        return hook

    def _keep(self, layer: int):
        def hook(module, args):
            self.attn_in[layer] = args[0]
            self.values.pop(layer, None)

        return hook

    def _attention_values(self, layer: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Per projection of the layer: the output columns of its rewritten receivers and their
        values (rows, T, columns), each receiver's from its own rewritten input through the norm
        and its rows of the projection; computed once for the layer's projections."""
        key = ("attn", layer)
        _, _, active = self.plan[key]
        x = self.attn_in[layer]
        norm = self.parts.layers[layer].attn_norm
        per = []
        for p, proj in enumerate(self.parts.layers[layer].projections):
            at = {int(r): i for i, r in enumerate(proj.receivers)}
            which = [i for i, r in enumerate(active) if int(r) in at]
            if which:
                cols = proj.columns[[at[int(active[i])] for i in which]].to(x.device)
                per.append((p, torch.as_tensor(which, device=x.device), cols, *proj.weight()))
        out = {
            p: (cols.reshape(-1), x.new_empty(*x.shape[:2], cols.numel()))
            for p, _, cols, _, _ in per
        }
        for rows, positions in self._chunks(x, key, len(active)):
            add = self.added(key, x, active, rows, positions)
            y = norm.forward((x[rows, positions][:, :, None].to(add.dtype) + add).to(x.dtype))
            for p, where, cols, w, b in per:
                values = torch.einsum("ntrd,rkd->ntrk", y[:, :, where].to(w.dtype), w[cols])
                if b is not None:
                    values = values + b[cols]
                out[p][1][rows, positions] = values.reshape(*values.shape[:2], -1).to(x.dtype)
        return out

    def _projection(self, layer: int, p: int):
        def hook(module, args, output):
            if layer not in self.values:
                self.values[layer] = self._attention_values(layer)
            if p not in self.values[layer]:
                return None
            cols, values = self.values[layer][p]
            out = output.clone()
            out[..., cols] = values.to(out.dtype)
            return out

        return hook


@torch.no_grad()
def rewritten(
    parts: Parts, inputs: dict, tables: list[Table], variants: int, budget: int = CHUNK_BYTES
):
    """The model's output on `inputs` (already repeated `variants` times, variant-major) with
    receivers' inputs rewritten per the tables."""
    hooks = HookSet("circuit edges")
    with hooks:
        Rewriter(parts, hooks, tables, variants, budget)
        return call(parts.model, inputs)


def edge_masks(parts: Parts, edges: np.ndarray) -> torch.Tensor:
    """(len(edges), S, R): one variant per edge, that edge alone."""
    graph = parts.graph
    mask = torch.zeros(len(edges), graph.n_senders, graph.n_receivers)
    b = torch.arange(len(edges))
    mask[b, graph.edge_sender[edges], graph.edge_receiver[edges]] = 1
    return mask


def node_masks(parts: Parts, senders: np.ndarray) -> torch.Tensor:
    """(len(senders), S, R): one variant per sender, every edge out of it."""
    graph = parts.graph
    full = torch.as_tensor(graph.edge_mask(), dtype=torch.float32)
    mask = torch.zeros(len(senders), graph.n_senders, graph.n_receivers)
    for b, s in enumerate(senders):
        mask[b, s] = full[s]
    return mask


def kept_masks(parts: Parts, keep: np.ndarray) -> torch.Tensor:
    """(variants, S, R): every edge not kept, per variant; `keep` (E,) or (variants, E) bool."""
    graph = parts.graph
    keep = np.atleast_2d(np.asarray(keep, dtype=bool))
    if keep.shape[1] != graph.n_edges:
        raise ConfigError(
            f"circuits: a circuit is {graph.n_edges} booleans (one per edge); got {keep.shape[1]}"
        )
    mask = torch.zeros(len(keep), graph.n_senders, graph.n_receivers)
    for b, row in enumerate(keep):
        drop = np.nonzero(~row)[0]
        mask[b, graph.edge_sender[drop], graph.edge_receiver[drop]] = 1
    return mask
