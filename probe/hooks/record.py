"""What one batch hands the run's sink: its captures, per-sample and per-batch, and the run
parts' named outputs (probe.hooks.step_context.Outputs: rows, arrays written once, partials to
fold)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from probe.hooks.step_context import Outputs


@dataclass
class Record:
    """One batch: per-sample tensors (axis 0 = samples) and per-batch tensors (one row per batch)."""

    start: int
    size: int
    batch_index: int
    values: dict[tuple[str, str], torch.Tensor]
    per_batch: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)
    targets: torch.Tensor | None = None
    outputs: Outputs = field(default_factory=Outputs)  # the parts' rows and partials, by name
    ready: Any = None  # a CUDA event to wait on before reading host copies of GPU tensors
    # gives the values' buffers back for reuse once written; they may not be read after
    release: Callable[[], None] | None = None
    axes: dict[tuple[str, str], int] = field(default_factory=dict)  # unit axis by dataset
    # a token batch's /tokens/{sample,position,id} rows (the rows of the `token_keys` datasets)
    tokens: dict[str, np.ndarray] | None = None
    token_keys: set[tuple[str, str]] = field(default_factory=set)  # values of one row per token
    unstored: set[tuple[str, str]] = field(default_factory=set)  # statistics only, no dataset
    plain: dict[tuple[str, str], dict] = field(default_factory=dict)  # no statistics: attrs

    @property
    def token_count(self) -> int:
        return 0 if self.tokens is None else len(self.tokens["tokens/sample"])
