"""Each batch's examples per unit (`stats.topk`, `stats.bottomk`, `stats.topk_quantiles`), reduced
on the capture's own device in the hooks: the batch's K best rows per unit, exactly (the K-th
value, then the tied rows with the smallest keys), without a host sync. A row's key is
`sample * 2**20 + position`, so ties break by row whatever the order batches come in;
probe.stats.topk merges these into the run's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from probe.errors import ConfigError

if TYPE_CHECKING:
    import torch

POSITION_BITS = 20  # positions per sample: < 2**20 (tokens, a map's pixels)
PER_QUANTILE = 5  # rows kept per quantile group
_MIX = (-7046029254386353131, -4658895280553007687, -7723592293110705685)  # (64-bit odd constants)


@dataclass(frozen=True)
class TopKSpec:
    top: int = 0
    bottom: int = 0
    quantiles: int = 0
    seed: int = 0

    def sizes(self) -> dict[str, int]:
        """Rows kept per unit, by kind (kinds that are off left out)."""
        sizes = {"top": self.top, "bottom": self.bottom, "sample": self.quantiles * PER_QUANTILE}
        return {k: n for k, n in sizes.items() if n > 0}


@dataclass
class BatchExamples:
    """One capture's examples of one batch, by kind: (values, keys), each (units, n), on the
    capture's device until a record copies them to the host
    (probe.hooks.step_context.Partial)."""

    kinds: dict[str, tuple]

    def tensors(self) -> dict:
        return {f"{kind}.{i}": t for kind, pair in self.kinds.items() for i, t in enumerate(pair)}

    def on_host(self, tensors: dict) -> BatchExamples:
        return BatchExamples({k: (tensors[f"{k}.0"], tensors[f"{k}.1"]) for k in self.kinds})

    def arrays(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Each kind's (values, keys) as numpy arrays (host copies)."""
        return {kind: (v.numpy(), k.numpy()) for kind, (v, k) in self.kinds.items()}


def priority(keys, units, seed: int):
    """A 52-bit hash of (key, unit, seed) in [0, 1), the same in torch and numpy (int64 products
    wrap in both; shifts are masked to be logical)."""
    x = keys * _MIX[0] + units * _MIX[1] + seed
    x = x ^ ((x >> 31) & ((1 << 33) - 1))
    x = x * _MIX[2]
    x = x ^ ((x >> 29) & ((1 << 35) - 1))
    x = x & ((1 << 52) - 1)
    return (x.double() if hasattr(x, "double") else x) * (1.0 / (1 << 52))  # (torch: float64)


def row_keys(
    value, axis: int, start: int, tokens, by_token: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(values (units, M) float32, keys (M,) int64 ascending, valid (M,) bool or None) of one
    capture (a torch tensor): its rows and positions in row order; padding is not valid."""
    import torch

    x = value.detach().movedim(axis, -1)
    n, inner = x.shape[0], int(np.prod(x.shape[1:-1], dtype=np.int64))
    valid = None
    if by_token:  # (tokens, ..., units): rows made by probe.layout.token_rows
        _check_positions(tokens.length * inner)
        flat = torch.arange(n, device=x.device) if tokens.flat is None else tokens.flat.to(x.device)
        base = (flat // tokens.length + start) * (1 << POSITION_BITS) + (
            flat % tokens.length
        ) * inner
    else:  # (samples, ..., units)
        base = (torch.arange(n, device=x.device) + start) * (1 << POSITION_BITS)
        padded = tokens is not None and tokens.mask is not None and x.ndim >= 3
        if padded and x.shape[1] == tokens.length:  # (N, T, ...): padded positions left out
            per_token = inner // tokens.length
            valid = tokens.mask.to(x.device).repeat_interleave(per_token, dim=1).reshape(-1)
    return _flat(x, base, inner) + (valid,)


def stored_keys(value, axis: int, base) -> tuple[torch.Tensor, torch.Tensor, None]:
    """`row_keys` of stored rows whose first keys are known (`base`, one a row: from
    /samples/index or /tokens/sample and /tokens/position)."""
    x = value.movedim(axis, -1)
    inner = int(np.prod(x.shape[1:-1], dtype=np.int64))
    return _flat(x, base, inner) + (None,)


def _flat(x, base, inner: int) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    _check_positions(inner)
    keys = (base[:, None] + torch.arange(inner, device=x.device)).reshape(-1)
    return x.reshape(-1, x.shape[-1]).float(), keys


def _check_positions(inner: int) -> None:
    if inner >= 1 << POSITION_BITS:
        raise ConfigError(
            f"stats.topk: a row of {inner} positions is more than the keys of examples hold "
            f"({1 << POSITION_BITS}); reduce the capture (the probe's reduce) or turn the examples off"
        )


def partial(v, keys, valid, spec: TopKSpec) -> dict[str, tuple]:
    """Each kind's (values, keys), (units, n) with n its size, of one batch's `row_keys` (v:
    (rows, units)), on its device; slots beyond the batch's rows hold -inf (top, sample) or
    +inf (bottom) and key -1."""
    import torch

    ok = torch.isfinite(v)
    if valid is not None:
        ok &= valid[:, None]
    short = max(spec.sizes().values()) - v.shape[0]
    if short > 0:  # fewer rows than slots: empty ones, never kept
        v = torch.cat([v, v.new_zeros(short, v.shape[1])])
        ok = torch.cat([ok, ok.new_zeros(short, v.shape[1])])
        keys = torch.cat([keys, keys.new_full((short,), -1)])
    out = {}
    for kind, k in spec.sizes().items():
        if kind == "sample":  # the active rows of the smallest hashes (distinct: no ties kept)
            live = ok & (v > 0)
            units = torch.arange(v.shape[1], device=v.device)[None, :]
            score = torch.where(live, -priority(keys[:, None], units, spec.seed), -torch.inf)
            picked = torch.topk(score, k, dim=0).indices
        else:
            live = ok
            picked = _select(v if kind == "top" else -v, ok, k)
        kept = live.gather(0, picked)
        fill = torch.inf if kind == "bottom" else -torch.inf
        out[kind] = (
            torch.where(kept, v.gather(0, picked), fill).T,
            torch.where(kept, keys[picked], -1).T,
        )
    return out


def _select(score, ok, k: int):
    """Indices (k, units) of each unit's k largest scores among the `ok` rows, ties to the
    smallest row (keys ascend along the rows), exactly and without a host sync: the k-th largest
    score per unit by a float top-k, then every row above it and the first rows equal to it (a
    running count), picked by a top-k of that 0/1 mask. Each unit's rows are made contiguous
    first: a top-k, compare or count along them is several times one across them."""
    import torch

    m = score.shape[0]
    if m == k:
        return torch.arange(m, device=score.device)[:, None].expand(m, score.shape[1])
    s = score.masked_fill(~ok, -torch.inf).T.contiguous()  # (units, rows)
    kth = torch.topk(s, k, dim=1, sorted=False).values.amin(1, keepdim=True)
    above, tied = s > kth, s == kth  # (-0.0 == 0.0; NaN and inf rows are not ok: -inf)
    room = k - above.sum(1, keepdim=True, dtype=torch.int32)
    keep = above | (tied & (tied.cumsum(1, dtype=torch.int32) <= room))
    return torch.topk(keep.to(s.dtype), k, dim=1, sorted=False).indices.T
