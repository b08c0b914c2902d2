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
linear in what the transcoder reads, so it is traced further, as the graph's edges are.

One row of these parts per residual component comes from one backward pass of the replacement
model seeded with that component's unit vector at x_l(p) (`batch` copies of the prompt, one
seed each): the gradient at each node's write, contracted with the write, is the node's share.
Layer l's decomposition at the positions a table needs (its query positions and the keys they
attend to most) costs `width x positions` seeds, `ceil(width x positions / batch)` backward
passes; every pair of the layer (every head and key) shares them.
"""

from __future__ import annotations

import torch

from probe.errors import ModelError
from probe.graphs.attribution import GraphOptions, _lean, batch_plan
from probe.graphs.replacement import LocalReplacement, _apply, _skip_path
from probe.hooks.hookset import HookSet
from probe.models.placement import execution_device

VALUES_NAME = "probe_qk_frozen_values"


class _FrozenValues:
    """The attention function of a constant pass: the recorded pattern times the values."""

    pattern: torch.Tensor | None = None

    @staticmethod
    def attend(module, query, key, value, attention_mask, **kwargs):
        pattern = _FrozenValues.pattern
        if pattern is None:
            raise ModelError(f"attention implementation {VALUES_NAME!r} called outside a pass")
        return _apply(pattern, value), pattern


class NodeSources:
    """The decomposition of each layer's attention input over the graph's nodes and the constant
    parts (see the module docstring). `seen` is qk_attribution's record forward of the prompt,
    `writes` its per-layer _LayerWrites, `graph` names the nodes; one attribute-mode forward of
    `batch` prompt copies (None: the graph's memory plan) is kept for the backward passes."""

    def __init__(self, seen, writes, graph, transcoders, overrides, batch: int | None = None):
        self.seen, self.writes, self.graph = seen, writes, graph
        parts = seen.parts
        self.n_layers = parts.n_layers
        self.n_pos = int(graph.tokens.shape[0])
        x = seen.norm_io["attn_norm", 0][0]
        self.width, self.dtype = int(x.shape[-1]), x.dtype
        self._columns(graph)
        self._constants(transcoders)
        rep = LocalReplacement(seen.model, transcoders, overrides, mode="attribute")
        model = seen.model
        device = execution_device(parts.embed)
        seeds = self.width * self.n_pos
        with rep:
            if batch is None:
                batch = batch_plan(model, rep, self.n_pos, GraphOptions()).batch
            self.batch = max(1, min(batch, seeds))
            hooks = HookSet("qk sources")
            self.resid: dict[int, torch.Tensor] = {}
            self.attn_out: dict[int, torch.Tensor] = {}
            with hooks:
                for layer, norm in enumerate(parts.attn_norms):
                    hooks.forward_pre(norm, self._keep_input(layer), name=f"attn norm {layer}")
                for layer, m in enumerate(parts.post_attn_norms or parts.attns):
                    hooks.forward(m, self._keep_output(layer), name=f"attn write {layer}")
                with torch.enable_grad():
                    ids = graph.tokens[None].expand(self.batch, -1).to(device)
                    model(ids, **_lean(model))
            assert rep.captured.embed is not None  # (the forward ran)
            self.embed = rep.captured.embed
            self.mlp_out = dict(rep.captured.outputs)
        self.backward_passes = 0
        # what the gradients are contracted with, in float64 where the embeddings run
        self.device = device
        self.embed_value = self.embed[0].detach().to(device, torch.float64)
        self.first_value = self.resid[0][0].detach().to(device, torch.float64)
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

    # -- the columns: nodes and constant parts ----------------------------------------------
    def _columns(self, graph) -> None:
        """Every column's name and graph node (-1: none): tokens, position embeddings, then per
        layer its features (a CLT's by their own layer), error, MLP rest and attention bias."""
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
        self.error_col, self.mlp_col, self.attn_col = [], [], []
        for layer in range(n):
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

    # -- the forward's tensors ---------------------------------------------------------------
    def _keep_input(self, layer: int):
        def hook(module, args):
            self.resid[layer] = args[0]

        return hook

    def _keep_output(self, layer: int):
        def hook(module, args, out):
            self.attn_out[layer] = out[0] if isinstance(out, tuple) else out

        return hook

    # -- the decomposition -------------------------------------------------------------------
    def rows(self, layer: int, positions: list[int]) -> dict[int, torch.Tensor]:
        """{position: (width, columns) float64}: each component of x_layer(position) split over
        the columns (its row sums to the component)."""
        d = self.width
        seeds = [(p, i) for p in positions for i in range(d)]
        got = torch.zeros(len(seeds), len(self.names), dtype=torch.float64)
        for start in range(0, len(seeds), self.batch):
            chunk = seeds[start : start + self.batch]
            got[start : start + len(chunk)] = self._backward(layer, chunk)
            self.backward_passes += 1
        return {p: got[k * d : (k + 1) * d] for k, p in enumerate(positions)}

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


def needed_positions(pattern: torch.Tensor, positions: list[int], keys: int) -> list[int]:
    """The query positions and, for each, the `keys` key positions every head attends to most
    (pattern: heads x n_pos x n_pos), in order."""
    need = set(positions)
    for q in positions:
        need |= set(torch.topk(pattern[:, q], min(keys, q + 1), dim=-1).indices.flatten().tolist())
    return sorted(need)
