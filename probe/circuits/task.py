"""What a circuit is measured on: clean/corrupt pairs, an answer metric read at one position,
and the ablation that stands in for a removed edge.

A batch is a dict as `dataset=pairs` gives it (probe.data.pairs): `input_ids` (the clean half),
`corrupt_ids`, `attention_mask` (shared), and `answer`/`wrong` token ids (-1 pads). The metric is
one of probe.intervene.metrics' (logit_diff, answer_logprob, answer_prob, kl, output_change) at
`position` (None: each sample's last real token), against the clean run's logits where it needs a
reference (kl, output_change). Ablations: `counterfactual` (a sender's value on the pair's
corrupt half), `mean` (its mean over a dataset: `means`, from probe.circuits.states.mean_states or
given as tensors) and `zero`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from probe.circuits.states import SenderStates
from probe.config import CIRCUIT_ABLATIONS, METRICS
from probe.errors import ConfigError
from probe.hooks.forward import first_output, to_device
from probe.intervene.metrics import at_position, position_index, value
from probe.layout import TokenBatch
from probe.shared_checks import check_answers, choice

ABLATIONS = CIRCUIT_ABLATIONS
KEEP = "logits_to_keep"  # transformers' causal LMs: the positions to compute logits at


@dataclass(frozen=True)
class AnswerMetric:
    """An answer metric per sample: `name` (one of probe.intervene.metrics.METRICS) at
    `position` (None: the last real token; negative: counted back from it)."""

    name: str = "logit_diff"
    position: int | None = None

    def __post_init__(self):
        choice("circuit.metric", self.name, METRICS)

    def index(self, tokens: TokenBatch) -> torch.Tensor:
        """(N,) each sample's position the metric reads."""
        return position_index(tokens.last.cpu(), tokens.length, self.position, "circuit.position")

    def logits(self, output, tokens: TokenBatch, kept: torch.Tensor | None = None) -> torch.Tensor:
        """(N, V) float64 logits at the metric's position; `kept`: the positions a model gave
        logits for (transformers' logits_to_keep), in order."""
        out = first_output(output)
        if kept is None or out.ndim != 3 or out.shape[1] != len(kept):
            return at_position(out, tokens, self.position, "circuit.position")
        index = self.index(tokens)
        column = torch.searchsorted(kept.cpu(), index).to(out.device)
        return out[torch.arange(len(out), device=out.device), column].double()

    def __call__(self, logits: torch.Tensor, reference: torch.Tensor, side: dict) -> torch.Tensor:
        """(N,) the metric of (N, V) logits at the position; `reference` the clean run's."""
        return value(self.name, logits, reference, side)


@dataclass(frozen=True)
class Ablation:
    """What an ablated edge carries instead of its sender's value: the sender's value on the
    corrupt half (`counterfactual`), its `mean` (`means` required) or `zero`."""

    kind: str = "counterfactual"
    means: SenderStates | None = None

    def __post_init__(self):
        choice("circuit.ablation", self.kind, ABLATIONS)
        if self.kind == "mean" and self.means is None:
            raise ConfigError(
                "circuit.ablation=mean needs the nodes' means over a dataset: give a dataset (or an "
                "earlier run) to average over, or use circuit.ablation=counterfactual or zero"
            )


@dataclass
class PairBatch:
    """One batch of pairs on the model's device: the clean and corrupt token inputs, their
    layout and the answer tokens."""

    clean: dict
    corrupt: dict
    tokens: TokenBatch
    side: dict
    kept: torch.Tensor | None = None  # the positions the model is asked logits for

    def logits(self, metric: AnswerMetric, output) -> torch.Tensor:
        """(N, V) float64 logits at the metric's position of a run's output."""
        return metric.logits(output, self.tokens, self.kept)

    @property
    def size(self) -> int:
        return len(self.clean["input_ids"])

    def repeated(self, times: int) -> tuple[dict, TokenBatch, dict]:
        """The clean inputs, layout and answers repeated `times` (variant-major rows)."""
        clean = {
            k: v if k == KEEP else v.repeat(times, *([1] * (v.ndim - 1)))
            for k, v in self.clean.items()
        }
        side = {k: v.repeat(times, *([1] * (v.ndim - 1))) for k, v in self.side.items()}
        return clean, TokenBatch.of(clean["input_ids"], clean.get("attention_mask")), side


def pair_batch(model, batch: dict, metric: AnswerMetric, device=None) -> PairBatch:
    """A dataset=pairs batch on the model's device, checked for what the metric reads."""
    if "corrupt_ids" not in batch:
        raise ConfigError(
            "circuits need clean/corrupt pairs (dataset=pairs): the batch has no corrupt_ids"
        )
    check_answers(
        f"circuit.metric={metric.name}", metric.name, {k for k, v in batch.items() if v is not None}
    )
    device = device or next(model.parameters()).device
    mask = batch.get("attention_mask")
    clean = {"input_ids": batch["input_ids"]}
    if mask is not None:
        clean["attention_mask"] = mask
    clean = to_device(model, clean, device)
    corrupt = {**clean, "input_ids": batch["corrupt_ids"].to(device)}
    if corrupt["input_ids"].shape != clean["input_ids"].shape:
        raise ConfigError(
            f"circuits: clean ids {tuple(clean['input_ids'].shape)} and corrupt ids "
            f"{tuple(corrupt['input_ids'].shape)} differ in shape; pairs need halves of one length"
        )
    side = {
        k: batch[k].to(device).reshape(len(batch["input_ids"]), -1)
        for k in ("answer", "wrong")
        if batch.get(k) is not None
    }
    tokens = TokenBatch.of(clean["input_ids"], clean.get("attention_mask"))
    kept = None
    if KEEP in _parameters(model):  # logits at the metric's positions alone
        kept = metric.index(tokens).unique().to(device)
        clean[KEEP] = corrupt[KEEP] = kept
    return PairBatch(clean, corrupt, tokens, side, kept)


def _parameters(model) -> set[str]:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()
