"""Attention heads' queries and keys as grid sites (`intervene.grid.site: query | key`), read,
patched and differentiated inside the attention itself.

transformers calls attention through its AttentionInterface; a function registered there under
NAME wraps each family's own eager attention, so the probabilities are those the model computes
(their outputs equal its sdpa ones to float rounding, tests/intervene/test_atp.py). A query or a
key reaches the output only through its head's attention probabilities, so atp_star (the QK fix
of Kramar et al. 2024) recomputes that head's softmax exactly with the patched query or key and
linearises the metric through the probabilities alone: delta = sum (A' - A) dMetric/dA.
"""

from __future__ import annotations

import sys

import torch

from probe.errors import ConfigError

NAME = "probe"
_handlers: dict[int, tuple[AttentionSites, str]] = {}  # id(attention module) -> (sites, layer)
_registered = [False]


def _attention(module, query, key, value, attention_mask, **kwargs):
    found = _handlers.get(id(module))
    if found is not None:
        query, key = found[0].before(found[1], query, key)
    eager = sys.modules[type(module).__module__].eager_attention_forward
    out, weights = eager(module, query, key, value, attention_mask, **kwargs)
    if found is not None:
        found[0].after(found[1], query, key, weights, attention_mask, kwargs.get("scaling"))
    return out, weights


def register() -> None:
    if _registered[0]:
        return
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    _registered[0] = True


def pattern(query, key, mask, scaling) -> torch.Tensor:
    """Softmax attention probabilities (N, H, Tq, Tk) as the eager attentions compute them, the
    key heads shared by groups of query heads."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1) if groups > 1 else key
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores + mask[..., : key.shape[-2]]
    return scores.softmax(-1)


class AttentionSites:
    """The grid's query or key sites: `mode` record (the source's values), patch (the exact
    grid's cells, `grid.active`) or grad (the target's values and probabilities kept for atp)."""

    def __init__(self, grid, model):
        self.grid, self.model, self.kind = grid, model, grid.site
        self.mode: str | None = None
        self.values: dict[str, torch.Tensor] = {}
        self.kept: dict[str, dict] = {}
        self.previous = None

    def __enter__(self) -> AttentionSites:
        config = getattr(self.model, "config", None)
        if config is None or not hasattr(self.model, "set_attn_implementation"):
            raise ConfigError(
                f"{self.grid.label}: site {self.kind} reads attention inside a transformers "
                "model's attention function; this model is not one"
            )
        register()
        self.previous = config._attn_implementation
        self.model.set_attn_implementation(NAME)
        for name, module in self.grid.modules:
            _handlers[id(module)] = (self, name)
        return self

    def __exit__(self, *exc) -> None:
        for _, module in self.grid.modules:
            _handlers.pop(id(module), None)
        if self.previous is not None:
            self.model.set_attn_implementation(self.previous)
            self.previous = None

    def before(self, name: str, query, key):
        if self.mode == "patch":
            if self.kind == "query":
                query = self._patched(name, query)
            else:
                key = self._patched(name, key)
        return query, key

    def after(self, name: str, query, key, weights, mask, scaling) -> None:
        if self.mode == "record":
            self.values[name] = (query if self.kind == "query" else key).detach().clone()
        elif self.mode == "grad" and name not in self.kept:
            self.kept[name] = {"query": query, "key": key, "weights": weights, "mask": mask,
                               "scaling": scaling}  # fmt: skip

    def _patched(self, name: str, x: torch.Tensor) -> torch.Tensor:
        mine = [(k, c) for k, c in enumerate(self.grid.active) if c.layer == name]
        if not mine:
            return x
        n = len(x) // len(self.grid.active)
        source, out = self.values[name], x.clone()
        for k, cell in mine:
            rows = torch.arange(n, device=x.device)
            at = self.positions(cell, n, x.shape[2], x.device)
            out[k * n + rows, cell.head, at] = source[rows, cell.head, at].to(x)
        return out

    def positions(self, cell, n: int, t: int, device) -> torch.Tensor:
        """Each sample's index of the cell's position (negative: from its last real token)."""
        tokens = self.grid.tokens
        last = tokens.last.to(device) if tokens is not None else torch.full((n,), t - 1)
        p = cell.position
        return (last + 1 + p) if p < 0 else torch.full((n,), p, device=device)

    def deltas(self, name: str, cells, grads: dict, star: bool) -> list[torch.Tensor]:
        """Per cell of layer `name`, each sample's linear (atp) or QK-fixed (atp_star) delta."""
        kept, source = self.kept[name], self.values[name]
        target = kept[self.kind].detach()
        out = []
        for cell in cells:
            n = len(target)
            rows = torch.arange(n, device=target.device)
            at = self.positions(cell, n, target.shape[2], target.device)
            if not star:
                g = grads[self.kind][rows, cell.head, at].double()
                diff = (source[rows, cell.head, at] - target[rows, cell.head, at]).double()
                out.append((diff * g).sum(-1))
                continue
            changed = patched_pattern(kept, source, self.kind, cell.head, at)
            heads = _query_heads(kept, self.kind, cell.head)
            before = kept["weights"].detach()[:, heads].double()
            out.append(((changed - before) * grads["weights"][:, heads].double()).sum((1, 2, 3)))
        return out


def _query_heads(kept, kind: str, head: int) -> list[int]:
    """The query heads a key head serves (GQA); a query cell's own head."""
    if kind == "query":
        return [head]
    groups = kept["query"].shape[1] // kept["key"].shape[1]
    return list(range(head * groups, (head + 1) * groups))


def patched_pattern(kept, source, kind: str, head: int, at: torch.Tensor) -> torch.Tensor:
    """The attention probabilities of the heads a query or key of `head` feeds, recomputed
    exactly with that query or key at each sample's position `at` taken from `source`."""
    query, key = kept["query"].detach().double(), kept["key"].detach().double()
    rows = torch.arange(len(query), device=query.device)
    heads = _query_heads(kept, kind, head)
    if kind == "query":
        query = query.clone()
        query[rows, head, at] = source[rows, head, at].double()
        key_heads = [h // (kept["query"].shape[1] // kept["key"].shape[1]) for h in heads]
    else:
        key = key.clone()
        key[rows, head, at] = source[rows, head, at].double()
        key_heads = [head] * len(heads)
    mask = kept["mask"].double() if kept["mask"] is not None else None
    return pattern(query[:, heads], key[:, key_heads], mask, kept["scaling"])
