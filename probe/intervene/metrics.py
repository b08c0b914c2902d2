"""How an edit moves a model's answer, per sample, read at one token position: the answer tokens'
logits and probabilities, and the distance of the whole next-token distribution.

Each metric has a value on the run's own input unedited (the target), on the source input (where
there is one) and edited; `normalized = (edited - target) / (source - target)` of the means over
samples says how much of the way from target to source the edit moved the answer (1: all of it).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import torch

from probe.errors import ConfigError
from probe.hooks.objective import logit_difference, picked
from probe.layout import TokenBatch
from probe.shared_checks import check_answers

COLUMNS = ["metric", "n", "target", "source", "edited", "normalized"]


def check_metrics(names, has: set[str], model=None) -> list[str]:
    """The asked metrics (a run plan's), each with the answer tokens it reads in the data, and
    (given the `model`) the logits they read."""
    names = list(names)
    for name in names:
        check_answers(f"intervene.metrics: {name}", name, has)
    if names and model is not None:
        check_logits(model, f"intervene.metrics={names}")
    return names


def check_logits(model, label: str) -> None:
    """Every metric reads the model's vocabulary logits: refuse a transformers model loaded
    without its language-model head (model.task=base), whose output is its hidden states.
    `label` names what asked for the metric (circuit.metric=logit_diff, intervene.metrics=...)."""
    heads = getattr(model, "get_output_embeddings", None)
    if getattr(model, "base_model", None) is model and callable(heads) and heads() is None:
        raise ConfigError(
            f"{label} reads the model's vocabulary logits, but this {type(model).__name__} has "
            "no language-model head: model.task=base (the default of model=hf) loads the bare "
            "model, whose output is its hidden states; load it with its head: "
            "model.task=causal_lm"
        )


def position_index(last: torch.Tensor, t: int, position: int | None, key: str) -> torch.Tensor:
    """(N,) each sample's position: `position` (negative: from its last real token `last`; None:
    that token) among `t` tokens; a ConfigError naming `key` where it falls outside."""
    if position is None:
        index = last
    elif position < 0:
        index = last + 1 + position
    else:
        index = torch.full_like(last, position)
    if bool(((index < 0) | (index >= t)).any()):
        raise ConfigError(
            f"{key}={position} is outside the {t} tokens of a sample; give a position in "
            f"[-{t}, {t}) or leave it unset for the last real token"
        )
    return index


def at_position(
    logits: torch.Tensor,
    tokens: TokenBatch | None,
    position: int | None,
    key: str = "intervene.position",
):
    """(N, V) float64 logits at `position` (negative: from each sample's last real token; None:
    the last real token) of (N, T, V) logits; (N, V) logits as they are. `key` names the
    position in an error."""
    if logits.ndim == 2:
        return logits.double()
    n, t = logits.shape[:2]
    last = tokens.last.to(logits.device) if tokens is not None else torch.full((n,), t - 1)
    index = position_index(last, t, position, key)
    return logits[torch.arange(n, device=logits.device), index.to(logits.device)].double()


def value(name: str, logits, reference, side: dict) -> torch.Tensor:
    """Metric `name` per sample of (N, V) logits; `reference` the target's, for kl and
    output_change. answer_prob is the total probability of the answer tokens, answer_logprob
    its log, logit_diff the mean answer logit minus the mean wrong logit."""
    if name == "logit_diff":
        return logit_difference(logits, side)
    if name in ("answer_logprob", "answer_prob"):
        logp = picked(logits.log_softmax(1), side["answer"]).nan_to_num(nan=-math.inf)
        total = logp.logsumexp(1)
        return total if name == "answer_logprob" else total.exp()
    if name == "kl":
        p, q = reference.log_softmax(1), logits.log_softmax(1)
        return (p.exp() * (p - q)).sum(1)
    return (logits - reference).abs().mean(1)


def per_sample(names, target, source, edited, side: dict) -> dict[str, torch.Tensor]:
    """{metric: (N, 3) float64 [target, source, edited]} (NaN source without one), on the CPU."""
    out = {}
    for name in names:
        cols = [value(name, target, target, side)]
        cols.append(value(name, source, target, side) if source is not None else cols[0] * math.nan)
        cols.append(value(name, edited, target, side))
        out[name] = torch.stack(cols, 1).cpu()
    return out


def summary(rows: dict[str, np.ndarray]) -> pd.DataFrame:
    """effects.csv of the metrics: per metric the means over samples and `normalized`."""
    table = []
    for name, a in rows.items():
        target, source, edited = (float(np.mean(a[:, j])) for j in range(3))
        span = source - target
        table.append(
            {
                "metric": name,
                "n": len(a),
                "target": target,
                "source": source,
                "edited": edited,
                "normalized": (edited - target) / span if span else math.nan,
            }
        )
    return pd.DataFrame(table, columns=COLUMNS)
