"""The residual stream at an attention's input decomposed over the graph's nodes, through the
earlier layers' frozen patterns: the parts of the QK attribution with `sources="nodes"`
(probe.graphs.qk_attribution; docs/graphs.md, "Traced to the nodes").

In the local replacement model (probe.graphs.replacement: every pattern and norm scale frozen,
each MLP its transcoder's features, its error and its skip path) the residual stream x_l(p) at
layer l's attention input is affine in the graph's nodes at every earlier layer and position:
what an earlier attention wrote to p is its frozen pattern times the values of earlier
positions' residuals, themselves sums of nodes' writes. So, exactly on the prompt,

    x_l(p) = sum over nodes n of  a_n * d x_l(p) / d a_n   +  constant parts

with a_n node n's activation (a feature's; an error's or a token's is 1, its vector written
whole) at any position up to p and any layer before l: each term is the node's whole effect,
its direct write and every path through the frozen attentions. The constant parts are named:
`attn l' bias@p'` (layer l' attention's write at p' when its residual input is zero: the norm's
bias and the value and output biases through the frozen pattern, a post-attention norm's bias),
`mlp l' rest@p'` (the decoder bias, and at the graph's zeroed positions, whose features and
error are no nodes, the whole write but the skip path), `embed rest@p'` (GPT-2's position
embedding), each through every path from where it is written to x_l(p). The skip path is
linear in what the transcoder reads, so it is traced further, as the graph's edges are. Each
node and constant part is a column of the decomposition; x_0 is the tokens and the embedding's
rest alone, read off without a pass.

The same linear map gives the columns two ways (`direction`):

- backward: one backward pass of the replacement model seeded with a component's unit vector
  at x_l(p) (`batch` copies of the prompt, one seed each): the gradient at each node's write,
  contracted with the write, is the node's share of that component. A layer costs
  `width x positions` seeds (its query positions and the keys they attend to most), that is
  ceil(width x positions / batch) passes through its l blocks, every pair of the layer sharing
  them.
- forward: one forward of the replacement model carrying forward-mode tangents (probe.graphs.
  replacement's `tangents`), prompt copy b carrying column b's write where it is written (a
  token's at the embeddings' output, the embedding's rest at the first block's input, an
  attention's or an MLP's write) as its tangent: the tangent at every later layer's attention
  input is that column's part of it, all layers at once. The embedding's rest is x_0 less what
  the tokens become there (one copy's forward carrying the embeddings as its tangent, stopped
  at the first block: a model may rescale them in between), as the backward reads it. The
  columns cost ceil(columns / batch) forwards, each stopped at the last layer it reads; the
  parts are kept for a group of layers at a time (as many as half the memory plan's share of
  the free memory holds: a further group runs the forwards again).

`cost` counts both in copy-block passes (a pass times the blocks it runs through times the
prompt copies it carries: block passes where the two batches are equal), a forward's weighted
FORWARD_BLOCK_COST times a backward's, and the cheaper direction is taken unless one is asked
for (`nodes_forward` or `nodes_backward` for graph.qk_sources); both give the same parts to
float rounding. A forward whose parts of a single layer pass the budget cannot run: `nodes`
takes the backward, `nodes_forward` is refused by name.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass

import torch
import torch.autograd.forward_ad as fwAD

from probe.errors import ModelError
from probe.graphs.attribution import GraphOptions, _lean, batch_plan
from probe.graphs.batch_plan import FRACTION, free_bytes, human
from probe.graphs.replacement import LocalReplacement, _apply, _skip_path
from probe.hooks.hookset import HookSet
from probe.models.placement import execution_device

VALUES_NAME = "probe_qk_frozen_values"
DIRECTIONS = ("forward", "backward")
# a forward block pass carrying tangents against a backward one, in time, per prompt copy: it
# runs the whole block on every copy (the query and key projections too, and the value of each
# op besides its tangent), where a backward runs the linear paths back alone; measured on the
# CPU only (one thread, both batches 64 copies): 2.5-2.8 at widths 128-576
# (scripts/bench_qk_sources.py, docs/bench/graphs.md), more where per-op overhead dominates (10
# at width 32, where either direction takes under a second); a GPU's ratio is not measured
FORWARD_BLOCK_COST = 3.0
log = logging.getLogger("probe")


class _FrozenValues:
    """The attention function of a constant pass: the recorded pattern times the values."""

    pattern: torch.Tensor | None = None

    @staticmethod
    def attend(module, query, key, value, attention_mask, **kwargs):
        pattern = _FrozenValues.pattern
        if pattern is None:
            raise ModelError(f"attention implementation {VALUES_NAME!r} called outside a pass")
        return _apply(pattern, value), pattern


class _Stop(Exception):
    """Raised by the last read of a forward: the blocks after it need not run."""


@dataclass(frozen=True)
class Cost:
    """What each direction costs for a table: its passes, its block passes (a pass times the
    blocks it runs through), its prompt copies per pass; the forward's groups of layers, the
    bytes its kept parts may hold at once (None: the free memory cannot be read, one layer a
    group) and the largest single layer's parts (`largest_layer`'s)."""

    backward_passes: int
    backward_blocks: int
    backward_batch: int
    forward_passes: int
    forward_blocks: int
    forward_batch: int
    groups: tuple[tuple[int, ...], ...]
    parts_budget: float | None = None
    largest_parts: int = 0
    largest_layer: int = -1

    @property
    def forward_fits(self) -> bool:
        """Whether every layer's kept parts fit the budget alone (unknown budget: assumed)."""
        return self.parts_budget is None or self.largest_parts <= self.parts_budget

    @property
    def cheaper(self) -> str:
        """The direction of less work, in copy-block passes (block passes times the copies a
        pass carries: the block passes where the batches are equal), a forward's weighted
        FORWARD_BLOCK_COST; the backward where the forward's parts do not fit."""
        if not self.forward_fits:
            return "backward"
        forward = FORWARD_BLOCK_COST * self.forward_blocks * self.forward_batch
        return "forward" if forward <= self.backward_blocks * self.backward_batch else "backward"

    def says(self, direction: str) -> str:
        """The log line: both estimates, the direction taken and, for the forward, its groups
        of layers (or why it cannot run)."""
        out = (
            f"qk sources: {direction}: {self.forward_passes} forwards of {self.forward_batch} "
            f"copies ({self.forward_blocks} block passes) against {self.backward_passes} "
            f"backward passes of {self.backward_batch} copies ({self.backward_blocks} block "
            "passes)"
        )
        if not self.forward_fits:
            out += f"; the forward cannot run: {self.too_large()}"
        elif direction == "forward" and len(self.groups) > 1:
            budget = "one layer a group" if self.parts_budget is None else human(self.parts_budget)
            out += f"; the forward's parts in {len(self.groups)} groups of layers ({budget})"
        return out

    def too_large(self) -> str:
        """What does not fit the forward's budget (where forward_fits is False)."""
        budget = math.inf if self.parts_budget is None else self.parts_budget
        return (
            f"its parts of layer {self.largest_layer} alone (positions x width x columns) take "
            f"{human(self.largest_parts)}, over its budget of {human(budget)} (half "
            "the memory plan's share of the free memory)"
        )

    def refusal(self) -> str:
        """Why a forward asked for by name cannot run, and the ways out."""
        return (
            f"qk sources: the forward direction cannot run: {self.too_large()}; use "
            "graph.qk_sources=nodes_backward (or nodes, which takes it), a smaller table "
            "(a lower graph.qk: fewer key positions traced), a shorter prompt, or more free memory"
        )


class NodeSources:
    """The decomposition of each layer's attention input over the graph's nodes and the constant
    parts (see the module docstring). `seen` is qk_attribution's record forward of the prompt,
    `writes` its per-layer _LayerWrites, `graph` names the nodes, `needed` the positions each
    layer's table reads (None: all); `batch` prompt copies per pass (None: the memory plan's),
    `direction` forward or backward (None: the cheaper by `cost`)."""

    def __init__(self, seen, writes, graph, transcoders, overrides, batch: int | None = None,
                 direction: str | None = None, needed: dict[int, list[int]] | None = None):  # fmt: skip
        if direction is not None and direction not in DIRECTIONS:
            raise ModelError(f"qk sources direction {direction!r}: forward, backward or None")
        self.seen, self.writes, self.graph = seen, writes, graph
        self.model, self.transcoders, self.overrides = seen.model, transcoders, overrides
        parts = self.parts = seen.parts
        self.n_layers = parts.n_layers
        self.n_pos = int(graph.tokens.shape[0])
        x = seen.norm_io["attn_norm", 0][0]
        self.width, self.dtype = int(x.shape[-1]), x.dtype
        every = list(range(self.n_pos))
        self.needed = needed or {layer: every for layer in range(self.n_layers)}
        self._columns(graph)
        self._constants(transcoders)
        self.device = device = execution_device(parts.embed)
        assert seen.rep.captured.embed is not None  # (the record forward ran)
        # what the gradients are contracted with, in float64 where the embeddings run
        self.embed_value = seen.rep.captured.embed[0].detach().to(device, torch.float64)
        self.first_value = x[0].detach().to(device, torch.float64)
        self.backward_passes = self.forward_passes = 0
        self.cost = self._cost(batch)
        self.direction = direction or self.cost.cheaper
        log.info("%s", self.cost.says(self.direction))
        if self.direction == "forward" and not self.cost.forward_fits:
            raise ModelError(self.cost.refusal())
        self._kept = False  # (backward: the forward its passes run back through, made once)
        self._group: dict[int, torch.Tensor] = {}  # (forward: the current group's parts)
        self._at_first_block: torch.Tensor | None = None  # (forward: the tokens at x_0)

    # -- the columns: nodes and constant parts ----------------------------------------------
    def _columns(self, graph) -> None:
        """Every column's name and graph node (-1: none): tokens, position embeddings, then per
        layer its block: its features (a CLT's by their own layer), error, MLP rest and
        attention bias (`block_start[l]`: the first column of layer l's block, so the columns
        that can reach x_l are those before it)."""
        n, n_pos = self.n_layers, self.n_pos
        node_of = graph.feature_numbers()
        names: list[str] = [f"token@{p}" for p in range(n_pos)]
        nodes: list[int] = [graph.offsets["token"] + p for p in range(n_pos)]
        names += [f"embed rest@{p}" for p in range(n_pos)]
        nodes += [-1] * n_pos
        self.feature_col: dict[tuple[int, int, int], int] = {}
        for w in self.writes:
            for key in w.features:
                if key not in self.feature_col:
                    self.feature_col[key] = -1  # (placed below, by layer, position, feature)
        by_layer = sorted(self.feature_col)
        self.error_col, self.mlp_col, self.attn_col, self.block_start = [], [], [], []
        for layer in range(n):
            self.block_start.append(len(names))
            for key in (k for k in by_layer if k[0] == layer):
                self.feature_col[key] = len(names)
                names.append(f"feature {key[0]}:{key[2]}@{key[1]}")
                nodes.append(node_of.get(key, -1))
            self.error_col.append(len(names))
            names += [f"error {layer}@{p}" for p in range(n_pos)]
            nodes += [graph.offsets["error"] + layer * n_pos + p for p in range(n_pos)]
            self.mlp_col.append(len(names))
            names += [f"mlp {layer} rest@{p}" for p in range(n_pos)]
            nodes += [-1] * n_pos
            self.attn_col.append(len(names))
            names += [f"attn {layer} bias@{p}" for p in range(n_pos)]
            nodes += [-1] * n_pos
        self.block_start.append(len(names))
        self.names, self.nodes = names, nodes

    @torch.no_grad()
    def _constants(self, transcoders) -> None:
        """Per layer, what its MLP write holds beyond its nodes and its skip path (mlp rest),
        and its attention's write when its residual input is zero (attention bias)."""
        seen, parts = self.seen, self.seen.parts
        self.mlp_rest, self.attn_bias = [], []
        for layer in range(self.n_layers):
            w = self.writes[layer]
            value = seen.rep.captured.mlp_values[layer][0]
            x = seen.rep.captured.inputs[layer][0]
            written = torch.zeros_like(value)
            pos = torch.tensor([k[1] for k in w.features], dtype=torch.long, device=value.device)
            written.index_add_(0, pos, w.vectors.to(value.dtype))
            # the skip path's linear part is traced; its value at a zero residual (the MLP
            # norm's bias, where the transcoder reads the norm's output) is a constant
            skip = _skip_path(transcoders, layer)
            at_zero = torch.zeros_like(x)
            bias = getattr(parts.mlp_norms[layer], "bias", None)
            if transcoders.reads == "mlp_in" and isinstance(bias, torch.Tensor):
                at_zero = at_zero + bias.detach().to(x.dtype)
            linear = (skip(x) - skip(at_zero)).to(value.dtype)
            self.mlp_rest.append(value - written - w.error.to(value.dtype) - linear)
            self.attn_bias.append(self._attention_at_zero(layer))

    def _attention_at_zero(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s attention write (n_pos, d) when its residual input is zero: the
        attention run on its norm's bias (a frozen norm maps zero there) with its recorded
        pattern, then a post-attention norm's frozen map and bias."""
        seen, parts = self.seen, self.seen.parts
        norm = parts.attn_norms[layer]
        x = seen.norm_io["attn_norm", layer][0]
        bias = seen.norm_bias("attn_norm", layer, norm).expand_as(x[:1]).contiguous()
        try:
            _FrozenValues.pattern = seen.rep.saved["patterns"][layer][:1]
            out = seen.rerun_attention(layer, bias, VALUES_NAME, _FrozenValues.attend)
        finally:
            _FrozenValues.pattern = None
        out = (out[0] if isinstance(out, tuple) else out)[0]
        if parts.post_attn_norms:
            post = parts.post_attn_norms[layer]
            out = seen.frozen_norm("post_attn_norm", layer, post)(out)
            out = out + seen.norm_bias("post_attn_norm", layer, post)
        return out.reshape(x.shape[-2:]).to(self.dtype)  # (a frozen scale's batch dimension)

    # -- the cost of each direction ---------------------------------------------------------
    def _cost(self, batch: int | None) -> Cost:
        """Both directions' passes for the layers after the first (see the module docstring):
        backward, per layer l the ceil(width x positions / batch) passes through l blocks and
        the forward they run back through (n_layers blocks); forward, per group of layers the
        ceil(columns before its last layer's block / batch) forwards through its last layer's
        blocks. Each direction's batch from its memory plan, half the plan's share of the free
        memory to the forward's copies and half to its kept parts; no more copies than a pass
        can use (the backward's: the largest layer's seeds; the forward's: the columns)."""
        rep = LocalReplacement(self.model, self.transcoders, self.overrides, mode="attribute")
        n_cols, options = len(self.names), GraphOptions()
        if batch is None:
            back = batch_plan(self.model, rep, self.n_pos, options).batch
            forth = batch_plan(self.model, rep, self.n_pos, options, tangents=True,
                               fraction=FRACTION / 2, rows=n_cols).batch  # fmt: skip
        else:
            back = forth = batch
        layers = [layer for layer in range(1, self.n_layers) if self.needed.get(layer)]
        seeds = max((self.width * len(self.needed[layer]) for layer in layers), default=1)
        back = max(1, min(back, seeds))
        passes = {layer: math.ceil(self.width * len(self.needed[layer]) / back) for layer in layers}
        groups, budget = self._groups(layers)
        forth = max(1, min(forth, max((self.block_start[g[-1]] for g in groups), default=1)))
        forwards = {g: math.ceil(self.block_start[g[-1]] / forth) for g in groups}
        size = {layer: self._parts_bytes(layer) for layer in layers}
        largest = max(size, key=size.__getitem__, default=-1)
        return Cost(
            backward_passes=sum(passes.values()),
            backward_blocks=sum(k * layer for layer, k in passes.items())
            + (self.n_layers if layers else 0),
            backward_batch=back,
            forward_passes=sum(forwards.values()),
            forward_blocks=sum(k * g[-1] for g, k in forwards.items()),
            forward_batch=forth,
            groups=tuple(groups),
            parts_budget=budget,
            largest_parts=size.get(largest, 0),
            largest_layer=largest,
        )

    def _parts_bytes(self, layer: int) -> int:
        """What the forward keeps of `layer`: positions x width x the columns that reach it, in
        the model's dtype."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return len(self.needed[layer]) * self.width * self.block_start[layer] * element

    def _groups(self, layers: list[int]) -> tuple[list[tuple[int, ...]], float | None]:
        """`layers` in consecutive groups whose kept parts fit half the memory plan's share of
        the free memory where the embeddings run, and that budget (None where the free memory
        cannot be read: one layer a group, the least held at once). A layer over the budget
        alone gets a group of its own, which Cost.forward_fits refuses."""
        free = free_bytes(execution_device(self.parts.embed))
        if free is None:
            return [(layer,) for layer in layers], None
        budget = FRACTION / 2 * free
        groups: list[tuple[int, ...]] = []
        here: list[int] = []
        held = 0
        for layer in layers:
            size = self._parts_bytes(layer)
            if here and held + size > budget:
                groups.append(tuple(here))
                here, held = [], 0
            here.append(layer)
            held += size
        if here:
            groups.append(tuple(here))
        return groups, budget

    # -- the decomposition -------------------------------------------------------------------
    def rows(self, layer: int, positions: list[int]) -> dict[int, torch.Tensor]:
        """{position: (width, columns) float64}: each component of x_layer(position) split over
        the columns (its row sums to the component); {} for no positions."""
        if not positions:
            return {}
        if layer == 0:
            return self._first_rows(positions)
        if self.direction == "forward":
            return self._forward_rows(layer, positions)
        d = self.width
        seeds = [(p, i) for p in positions for i in range(d)]
        got = torch.zeros(len(seeds), len(self.names), dtype=torch.float64)
        self._keep_forward()
        for start in range(0, len(seeds), self.cost.backward_batch):
            chunk = seeds[start : start + self.cost.backward_batch]
            got[start : start + len(chunk)] = self._backward(layer, chunk)
            self.backward_passes += 1
        return {p: got[k * d : (k + 1) * d] for k, p in enumerate(positions)}

    def _first_rows(self, positions: list[int]) -> dict[int, torch.Tensor]:
        """x_0: the token's embedding and the rest of the first block's input (GPT-2's position
        embedding), as the position table splits it."""
        out = {}
        for p in positions:
            split = torch.zeros(self.width, len(self.names), dtype=torch.float64)
            split[:, p] = self.embed_value[p].cpu()
            split[:, self.n_pos + p] = (self.first_value[p] - self.embed_value[p]).cpu()
            out[p] = split
        return out

    def residual(self, layer: int, positions: list[int], residual_type):
        """Layer `layer`'s parts per position as qk_attribution's _Residual: at `positions` the
        nonzero columns of rows(), elsewhere the residual whole (one part, no node)."""
        x = self.seen.norm_io["attn_norm", layer][0][0]
        residual = residual_type(self.n_pos)
        rows = self.rows(layer, positions)
        for p in range(self.n_pos):
            if p not in rows:
                residual.add(p, f"residual@{p}", -1, x[p])
                continue
            split = rows[p]
            for c in torch.nonzero(split.abs().sum(0)).flatten().tolist():
                residual.add(p, self.names[c], self.nodes[c], split[:, c].to(self.dtype))
        return residual

    # -- backward: one seed per copy ---------------------------------------------------------
    def _keep_forward(self) -> None:
        """The forward of `batch` prompt copies that the backward passes run back through:
        each layer's attention input and write, each MLP's (replaced) output, the embeddings;
        and the nodes' writes in float64 where the embeddings run."""
        if self._kept:
            return
        parts, model, device = self.parts, self.model, self.device
        rep = LocalReplacement(model, self.transcoders, self.overrides, mode="attribute")
        batch = self.cost.backward_batch
        with rep:
            hooks = HookSet("qk sources")
            self.resid: dict[int, torch.Tensor] = {}
            self.attn_out: dict[int, torch.Tensor] = {}
            with hooks:
                for layer, norm in enumerate(parts.attn_norms):
                    hooks.forward_pre(norm, self._keep_input(layer), name=f"attn norm {layer}")
                for layer, m in enumerate(parts.post_attn_norms or parts.attns):
                    hooks.forward(m, self._keep_output(layer), name=f"attn write {layer}")
                with torch.enable_grad():
                    ids = self.graph.tokens[None].expand(batch, -1).to(device)
                    model(ids, **_lean(model))
            assert rep.captured.embed is not None  # (the forward ran)
            self.embed = rep.captured.embed
            self.mlp_out = dict(rep.captured.outputs)
        self.contracted = []
        for layer, w in enumerate(self.writes):
            self.contracted.append((
                torch.tensor([k[1] for k in w.features], dtype=torch.long, device=device),
                torch.tensor([self.feature_col[k] for k in w.features], dtype=torch.long,
                             device=device),
                w.vectors.to(device, torch.float64), w.error.to(device, torch.float64),
                self.mlp_rest[layer].to(device, torch.float64),
                self.attn_bias[layer].to(device, torch.float64),
            ))  # fmt: skip
        self._kept = True

    def _keep_input(self, layer: int):
        def hook(module, args):
            self.resid[layer] = args[0]

        return hook

    def _keep_output(self, layer: int):
        def hook(module, args, out):
            self.attn_out[layer] = out[0] if isinstance(out, tuple) else out

        return hook

    def _backward(self, layer: int, seeds: list[tuple[int, int]]) -> torch.Tensor:
        """One backward pass: copy b seeded with the unit vector of component seeds[b][1] at
        x_layer(seeds[b][0]); (len(seeds), columns) float64."""
        target = self.resid[layer]
        grad = torch.zeros_like(target)
        at, component = torch.tensor(seeds, dtype=torch.long).T
        rows = torch.arange(len(seeds), device=grad.device)
        grad[rows, at.to(grad.device), component.to(grad.device)] = 1
        x0 = self.resid[0]
        inputs = [self.embed, x0]
        inputs += [self.mlp_out[s] for s in range(layer)] + [self.attn_out[s] for s in range(layer)]
        distinct = list({id(t): t for t in inputs}.values())
        grads = torch.autograd.grad(target, distinct, grad, retain_graph=True, allow_unused=True)
        by_id = {id(t): g for t, g in zip(distinct, grads, strict=True)}

        device = self.device

        def grad_of(t: torch.Tensor) -> torch.Tensor:
            g = by_id[id(t)]
            g = torch.zeros_like(t) if g is None else g
            return g[: len(seeds)].to(device, torch.float64)  # (a device map's block: its own)

        n, n_pos = len(seeds), self.n_pos
        out = torch.zeros(n, len(self.names), dtype=torch.float64, device=device)
        g_embed, g_x0 = grad_of(self.embed), grad_of(x0)
        tokens = torch.einsum("bpd,pd->bp", g_embed, self.embed_value)
        out[:, :n_pos] = tokens
        out[:, n_pos : 2 * n_pos] = torch.einsum("bpd,pd->bp", g_x0, self.first_value) - tokens
        for source in range(layer):
            g = grad_of(self.mlp_out[source])
            pos, cols, vectors, error, rest, bias = self.contracted[source]
            if len(pos):
                out.index_add_(1, cols, torch.einsum("bkd,kd->bk", g[:, pos], vectors))
            e, m, a = self.error_col[source], self.mlp_col[source], self.attn_col[source]
            out[:, e : e + n_pos] = torch.einsum("bpd,pd->bp", g, error)
            out[:, m : m + n_pos] = torch.einsum("bpd,pd->bp", g, rest)
            g_attn = grad_of(self.attn_out[source])
            out[:, a : a + n_pos] = torch.einsum("bpd,pd->bp", g_attn, bias)
        return out.cpu()

    # -- forward: one column per copy --------------------------------------------------------
    def _forward_rows(self, layer: int, positions: list[int]) -> dict[int, torch.Tensor]:
        """rows() from the forward's kept parts of `layer`'s group (its forwards run the first
        time one of its layers is asked for)."""
        if layer not in self._group:
            group = next((g for g in self.cost.groups if layer in g), None)
            if group is None:
                raise ModelError(f"qk sources: layer {layer} was not among the layers planned")
            self._group = {}  # (the previous group's parts freed first)
            self._group = self._forward_group(group)
        kept, needed = self._group[layer], self.needed[layer]
        out = {}
        for p in positions:
            if p not in needed:
                raise ModelError(f"qk sources: position {p} of layer {layer} was not planned")
            split = torch.zeros(self.width, len(self.names), dtype=torch.float64)
            split[:, : kept.shape[-1]] = kept[needed.index(p)].cpu()
            out[p] = split
        return out

    def _forward_group(self, group: tuple[int, ...]) -> dict[int, torch.Tensor]:
        """The parts of x_l at the needed positions for every layer l of `group`, (positions,
        width, columns before l's block) in the model's dtype: the forwards of the columns that
        reach its last layer, `batch` columns at a time, each stopped there."""
        model, parts, device = self.model, self.parts, self.device
        last, batch = group[-1], self.cost.forward_batch
        kept = {layer: torch.zeros(len(self.needed[layer]), self.width, self.block_start[layer],
                                   dtype=self.dtype, device=device) for layer in group}  # fmt: skip
        rep = LocalReplacement(model, self.transcoders, self.overrides, mode="attribute")
        rep.tangents = True
        hooks = HookSet("qk sources forward")
        chunk = [0, 0]  # the columns the running forward carries: [start, stop)
        first_block = parts.blocks[0]

        def inject(where: str, layer: int):
            def hook(module, args, out):
                cols, pos, vectors = sources[where, layer]
                pick = (cols >= chunk[0]) & (cols < chunk[1])
                if not bool(pick.any()):
                    return None
                value = out[0] if isinstance(out, tuple) else out
                tangent = torch.zeros(chunk[1] - chunk[0], *value.shape[1:], dtype=value.dtype,
                                      device=value.device)  # fmt: skip
                at = (cols[pick] - chunk[0]).to(value.device), pos[pick].to(value.device)
                tangent[at] = vectors[pick].to(value.device, value.dtype)
                if where == "embed":  # (the replacement made it a leaf: a dual now)
                    value = fwAD.make_dual(value.detach(), tangent)
                else:
                    value = value + fwAD.make_dual(torch.zeros_like(tangent), tangent)
                return (value, *out[1:]) if isinstance(out, tuple) else value

            return hook

        def inject_first(module, args, kwargs):  # (the embedding's rest, at x_0)
            x = inject("first", 0)(module, None, args[0] if args else kwargs["hidden_states"])
            if x is None:
                return None
            if args:
                return (x, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": x}

        def read(layer: int):
            needed = torch.tensor(self.needed[layer], dtype=torch.long)

            def hook(module, args):
                reach = min(chunk[1], self.block_start[layer]) - chunk[0]
                tangent = fwAD.unpack_dual(args[0]).tangent
                if reach > 0 and tangent is not None:
                    got = tangent[:reach, needed.to(tangent.device)].to(device, self.dtype)
                    kept[layer][:, :, chunk[0] : chunk[0] + reach] = got.permute(1, 2, 0)
                if layer == last:
                    raise _Stop

            return hook

        with rep, fwAD.dual_level(), torch.no_grad(), hooks:
            sources = self._sources(first_block)
            hooks.forward(parts.embed, inject("embed", 0), name="embed")
            hooks.forward_pre(first_block, inject_first, name="first block", with_kwargs=True)
            for layer, m in enumerate(parts.post_attn_norms or parts.attns):
                hooks.forward(m, inject("attn", layer), name=f"attn write {layer}")
            for layer, m in enumerate(rep.mlp_writes):
                hooks.forward(m, inject("mlp", layer), name=f"mlp write {layer}")
            for layer in group:
                hooks.forward_pre(parts.attn_norms[layer], read(layer), name=f"read {layer}")
            n_cols = self.block_start[last]
            for start in range(0, n_cols, batch):
                chunk[:] = [start, min(start + batch, n_cols)]
                ids = self.graph.tokens[None].expand(chunk[1] - start, -1).to(device)
                with contextlib.suppress(_Stop):
                    model(ids, **_lean(model))
                self.forward_passes += 1
        return kept

    def _sources(self, first_block: torch.nn.Module):
        """Where each column is written, as (columns, positions, vectors) per place: ("embed",
        0) the embeddings' output (the tokens), ("first", 0) the first block's input x_0 (the
        embedding's rest: x_0 less what the tokens became there, the position table's split
        where the model adds to the embeddings, x_0 whole where it rescales them), ("mlp", l)
        layer l's MLP write (its features', a CLT's earlier layers' too, its error and its
        rest), ("attn", l) its attention write (its bias part). Run inside the forward's
        replacement and dual level."""
        n_pos, device = self.n_pos, self.device
        every = torch.arange(n_pos, device=device)

        def block(first: int, vectors: torch.Tensor):
            return every + first, every, vectors.to(device, self.dtype)

        out: dict[tuple[str, int], tuple[torch.Tensor, ...]] = {}
        out["embed", 0] = block(0, self.embed_value)
        tokens = self._tokens_at_first_block(first_block)
        out["first", 0] = block(n_pos, self.first_value.to(self.dtype) - tokens)
        for layer, w in enumerate(self.writes):
            features = (
                torch.tensor([self.feature_col[k] for k in w.features], dtype=torch.long,
                             device=device),
                torch.tensor([k[1] for k in w.features], dtype=torch.long, device=device),
                w.vectors.to(device, self.dtype),
            )  # fmt: skip
            error = block(self.error_col[layer], w.error)
            rest = block(self.mlp_col[layer], self.mlp_rest[layer])
            out["mlp", layer] = tuple(torch.cat(t) for t in zip(features, error, rest, strict=True))
            out["attn", layer] = block(self.attn_col[layer], self.attn_bias[layer])
        return out

    def _tokens_at_first_block(self, first_block: torch.nn.Module) -> torch.Tensor:
        """What the tokens' embeddings become at x_0 (n_pos, d), in the model's dtype: one
        copy's forward carrying the embeddings' output as its tangent, stopped at the first
        block's input (a model may rescale the embeddings between its embeddings module and
        its first block: older transformers' Gemma multiplies them by sqrt(width) there). Read
        once; run inside the forward's replacement and dual level."""
        if self._at_first_block is not None:
            return self._at_first_block
        got: list[torch.Tensor] = []
        embed = self.embed_value.to(self.dtype)[None]

        def carry(module, args, out):
            value = out[0] if isinstance(out, tuple) else out
            value = fwAD.make_dual(value.detach(), embed.to(value.device, value.dtype))
            return (value, *out[1:]) if isinstance(out, tuple) else value

        def read(module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            tangent = fwAD.unpack_dual(x).tangent
            got.append(torch.zeros_like(x[0]) if tangent is None else tangent[0])
            raise _Stop

        hooks = HookSet("qk sources: the tokens at the first block")
        with hooks:
            hooks.forward(self.parts.embed, carry, name="embed")
            hooks.forward_pre(first_block, read, name="first block", with_kwargs=True)
            with contextlib.suppress(_Stop):
                self.model(self.graph.tokens[None].to(self.device), **_lean(self.model))
        self._at_first_block = got[0].to(self.device, self.dtype)
        return self._at_first_block


def needed_positions(pattern: torch.Tensor, positions: list[int], keys: int) -> list[int]:
    """The query positions and, for each, the `keys` key positions every head attends to most
    (pattern: heads x n_pos x n_pos), in order."""
    need = set(positions)
    for q in positions:
        need |= set(torch.topk(pattern[:, q], min(keys, q + 1), dim=-1).indices.flatten().tolist())
    return sorted(need)
