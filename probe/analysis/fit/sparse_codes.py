"""Sparse codes of TopK-style transcoders (topk, batchtopk, AuxK): a few (row, feature) pairs
of a batch chosen from the pre-activations, and their decoding, with backward passes written
out rather than left to autograd. Both trainers (transcoder_trainer.py per layer, clt.py per
source layer) choose with `top_rows`, `top_batch` and `top_among` and hold the result as
`SparseCodes`.

A `Selection` is the chosen pairs of a (rows, width) batch, grouped by row: `features` (n,) in
row order and `offsets` (rows,) where each row's run starts (topk: k a row; batchtopk: however
many of the batch's k x rows fall in it). Over a selection:

- `selected_preactivations(x, W_enc, b_enc, pre, sel)`: the pre-activations x @ W_enc + b_enc at
  the chosen pairs, read from `pre` (the same product, computed once without a graph); its
  gradients are those of the dense formula, with the gradient of every pair not chosen 0:
  grad W_enc = x^T G, grad b_enc = sum_rows G, grad x = G W_enc^T, G the (rows, width) gradient
  with the chosen pairs' values.
- `decode(values, sel, W_dec)`: each row's sum of value x W_dec[feature] over its pairs (an
  embedding bag, as sparsify decodes); gradients: grad values = (grad_out W_dec^T) at the pairs,
  grad W_dec = A^T grad_out, A the (rows, width) activations.

Autograd through a dense top-k would materialise G and A as scatters into zeros and multiply
them densely; an embedding bag's own backward is slow on a CPU. Here each backward takes one of
two forms with the same value: dense products when the chosen pairs are at least `DENSE_SHARE`
of the batch's (at width 256 and k 8 the (rows x width) products cost less than the gathers on
a CPU), else sums over the chosen pairs only (index_add over their features: the cost follows
n, not rows x width, as sparsify's encoder backward).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

DENSE_SHARE = 1 / 64  # the share of a batch's (row, feature) pairs from which backwards run dense
# batchtopk's selection reads a threshold from every BATCH_SAMPLE-th pre-activation, set that
# much lower than the sample says (about 1.2 x k x rows entries pass it on the planted problem)
BATCH_SAMPLE, BATCH_MARGIN = 8, 1.25


@dataclass(frozen=True)
class Selection:
    """Chosen (row, feature) pairs of a (rows, width) batch, grouped by row."""

    features: torch.Tensor  # (n,) long, each row's features in turn
    rows: torch.Tensor  # (n,) long, the row of each pair (non-decreasing)
    offsets: torch.Tensor  # (rows,) long, where each row's pairs start in `features`
    flat_indices: torch.Tensor  # (n,) long, each pair's index into the flattened batch
    shape: tuple[int, int]  # (rows, width)

    @staticmethod
    def per_row(indices: torch.Tensor, width: int) -> Selection:
        """The same count of features a row: `indices` (rows, m)."""
        n_rows, m = indices.shape
        row_ids = torch.arange(n_rows, device=indices.device)
        features = indices.reshape(-1)
        flat = (row_ids.unsqueeze(1) * width + indices).reshape(-1)
        return Selection(features, row_ids.repeat_interleave(m), row_ids * m, flat,
                         (n_rows, width))  # fmt: skip

    @staticmethod
    def flat(flat_indices: torch.Tensor, shape: tuple[int, int]) -> Selection:
        """Pairs given as indices into the flattened (rows, width) batch, in any order."""
        flat_indices = flat_indices.sort().values
        n_rows, width = shape
        rows = torch.div(flat_indices, width, rounding_mode="floor")
        counts = torch.bincount(rows, minlength=n_rows)
        offsets = counts.cumsum(0) - counts
        return Selection(flat_indices - rows * width, rows, offsets, flat_indices, shape)

    @property
    def dense_backward(self) -> bool:
        rows, width = self.shape
        return len(self.features) >= DENSE_SHARE * rows * width

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """The (rows, width) tensor holding `values` at the chosen pairs, 0 elsewhere."""
        out = values.new_zeros(self.shape[0] * self.shape[1])
        return out.index_copy_(0, self.flat_indices, values).view(self.shape)

    def gather(self, dense: torch.Tensor) -> torch.Tensor:
        """The chosen pairs' entries of a (rows, width) tensor, (n,)."""
        return dense.reshape(-1).index_select(0, self.flat_indices)

    def fired(self, values: torch.Tensor) -> torch.Tensor:
        """(width,) bool: the features with a value > 0 in some row."""
        on = (values > 0).to(values.dtype)
        return torch.bincount(self.features, weights=on, minlength=self.shape[1]) > 0


class _SelectedPreactivations(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, W_enc, b_enc, pre, sel: Selection):
        ctx.save_for_backward(x, W_enc)
        ctx.sel = sel
        return sel.gather(pre)

    @staticmethod
    def backward(ctx, grad):
        x, W_enc = ctx.saved_tensors
        sel: Selection = ctx.sel
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = grad_w = grad_b = None
        if sel.dense_backward:
            G = sel.scatter(grad.to(x.dtype))
            grad_w = x.T @ G if need_w else None
            grad_b = G.sum(0) if need_b else None
            grad_x = G @ W_enc.T if need_x else None
        else:
            width = sel.shape[1]
            if need_w:  # W_enc's columns, as rows of its transpose: only the chosen ones
                parts = grad.unsqueeze(1) * x.index_select(0, sel.rows)
                grad_w = parts.new_zeros(width, x.shape[1]).index_add_(0, sel.features, parts).T
            if need_b:
                grad_b = grad.new_zeros(width).index_add_(0, sel.features, grad)
            if need_x:
                parts = grad.unsqueeze(1) * W_enc.T.index_select(0, sel.features)
                grad_x = parts.new_zeros(x.shape).index_add_(0, sel.rows, parts)
        return grad_x, grad_w, grad_b, None, None


class _Decode(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, W_dec, sel: Selection):
        ctx.save_for_backward(values, W_dec)
        ctx.sel = sel
        return F.embedding_bag(sel.features, W_dec, sel.offsets, mode="sum",
                               per_sample_weights=values)  # fmt: skip

    @staticmethod
    def backward(ctx, grad_out):
        values, W_dec = ctx.saved_tensors
        sel: Selection = ctx.sel
        grad_values = grad_w = None
        if sel.dense_backward:
            if ctx.needs_input_grad[0]:
                grad_values = sel.gather(grad_out @ W_dec.T)
            if ctx.needs_input_grad[1]:
                grad_w = sel.scatter(values).T @ grad_out
        else:
            rows_grad = grad_out.index_select(0, sel.rows)
            if ctx.needs_input_grad[0]:
                grad_values = (rows_grad * W_dec.index_select(0, sel.features)).sum(1)
            if ctx.needs_input_grad[1]:
                grad_w = W_dec.new_zeros(W_dec.shape).index_add_(
                    0, sel.features, values.unsqueeze(1) * rows_grad
                )
        return grad_values, grad_w, None


def selected_preactivations(x: torch.Tensor, W_enc: torch.Tensor, b_enc: torch.Tensor,
                            pre: torch.Tensor, sel: Selection) -> torch.Tensor:  # fmt: skip
    """(n,): (x @ W_enc + b_enc) at the chosen pairs, read from `pre` (that product, computed
    without a graph), differentiable in x, W_enc and b_enc (see the module docstring)."""
    return _SelectedPreactivations.apply(x, W_enc, b_enc, pre, sel)


def decode(values: torch.Tensor, sel: Selection, W_dec: torch.Tensor) -> torch.Tensor:
    """(rows, d_out): each row's sum of value x W_dec[feature] over its chosen pairs,
    differentiable in values and W_dec."""
    return _Decode.apply(values, W_dec, sel)


class SparseCodes:
    """The active features as chosen (row, feature) pairs (topk, batchtopk, AuxK) and their
    values: decoded from the decoder rows they index, not a dense product over every feature."""

    def __init__(self, values: torch.Tensor, selection: Selection):
        self.values, self.selection = values, selection

    def decode(self, W_dec: torch.Tensor) -> torch.Tensor:
        """sum over each row's pairs of value x W_dec[feature]."""
        return decode(self.values, self.selection, W_dec)

    def fired(self) -> torch.Tensor:
        """Which features are active (value > 0) in some row."""
        return self.selection.fired(self.values)

    def smallest(self) -> torch.Tensor | None:
        """The smallest active value (None: none is active)."""
        on = self.values[self.values > 0]
        return on.min() if len(on) else None


def top_rows(pre: torch.Tensor, k: int) -> Selection:
    """Each row's k largest pre-activations (k at most the width: the fits refuse more)."""
    return Selection.per_row(torch.topk(pre, k, dim=-1, sorted=False).indices, pre.shape[-1])


def top_batch(pre: torch.Tensor, k: int) -> Selection:
    """The k x rows largest pre-activations of the whole batch: a top-k over the entries at or
    above a threshold t read from every BATCH_SAMPLE-th entry (the k x rows / BATCH_SAMPLE x
    BATCH_MARGIN-th largest of them), which holds them all once at least k x rows entries are
    >= t (checked; else the top-k runs over every entry). The same pairs, fewer to sort."""
    flat = pre.reshape(-1)
    n = min(k * pre.shape[0], flat.numel())
    shape = (pre.shape[0], pre.shape[1])
    sample = flat[::BATCH_SAMPLE]
    j = math.ceil(n / BATCH_SAMPLE * BATCH_MARGIN) + 1
    if j < len(sample):
        t = torch.kthvalue(sample, len(sample) - j + 1).values
        above = (flat >= t).nonzero().squeeze(1)
        if len(above) >= n:
            top = torch.topk(flat.index_select(0, above), n, sorted=False)
            return Selection.flat(above[top.indices], shape)
    return Selection.flat(torch.topk(flat, n, sorted=False).indices, shape)


def top_among(pre: torch.Tensor, columns: torch.Tensor, k: int) -> Selection:
    """Each row's k largest pre-activations among `columns` (AuxK's dead features; a top-k over
    those columns only); every one of them when there are no more than k (no top-k to compute)."""
    if len(columns) <= k:
        indices = columns.expand(len(pre), len(columns))
    else:
        top = torch.topk(pre.index_select(1, columns), k, sorted=False)
        indices = columns[top.indices]
    return Selection.per_row(indices, pre.shape[-1])
