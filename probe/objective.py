"""What a gradient run differentiates: per-sample losses, summed over the batch.

Summing (not averaging) makes a stored per-sample gradient independent of the batch size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional as F

from probe.config import import_target
from probe.errors import ConfigError, DataError
from probe.hooks import flatten

OBJECTIVES = ("cross_entropy", "logit", "output_sum", "custom")
NEEDS_TARGETS = {"cross_entropy"}

Objective = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


def build_objective(cfg, has_targets: bool, num_outputs: int | None) -> Objective:
    """A function (model output, targets) -> per-sample losses; errors before any work is done."""
    name = cfg.name
    if name not in OBJECTIVES:
        raise ConfigError(f"unknown objective {name!r}; choose one of {', '.join(OBJECTIVES)}")
    if name in NEEDS_TARGETS and not has_targets:
        raise DataError(
            f"objective={name} needs targets, but this dataset has none; use objective=output_sum, "
            "objective=logit objective.index=K, or a dataset with targets"
        )
    if name == "cross_entropy":
        return lambda out, y: F.cross_entropy(out, y, reduction="none")
    if name == "output_sum":
        return lambda out, y: out.reshape(len(out), -1).sum(dim=1)
    if name == "logit":
        k = cfg.index
        if k is None or (num_outputs is not None and not -num_outputs <= k < num_outputs):
            raise ConfigError(
                f"objective.index={k} is out of range for a model output of {num_outputs} logits; "
                f"give 0 <= index < {num_outputs}"
            )
        return lambda out, y: out[:, k]
    target = cfg.get("_target_")
    fn = import_target("objective._target_", target, example="my_losses.per_sample_loss")
    if not callable(fn):
        raise ConfigError(f"objective._target_={target!r} is not callable")
    return fn


def batch_loss(objective: Objective, output, targets) -> torch.Tensor:
    """The scalar that is differentiated: the objective's per-sample losses summed over the batch."""
    out = (
        output if isinstance(output, torch.Tensor) else next((t for _, t in flatten(output)), None)
    )
    if out is None:
        raise ConfigError("the model output holds no tensor to differentiate; use objective=custom")
    losses = objective(out, targets)
    if losses.ndim == 0 or losses.shape[0] != out.shape[0]:
        raise ConfigError(
            f"the objective returned shape {tuple(losses.shape)}; it must return one loss per sample "
            f"({out.shape[0]})"
        )
    return losses.sum()
