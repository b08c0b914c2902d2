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
IGNORED = -100  # cross_entropy's ignore_index: a sample with this label adds no loss

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
        return _cross_entropy
    if name == "output_sum":
        return lambda out, y: out.reshape(len(out), -1).sum(dim=1)
    if name == "logit":
        k = cfg.index
        if k is None:
            raise ConfigError(
                "objective=logit needs the logit to differentiate: add objective.index=K "
                "(0 for the first output)"
            )
        if num_outputs is not None and not -num_outputs <= k < num_outputs:
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


def _cross_entropy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-sample cross-entropy; a label the model has no output for is the data's error (synthetic
    and fakedata draw labels below model.num_classes, 1000 unless set), not an IndexError."""
    if y.is_floating_point() or out.ndim < 2:  # class probabilities; torch names other misuse
        return F.cross_entropy(out, y, reduction="none")
    classes = out.shape[1]
    bad = y[((y < 0) & (y != IGNORED)) | (y >= classes)]
    if len(bad):
        raise DataError(
            f"target {int(bad[0])} is out of range for a model output of {classes} classes; set "
            f"model.num_classes={classes} (synthetic and fakedata labels are drawn below it, or "
            f"below dataset.num_classes when set) or give targets in [0, {classes})"
        )
    return F.cross_entropy(out, y, reduction="none")


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
