"""What every sender wrote on one run, kept compact, and the writes rebuilt from it a chunk at a
time.

A run's sender states are the first block's input (the `input` node's write, (N, T, D)), each
layer's attention output projection input (the heads side by side, (N, T, heads x head_dim): a
head's write is its slice times its slice of the projection's weight) and each MLP's output
(N, T, D): the size of the residual stream per layer, never senders x width. `writes` turns a
slice of rows and positions of them into the writes of chosen senders, (..., t, senders, D), so
nothing larger than a chunk is ever built. States may broadcast (a mean per node: leading dims of
size 1), and subtract: the writes are linear in them, so writes(a - b) = writes(a) - writes(b).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from probe.circuits.parts import Parts
from probe.errors import ConfigError
from probe.hooks.forward import call, to_device
from probe.hooks.hookset import HookSet


@dataclass
class SenderStates:
    """Per sender kind: the input's write, each layer's heads (before the output projection)
    and each layer's MLP output; leading dims (rows, positions) may be 1 to broadcast."""

    input: torch.Tensor
    heads: list[torch.Tensor]
    mlp: list[torch.Tensor]

    def minus(self, other: SenderStates) -> SenderStates:
        return SenderStates(
            self.input - other.input,
            [a - b for a, b in zip(self.heads, other.heads, strict=True)],
            [a - b for a, b in zip(self.mlp, other.mlp, strict=True)],
        )

    def map(self, fn) -> SenderStates:
        return SenderStates(fn(self.input), [fn(t) for t in self.heads], [fn(t) for t in self.mlp])

    def zeros_like(self) -> SenderStates:
        return self.map(lambda t: torch.zeros_like(t[:1, :1]))

    @classmethod
    def constant(cls, input, heads, mlp) -> SenderStates:
        """States from tensors (a mean per node, from a dataset or an earlier run): input (D,)
        or (T, D), heads per layer (heads x head_dim,) or (T, ...), mlp per layer (D,) or
        (T, D); broadcast over rows (and positions where they have none)."""

        def lift(t):
            t = torch.as_tensor(t)
            return t[None, None] if t.ndim == 1 else t[None]

        return cls(lift(input), [lift(t) for t in heads], [lift(t) for t in mlp])


def _at(t: torch.Tensor, rows: slice, positions: slice) -> torch.Tensor:
    """t[rows, positions] where those dims are not broadcast (size 1)."""
    t = t if t.shape[0] == 1 else t[rows]
    return t if t.shape[1] == 1 else t[:, positions]


def writes(
    parts: Parts,
    states: SenderStates,
    senders: np.ndarray,
    rows: slice = slice(None),
    positions: slice = slice(None),
    dtype=torch.float32,
    senders_first: bool = False,
) -> torch.Tensor:
    """(n, t, len(senders), D) writes of the chosen senders (graph indices, ascending) over
    `rows` and `positions` of `states`; (n, len(senders), t, D), contiguous, if
    `senders_first`."""
    graph = parts.graph
    pieces = []
    senders = np.asarray(senders)
    if (senders == 0).any():
        pieces.append(_at(states.input, rows, positions).to(dtype)[:, :, None])
    for layer in range(graph.layers):
        first = graph.head(layer, 0)
        mine = senders[(senders >= first) & (senders < first + graph.heads)] - first
        if len(mine):
            z = _at(states.heads[layer], rows, positions).to(dtype)
            z = z.reshape(*z.shape[:2], graph.heads, parts.head_dim)[:, :, mine]
            w = parts.head_weights(layer, dtype)[mine].to(z.device)
            pieces.append(torch.einsum("nthk,hkd->nthd", z, w))
        if (senders == graph.mlp(layer)).any():
            pieces.append(_at(states.mlp[layer], rows, positions).to(dtype)[:, :, None])
    if not pieces:
        raise ValueError("writes: no sender chosen")
    n = max(p.shape[0] for p in pieces)
    t = max(p.shape[1] for p in pieces)
    pieces = [p.expand(n, t, *p.shape[2:]) for p in pieces]
    if senders_first:  # one copy, straight into the layout
        return torch.cat([p.permute(0, 2, 1, 3) for p in pieces], 1).contiguous()
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, 2)


class Recorder:
    """Hooks (through a HookSet) that keep a run's sender states, and optionally replace what a
    group of senders writes: `replace` maps `input`, `heads{layer}` or `mlp{layer}` to a function
    of the run's own value returning the value to use instead."""

    def __init__(self, parts: Parts, hooks: HookSet, replace: dict | None = None, leaf=False):
        self.parts, self.replace, self.leaf = parts, replace or {}, leaf
        self.input: torch.Tensor | None = None
        self.heads: dict[int, torch.Tensor] = {}
        self.mlp: dict[int, torch.Tensor] = {}
        hooks.forward_pre(parts.first_block, self._first, with_kwargs=True, name="first block")
        for i, layer in enumerate(parts.layers):
            hooks.forward_pre(layer.attn_out, self._heads(i), name=layer.attn_out_name)
            hooks.forward(layer.mlp, self._mlp(i), name=f"mlp {i}")

    def states(self) -> SenderStates:
        n = self.parts.graph.layers
        missing = [k for k in range(n) if k not in self.heads or k not in self.mlp]
        if self.input is None or missing:
            raise ConfigError(
                f"circuits: the forward did not call every part the graph reads (layers "
                f"{missing} or the first block); check model.anatomy"
            )
        return SenderStates(
            self.input, [self.heads[k] for k in range(n)], [self.mlp[k] for k in range(n)]
        )

    def _first(self, module, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        new = self.replace["input"](x) if "input" in self.replace else x
        if self.leaf and not new.requires_grad:
            new = new.detach().requires_grad_(True)  # so that a frozen model has a graph
        self.input = new.detach()
        if new is x:
            return None
        if args:
            return (new, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": new}

    def _heads(self, layer: int):
        key = f"heads{layer}"

        def hook(module, args):
            z = args[0]
            new = self.replace[key](z) if key in self.replace else z
            self.heads[layer] = new.detach()
            return None if new is z else (new, *args[1:])

        return hook

    def _mlp(self, layer: int):
        key = f"mlp{layer}"

        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            new = self.replace[key](out) if key in self.replace else out
            self.mlp[layer] = new.detach()
            if new is out:
                return None
            return (new, *output[1:]) if isinstance(output, tuple) else new

        return hook


@torch.no_grad()
def record(parts: Parts, inputs: dict) -> tuple[SenderStates, object]:
    """The sender states of one plain forward on `inputs` (on the model's device), and its
    output."""
    hooks = HookSet("circuit states")
    with hooks:
        recorder = Recorder(parts, hooks)
        out = call(parts.model, inputs)
    return recorder.states(), out


@torch.no_grad()
def mean_states(
    parts: Parts, batches: Iterable[dict], per_position: bool = False, device=None
) -> SenderStates:
    """Each sender's mean state over the real tokens of `batches` (token dicts with input_ids
    and attention_mask), for mean ablation: one vector per node, or one per node and position
    (`per_position`; every batch then of one length). Sums and counts in float64, so the mean
    does not depend on how the data is batched."""
    sums: SenderStates | None = None
    count = None
    device = device or next(parts.model.parameters()).device
    for batch in batches:
        inputs = to_device(
            parts.model,
            {k: batch[k] for k in ("input_ids", "attention_mask") if k in batch},
            device,
        )
        states, _ = record(parts, inputs)
        mask = inputs.get("attention_mask")
        mask = torch.ones(inputs["input_ids"].shape, device=device) if mask is None else mask
        w = mask.double()[..., None]

        def reduce(t, w=w):
            summed = (t.double() * w).sum(0)
            return summed if per_position else summed.sum(0)

        got = states.map(reduce)
        n = w.sum(0) if per_position else w.sum((0, 1))
        if sums is not None and per_position and got.input.shape != sums.input.shape:
            raise ConfigError(
                "circuits: a per-position mean needs every batch of one length; got "
                f"{got.input.shape[0]} and {sums.input.shape[0]} positions"
            )
        sums = got if sums is None else SenderStates(
            sums.input + got.input,
            [a + b for a, b in zip(sums.heads, got.heads, strict=True)],
            [a + b for a, b in zip(sums.mlp, got.mlp, strict=True)],
        )  # fmt: skip
        count = n if count is None else count + n
    if sums is None:
        raise ConfigError("circuits: mean ablation needs a dataset to average over; it is empty")
    assert count is not None  # (counted with the sums)
    dtype = next(parts.model.parameters()).dtype
    means = sums.map(lambda t: (t / count.clamp(min=1)).to(dtype))
    return SenderStates.constant(means.input, means.heads, means.mlp)
