"""What a gradient run differentiates: per-sample losses, summed over the batch.

Summing (not averaging) makes a stored per-sample gradient independent of the batch size. An
objective sees the model's output, the targets and the batch's inputs and token layout (a
language model's loss is over its own input ids, at its real tokens).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import torch
from torch.nn import functional as F

from probe.config import import_target
from probe.errors import ConfigError, DataError
from probe.hooks.forward import first_output
from probe.layout import TokenBatch
from probe.plan import ObjectiveSpec

NEEDS_TARGETS = {"cross_entropy"}
IGNORED = -100  # cross_entropy's ignore_index: a sample with this label adds no loss
PREDICTED = "predicted"  # where objective.index=predicted keeps each sample's argmax in `side`

# (output, targets, inputs, token layout, side: a pairs batch's answer and wrong ids) -> one
# value per sample
Objective = Callable[..., torch.Tensor]


def build_objective(
    cfg: ObjectiveSpec, has_targets: bool, answers: frozenset = frozenset()
) -> Objective:
    """The objective of a run plan's `cfg`: a function (model output, targets, inputs, tokens,
    side) -> one value per sample; what the data cannot give is an error before any work.
    `answers`: which of answer and wrong ids the data gives."""
    name = cfg.name
    index = cfg.index
    if (name in NEEDS_TARGETS or index == "target") and not has_targets:
        what = f"objective={name}" + (" objective.index=target" if index == "target" else "")
        raise DataError(
            f"{what} needs targets, but this dataset has none; use objective.index=predicted or "
            "a class number K, objective=output_sum, or a dataset with targets"
        )
    if name == "logit_diff" and not {"answer", "wrong"} <= answers:
        raise DataError(
            "objective=logit_diff reads each sample's answer and wrong tokens, which this dataset "
            "does not give; use dataset=pairs with answer and wrong, or objective=logit "
            "objective.index=K"
        )
    if name == "cross_entropy":
        return lambda out, y, inputs, tokens, side=None: _cross_entropy(out, y)
    if name == "output_sum":
        return lambda out, y, inputs, tokens, side=None: out.reshape(len(out), -1).sum(dim=1)
    if name == "lm_loss":
        return _lm_loss
    if name in ("logit", "logprob"):
        return _logit(index, cfg.position, name == "logprob")
    if name == "logit_diff":
        return _logit_diff(cfg.position)
    return _custom(cfg._target_)


def _custom(target: str | None) -> Objective:
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

    def custom(out, y, inputs, tokens, side=None):
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


def _logit(k, position: int | None, log_softmax: bool = False) -> Objective:
    """Logit (or log-probability) `k` per sample: a class number, each sample's label (target)
    or the model's own argmax (predicted); of a token model's (N, T, V) output at `position`, by
    default each sample's last real token."""

    def logit(out, y, inputs, tokens, side=None):
        scores = at_position(out, tokens, position, "objective.position")
        if log_softmax:
            scores = scores.float().log_softmax(-1)
        width = scores.shape[-1]  # the output width of hf and custom models is known only now
        if k == "predicted":  # the input's own argmax, kept for passes on other values
            if side is None or PREDICTED not in side:
                index = scores.detach().argmax(-1)
                if side is not None:
                    side[PREDICTED] = index
            index = side[PREDICTED] if side is not None else index
        elif k == "target":
            index = _labels(y, len(scores), width)
        else:
            if not -width <= k < width:
                raise ConfigError(
                    f"objective.index={k} is out of range for a model output of {width} logits; "
                    f"give 0 <= index < {width}"
                )
            return scores[:, k]
        return scores.gather(1, index.to(scores.device).view(-1, 1)).squeeze(1)

    return logit


def _labels(y, n: int, width: int) -> torch.Tensor:
    """Each sample's class label, checked against the output's width."""
    if y is None or y.ndim != 1 or len(y) != n or y.is_floating_point():
        shape = None if y is None else tuple(y.shape)
        raise DataError(
            f"objective.index=target reads one integer label per sample, but the batch's targets "
            f"are {shape}; use objective.index=predicted or a class number K"
        )
    bad = y[(y < 0) | (y >= width)]
    if len(bad):
        raise DataError(
            f"objective.index=target: label {int(bad[0])} is out of range for a model output of "
            f"{width} logits; give labels in [0, {width})"
        )
    return y.long()


def at_position(out: torch.Tensor, tokens: TokenBatch | None, position, key: str):
    """(N, V) scores of an (N, T, V) output at `position` (negative: from each sample's last real
    token; None: the last real token); 2-D outputs as they are."""
    if out.ndim < 3:
        return out
    n, t = out.shape[:2]
    last = tokens.last.to(out.device) if tokens is not None else torch.full((n,), t - 1)
    if position is None:
        index = last.to(out.device)
    elif position < 0:
        index = last.to(out.device) + 1 + position
    else:
        index = torch.full((n,), position, device=out.device)
    if not -t <= (position or 0) < t:
        raise ConfigError(
            f"{key}={position} is out of range for {t} tokens; give -{t} <= position < {t}, or "
            "leave it unset for the last real token"
        )
    return out[torch.arange(n, device=out.device), index.clamp(0, t - 1)]


def picked(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """scores[i, ids[i, k]] with -1 ids (padding) as NaN: (N, K)."""
    ids = ids.to(scores.device).reshape(len(scores), -1)
    return scores.gather(1, ids.clamp(min=0)).masked_fill(ids < 0, math.nan)


def logit_difference(scores: torch.Tensor, side: dict) -> torch.Tensor:
    """The mean logit of the answer tokens minus the mean of the wrong ones, per sample."""
    return picked(scores, side["answer"]).nanmean(1) - picked(scores, side["wrong"]).nanmean(1)


def _logit_diff(position: int | None) -> Objective:
    """Answer minus wrong logit (intervene.metrics' logit_diff) at `position`."""

    def diff(out, y, inputs, tokens, side=None):
        scores = at_position(out, tokens, position, "objective.position")
        return logit_difference(scores, side)

    return diff


def _lm_loss(out, y, inputs, tokens, side=None) -> torch.Tensor:
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


def per_sample(objective: Objective, output, targets, inputs=None, tokens=None, side=None):
    """The objective's value of each sample (checked to be one per sample)."""
    out = first_output(output)
    if targets is not None:  # (a model split over devices answers on its last one)
        targets = targets.to(out.device, non_blocking=True)
    losses = objective(out, targets, inputs, tokens, side)
    if losses.ndim == 0 or losses.shape[0] != out.shape[0]:
        raise ConfigError(
            f"the objective returned shape {tuple(losses.shape)}; it must return one loss per sample "
            f"({out.shape[0]})"
        )
    return losses
