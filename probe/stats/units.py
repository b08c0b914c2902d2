"""Statistics along any unit axis: a batch seen as (rows, units, rest), the view the compiled
passes reduce, whichever axis holds the units (channels of a conv layout, features of a token
layout). numpy only: the summarizer reads files without torch."""

from __future__ import annotations

import numpy as np


def units_view(a: np.ndarray, axis: int = 1) -> tuple[np.ndarray, bool]:
    """`a` (rows, ...) as (rows', units, rest) with its units along `axis`, and whether rows'
    differ from a's rows. Units on the last axis of (N, T, C) need no copy: the view is
    (N*T, C, 1), each token a row (its per-row L2 norms then are per token, see `row_l2_sum`);
    units on another inner axis are moved to axis 1 (a copy)."""
    if a.ndim < 2:
        return a.reshape(len(a) if a.ndim else 1, 1, -1), False
    axis = axis % a.ndim
    if a.ndim == 2 or axis == 1:
        return a.reshape(a.shape[0], a.shape[1], -1), False
    if axis == a.ndim - 1:
        return a.reshape(-1, a.shape[-1], 1), True
    moved = np.ascontiguousarray(np.moveaxis(a, axis, 1))
    return moved.reshape(a.shape[0], a.shape[axis], -1), False


def row_l2_sum(a: np.ndarray, finite_only: bool) -> float:
    """Sum over rows (axis 0) of each row's L2 norm, accumulated in float64; with `finite_only`
    NaN and Inf count as zero, as in the compiled pass."""
    r = a.reshape(len(a), -1)
    if finite_only:
        r = np.where(np.isfinite(r), r, 0)
    return float(np.sqrt(np.einsum("ij,ij->i", r, r, dtype=np.float64)).sum())
