"""Where a capture's units and tokens lie, and the reductions and token rows that use them.

Axis 1 holds the channels of convolution-like layouts (N, C, ...) but the token of transformer
layouts (N, T, C), whose units are on the last axis. A probe's `unit_axis: auto` tells them apart
by the module's class, else by the layout: 4-D and larger are images (N, C, H, W), 3-D and
smaller are token layouts. The token axis is always axis 1; `TokenBatch` carries each batch's
attention mask, so token reductions and token rows never see padding.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch

from probe.errors import ConfigError, ModelError

# Classes whose outputs have their units on axis 1 whatever their rank (conv, norm and pooling
# layers of torch.nn); HF's Conv1D is a linear layer over (N, T, C), so not matched.
CONV_LIKE = re.compile(
    r"(Lazy)?Conv(Transpose)?[123]d|(Lazy|Sync)?BatchNorm([123]d)?|(Lazy)?InstanceNorm[123]d"
    r"|GroupNorm|LocalResponseNorm|(Adaptive)?(Max|Avg)Pool[123]d|LPPool[123]d"
    r"|FractionalMaxPool[23]d|Dropout[123]d|Conv[23]dNormActivation"
)
# Classes whose units are the last axis whatever their rank.
LAST_AXIS = re.compile(r"Linear|Conv1D|LayerNorm|RMSNorm|.*RMSNorm|Embedding|.*Attention")


def class_axis(classes: tuple[str, ...]) -> str | None:
    """'first' (axis 1) or 'last' when a module's class names (its MRO) decide, else None."""
    for name in classes:
        if CONV_LIKE.fullmatch(name):
            return "first"
        if LAST_AXIS.fullmatch(name):
            return "last"
    return None


def unit_axis(setting, by_class: str | None, ndim: int, where: str) -> int:
    """The unit axis of an `ndim`-D capture (0 for a 1-D one: no units) from the probe's
    `unit_axis` (auto or an int) and the module's `class_axis`; `where` names it in errors."""
    if ndim < 2:
        return 0
    if setting != "auto":
        axis = int(setting)
        if not -ndim < axis < ndim or axis % ndim == 0:
            raise ConfigError(
                f"{where}: unit_axis={setting} does not fit its {ndim}-D layout; give an axis in "
                f"1..{ndim - 1} (or -1 for the last; axis 0 is the sample), or unit_axis: auto"
            )
        return axis % ndim
    if by_class == "first" or (by_class is None and ndim >= 4):
        return 1
    return ndim - 1


@dataclass
class TokenBatch:
    """A token batch's layout on the model's device: which positions are real tokens."""

    length: int  # T
    mask: torch.Tensor | None  # (N, T) bool; None when every position is a token
    first: torch.Tensor  # (N,) first real position of each sample
    last: torch.Tensor  # (N,) last real position of each sample
    flat: torch.Tensor | None  # indices of the real tokens in the (N*T) rows; None: all

    @classmethod
    def of(cls, ids: torch.Tensor, attention_mask: torch.Tensor | None) -> TokenBatch:
        n, t = ids.shape[:2]
        if attention_mask is None or bool(attention_mask.all()):
            full = torch.full((n,), t - 1, dtype=torch.long, device=ids.device)
            return cls(t, None, torch.zeros_like(full), full, None)
        mask = attention_mask.bool()
        positions = torch.arange(t, device=ids.device)
        first = torch.where(mask, positions, t).amin(1).clamp(max=t - 1)
        last = torch.where(mask, positions, -1).amax(1).clamp(min=0)
        flat = mask.reshape(-1).nonzero().squeeze(1)
        return cls(t, mask, first, last, flat)

    def to(self, device) -> TokenBatch:
        if self.first.device == torch.device(device):
            return self
        mask = None if self.mask is None else self.mask.to(device)
        flat = None if self.flat is None else self.flat.to(device)
        return TokenBatch(self.length, mask, self.first.to(device), self.last.to(device), flat)

    def rows(self, ids: torch.Tensor, start: int, labels=None) -> dict[str, np.ndarray]:
        """/tokens/sample (`start` + row in the batch), /tokens/position and /tokens/id of each
        real token, in the order of the token rows, and /tokens/label with `labels` (N, T); from
        the host tensors."""
        n, t = ids.shape[:2]
        flat = torch.arange(n * t) if self.flat is None else self.flat.cpu()
        out = {
            "tokens/sample": (flat // t + start).numpy(),
            "tokens/position": (flat % t).to(torch.int32).numpy(),
            "tokens/id": ids.reshape(-1)[flat].to(torch.int64).numpy(),
        }
        if labels is not None:
            out["tokens/label"] = labels.reshape(-1)[flat].to(torch.int64).numpy()
        return out


def token_axis_checked(
    x: torch.Tensor, tokens: TokenBatch | None, where: str, what: str
) -> TokenBatch:
    """`tokens`, where x has their token axis at axis 1; else a ConfigError or ModelError."""
    if tokens is None:
        raise ConfigError(
            f"{where}: {what} needs token inputs (input_ids); use dataset=tokens, text or "
            "random_tokens, or reduce: none / spatial_mean and rows: samples"
        )
    if x.ndim < 2 or x.shape[1] != tokens.length:
        raise ModelError(
            f"{where}: {what} needs the token axis at axis 1, but the shape is {tuple(x.shape)} "
            f"for {tokens.length} tokens; exclude this layer from the probe"
        )
    return tokens


def reduced(
    x: torch.Tensor, how: str, axis: int, tokens: TokenBatch | None, where: str
) -> tuple[torch.Tensor, int]:
    """x (N, ...) after the probe's reduction, and where its unit axis is afterwards. Reductions
    apply to layouts of 3 axes or more (others are kept as they are)."""
    if how == "none" or x.ndim < 3:
        return x, axis
    if how == "spatial_mean":
        dims = tuple(d for d in range(1, x.ndim) if d != axis)
        return x.float().mean(dim=dims), 1
    tokens = token_axis_checked(x, tokens, where, f"reduce: {how}")
    after = axis - 1 if axis > 1 else 1
    if how == "first_token":
        return x[torch.arange(len(x), device=x.device), tokens.first], after
    if how == "last_token":
        return x[torch.arange(len(x), device=x.device), tokens.last], after
    if tokens.mask is None:
        return x.float().mean(dim=1), after
    weights = tokens.mask.to(torch.float32).reshape(*tokens.mask.shape, *(1,) * (x.ndim - 2))
    counts = weights.sum(dim=1).clamp(min=1)
    return (x.float() * weights).sum(dim=1) / counts, after


def token_rows(
    x: torch.Tensor, axis: int, tokens: TokenBatch | None, where: str
) -> tuple[torch.Tensor, int]:
    """x (N, T, ...) as one row per real token (K, ...), in sample then position order."""
    tokens = token_axis_checked(x, tokens, where, "rows: tokens")
    if axis == 1:
        raise ConfigError(
            f"{where}: rows: tokens with unit_axis 1 would make the token its own unit; use "
            "unit_axis: auto or an axis after the token axis"
        )
    flat = x.reshape(-1, *x.shape[2:])
    if tokens.flat is not None:
        flat = flat.index_select(0, tokens.flat)
    return flat, axis - 1
