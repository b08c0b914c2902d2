"""What a gradient run differentiates: per-sample losses, summed over the batch.

Summing (not averaging) makes a stored per-sample gradient independent of the batch size. An
objective sees the model's output, the targets and the batch's inputs and token layout (a
language model's loss is over its own input ids, at its real tokens).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch.nn import functional as F

from probe.build.layout import TokenBatch
from probe.checks import check_objective
from probe.config import import_target
from probe.errors import ConfigError, DataError
from probe.hooks.forward import first_output

NEEDS_TARGETS = {"cross_entropy"}
IGNORED = -100  # cross_entropy's ignore_index: a sample with this label adds no loss

# (output, targets, inputs, token layout) -> one loss per sample
Objective = Callable[[torch.Tensor, torch.Tensor | None, object, TokenBatch | None], torch.Tensor]


def build_objective(cfg, has_targets: bool, num_outputs: int | None) -> Objective:
    """A function (model output, targets) -> per-sample losses; errors before any work is done."""
    check_objective(cfg, num_outputs)
    name = cfg.name
    if name in NEEDS_TARGETS and not has_targets:
        raise DataError(
            f"objective={name} needs targets, but this dataset has none; use objective=output_sum, "
            "objective=logit objective.index=K, or a dataset with targets"
        )
    if name == "cross_entropy":
        return lambda out, y, inputs, tokens: _cross_entropy(out, y)
    if name == "output_sum":
        return lambda out, y, inputs, tokens: out.reshape(len(out), -1).sum(dim=1)
    if name == "lm_loss":
        return _lm_loss
    if name == "logit":
        return _logit(cfg.index, cfg.get("position"))
    return _custom(cfg.get("_target_"))


def _custom(target: str) -> Objective:
    """The callable `target` names, checked before the run where its signature can be read, and
    its result on each batch; a function that fails is named with what it must be."""
    fn = import_target("objective._target_", target)
    name = f"objective._target_={target!r}"
    must = "it must be a callable (outputs, targets) -> a tensor of one loss per sample, shape (N,)"
    if not callable(fn):
        raise ConfigError(f"{name} is not callable; {must}")
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:  # it cannot take two arguments
        raise ConfigError(
            f"{name} takes {inspect.signature(fn)}, not (outputs, targets); {must}"
        ) from None
    except ValueError:  # no signature to read (a builtin): its first call tells
        pass

    def custom(out, y, inputs, tokens):
        try:
            losses = fn(out, y)
        except Exception as e:  # the user's code: named, with its traceback under HYDRA_FULL_ERROR
            raise ConfigError(
                f"{name} raised {type(e).__name__} ({_first_line(e)}) when called with (outputs, "
                f"targets); {must}"
            ) from e
        if not isinstance(losses, torch.Tensor) or losses.ndim == 0 or len(losses) != len(out):
            got = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
            raise ConfigError(
                f"{name} returned {got}, not one loss per sample ({len(out)},); {must} (a "
                "torch.nn.functional loss needs reduction='none')"
            )
        return losses

    return custom


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else ""


def _logit(k: int, position: int | None) -> Objective:
    """Logit k; of a token model's (N, T, V) output at `position`, by default each sample's last
    real token."""

    def logit(out, y, inputs, tokens):
        width = out.shape[-1]  # the output width of hf and custom models is known only now
        if not -width <= k < width:
            raise ConfigError(
                f"objective.index={k} is out of range for a model output of {width} logits; "
                f"give 0 <= index < {width}"
            )
        if out.ndim < 3:
            return out[:, k]
        if position is not None:
            if not -out.shape[1] <= position < out.shape[1]:
                raise ConfigError(
                    f"objective.position={position} is out of range for {out.shape[1]} tokens; "
                    f"give -{out.shape[1]} <= position < {out.shape[1]}, or leave it unset for "
                    "the last real token"
                )
            return out[:, position, k]
        last = tokens.last if tokens is not None else torch.full((len(out),), out.shape[1] - 1)
        return out[torch.arange(len(out), device=out.device), last.to(out.device), k]

    return logit


def _lm_loss(out, y, inputs, tokens) -> torch.Tensor:
    """Next-token cross-entropy of each sample, summed over its real positions: token t's logits
    predict token t+1 (the dataset's labels where it has (N, T) ones, else the input ids)."""
    if out.ndim != 3 or not isinstance(inputs, dict):
        raise ConfigError(
            "objective=lm_loss needs a language model's (N, T, vocabulary) logits over token "
            f"inputs, but the output has shape {tuple(out.shape)}; use model.task=causal_lm and "
            "dataset=tokens, text or random_tokens"
        )
    labels = y if y is not None and y.ndim == 2 else inputs["input_ids"]
    labels = labels.to(out.device)
    if int(labels.max()) >= out.shape[-1]:
        raise ConfigError(
            f"objective=lm_loss needs vocabulary logits, but the output's last axis has "
            f"{out.shape[-1]} entries and the token ids reach {int(labels.max())}; use "
            "model.task=causal_lm (a base model returns hidden states)"
        )
    if tokens is not None and tokens.mask is not None:
        labels = labels.masked_fill(~tokens.mask, IGNORED)
    logits, following = out[:, :-1], labels[:, 1:]
    losses = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        following.reshape(-1),
        ignore_index=IGNORED,
        reduction="none",
    )
    return losses.reshape(following.shape).sum(dim=1)


def _cross_entropy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-sample cross-entropy; a label the model has no output for is the data's error (synthetic
    and fakedata draw labels below model.num_classes, 1000 unless set), not an IndexError."""
    if out.ndim >= 2 and y.is_floating_point() and y.shape == out.shape:  # class probabilities
        return F.cross_entropy(out, y, reduction="none")
    by_token = out.ndim == 3 and y.ndim == 2  # a label per token (token classification)
    integers = not (y.is_floating_point() or y.is_complex() or y.dtype == torch.bool)
    if out.ndim < 2 or not integers or y.ndim != (2 if by_token else 1):
        raise DataError(
            f"objective=cross_entropy takes integer class labels of shape (N,), or class "
            f"probabilities of the output's shape {tuple(out.shape)}, but the batch's targets are "
            f"{str(y.dtype).removeprefix('torch.')} of shape {tuple(y.shape)}; save the targets "
            "as labels (targets.long()), or use an objective without targets: "
            "objective=output_sum, or objective=logit objective.index=K"
        )
    y = y.long()
    classes = out.shape[-1] if by_token else out.shape[1]
    bad = y[((y < 0) & (y != IGNORED)) | (y >= classes)]
    if len(bad):
        raise DataError(
            f"target {int(bad[0])} is out of range for a model output of {classes} classes; set "
            f"model.num_classes={classes} (synthetic and fakedata labels are drawn below it, or "
            f"below dataset.num_classes when set) or give targets in [0, {classes})"
        )
    if by_token:  # summed over each sample's labelled tokens
        losses = F.cross_entropy(out.transpose(1, 2), y, ignore_index=IGNORED, reduction="none")
        return losses.sum(dim=1)
    return F.cross_entropy(out, y, reduction="none")


def batch_loss(
    objective: Objective, output, targets, inputs=None, tokens: TokenBatch | None = None
) -> torch.Tensor:
    """The scalar that is differentiated: the objective's per-sample losses summed over the batch."""
    out = first_output(output)
    if targets is not None:  # (a model split over devices answers on its last one)
        targets = targets.to(out.device, non_blocking=True)
    losses = objective(out, targets, inputs, tokens)
    if losses.ndim == 0 or losses.shape[0] != out.shape[0]:
        raise ConfigError(
            f"the objective returned shape {tuple(losses.shape)}; it must return one loss per sample "
            f"({out.shape[0]})"
        )
    return losses.sum()
