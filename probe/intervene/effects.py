"""How much an intervention changed the model's output, accumulated batch by batch.

A token model's output is compared at each sample's last real token (its next-token logits); for
logits of two or more classes `kl_mean` is the mean KL divergence of the edited distribution from
the clean one, KL(clean || edited), in nats."""

from __future__ import annotations

import math
from dataclasses import astuple, dataclass, fields

import numpy as np
import pandas as pd
import torch

BATCH_ROWS = "effects/batches"  # one row per batch: the fields of Effects, summed at the end


@dataclass
class Effects:
    samples: int = 0
    elements: int = 0
    abs_change_sum: float = 0.0
    argmax_changed: int = 0
    kl_sum: float = 0.0
    labelled: int = 0
    correct_clean: int = 0
    correct_edited: int = 0

    def update(
        self, clean: torch.Tensor, edited: torch.Tensor, targets: torch.Tensor | None
    ) -> None:
        clean, edited = clean.detach().double(), edited.detach().double()
        self.samples += len(clean)
        self.elements += clean.numel()
        self.abs_change_sum += (edited - clean).abs().sum().item()
        if clean.ndim == 2:
            a, b = clean.argmax(1), edited.argmax(1)
            self.argmax_changed += int((a != b).sum())
            if clean.shape[1] > 1:
                p, q = clean.log_softmax(1), edited.log_softmax(1)
                self.kl_sum += float((p.exp() * (p - q)).sum())
            if targets is not None and targets.ndim == 1 and not targets.is_floating_point():
                t = targets.to(a.device)
                self.labelled += len(t)
                self.correct_clean += int((a == t).sum())
                self.correct_edited += int((b == t).sum())

    def vector(self) -> np.ndarray:
        """The accumulators as one float64 row (exact for counts below 2**53)."""
        return np.array(astuple(self), dtype=np.float64)

    @classmethod
    def from_rows(cls, rows: np.ndarray) -> Effects:
        """The sum of per-batch `vector` rows: the effects over every batch a file holds."""
        total = np.asarray(rows, dtype=np.float64).reshape(-1, len(fields(cls))).sum(0)
        kinds = [f.type for f in fields(cls)]
        values = [
            float(v) if k in (float, "float") else int(v) for v, k in zip(total, kinds, strict=True)
        ]
        # each field gets its own type by `kinds`: mypy sees float | int for every one
        return cls(*values)  # type: ignore[arg-type]

    def table(self) -> pd.DataFrame:
        nan = math.nan
        return pd.DataFrame(
            [
                {
                    "samples": self.samples,
                    "mean_abs_change": self.abs_change_sum / self.elements
                    if self.elements
                    else nan,
                    "frac_argmax_changed": self.argmax_changed / self.samples
                    if self.samples
                    else nan,
                    "kl_mean": self.kl_sum / self.samples if self.samples else nan,
                    "accuracy_clean": self.correct_clean / self.labelled if self.labelled else nan,
                    "accuracy_edited": self.correct_edited / self.labelled
                    if self.labelled
                    else nan,
                }
            ]
        )
