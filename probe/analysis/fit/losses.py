"""The next-token loss with transcoders spliced in: the measures fit.csv reports beside the row
measures, over every next-token prediction of the held-out samples.

Per spliced layer (and for `all`: every layer given at once), over the predictions of each
sample's token t+1 from its tokens 0..t (a sample of n tokens makes n - 1):

- `ce_clean`: the model's mean next-token cross-entropy;
- `ce_spliced`: the same with the layer's MLP output replaced at every position by its
  transcoder's output (probe.analysis.fit.transcoder_splice; later layers see the spliced residual;
  a cross-layer transcoder's output there is everything its features of that block and earlier
  ones write into it);
- `ce_zero`: the same with that MLP's output zeroed;
- `ce_recovered`: (ce_zero - ce_spliced) / (ce_zero - ce_clean) (1: the transcoder loses
  nothing; 0: no better than no MLP);
- `kl`: the mean over predictions of KL(clean || spliced) of the next-token distributions.

The model is the run's own (its config's model, built as the run built it, in float32). The
samples are rebuilt from the run's token rows (/tokens: each real token's sample, position and
id). Forward passes are batched, without gradients; log-probabilities and sums are float64.
Memory stays bounded on large vocabularies: a batch holds at most `LOGITS_BYTES` of its
predictions' logits (so about 256 tokens on a 256k vocabulary; a longer sample alone), and the
float64 log-probabilities are computed `LOG_PROB_BYTES` of rows at a time.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator

import numpy as np
import pandas as pd
import torch
from torch import nn

from probe.analysis.fit.fit_sites import held_out
from probe.analysis.fit.transcoder_splice import Splice, SplicePoint
from probe.errors import ConfigError, DataError, ProbeError
from probe.models.cross_layer_transcoder import CrossLayerTranscoder
from probe.models.transcoder import Transcoder

log = logging.getLogger("probe.fit")
BATCH_TOKENS = 1024  # tokens a forward pass takes at most
LOGITS_BYTES = 2**28  # a batch's float32 logits (tokens x vocabulary x 4) stay within this
LOG_PROB_BYTES = 2**26  # float64 log-probabilities computed at once (rows x vocabulary x 8)
NO_LOSSES = "--no-losses fits without the loss columns"


def run_model(run) -> nn.Module:
    """The model of `run`'s config, built as the run built it (probe.models.build) but in
    float32; a model without a language-model head is refused by name."""
    from probe.models.build import build_model
    from probe.plan import model_spec

    config = run.config
    try:
        spec = dataclasses.replace(model_spec(config), dtype="float32")
        model = build_model(spec, int(config.get("seed", 0) or 0)).float()
    except ProbeError as e:
        raise type(e)(
            f"the loss measures run the run's own model, which its config does not rebuild "
            f"here: {e} ({NO_LOSSES})"
        ) from None
    heads = getattr(model, "get_output_embeddings", None)
    if callable(heads) and heads() is None:
        raise ConfigError(no_head(model, spec.name))
    return model


def no_head(model: nn.Module, name) -> str:
    return (
        f"model {name!r} ({type(model).__name__}) has no language-model head, so it makes no "
        "next-token logits and the loss measures (ce_*, kl) mean nothing: make the run with "
        f"model.task=causal_lm, or {NO_LOSSES}"
    )


def held_out_samples(run, fraction: float, seed: int, every: bool = False) -> pd.DataFrame:
    """The samples (and their token count) held out by `held_out(.., fraction, seed)` among
    those of the run's token rows (every one of them with `every`): the rows of held_out.csv."""
    try:
        tokens = run.tokens()
    except KeyError:
        raise DataError(f"{run.h5_path} holds no token rows: the loss measures need them") from None
    samples, counts = np.unique(tokens["sample"].to_numpy(), return_counts=True)
    keep = (
        np.ones(len(samples), bool) if every else held_out(samples, run.num_samples, fraction, seed)
    )
    return pd.DataFrame({"sample": samples[keep], "tokens": counts[keep]})


def sample_tokens(run, samples: np.ndarray) -> list[torch.Tensor]:
    """The token ids of each of `samples` (in that order), from the run's token rows; a sample
    whose rows are not positions 0..n-1 (left padding) is refused by name."""
    tokens = run.tokens()
    chosen = tokens[tokens["sample"].isin(samples)]
    order = np.lexsort((chosen["position"].to_numpy(), chosen["sample"].to_numpy()))
    s, pos, ids = (chosen[k].to_numpy()[order] for k in ("sample", "position", "id"))
    cuts = np.flatnonzero(np.diff(s)) + 1
    by_sample = {}
    for part_s, part_pos, part_ids in zip(
        np.split(s, cuts), np.split(pos, cuts), np.split(ids, cuts), strict=True
    ):
        if len(part_s) == 0:
            continue
        if not np.array_equal(part_pos, np.arange(len(part_pos))):
            raise DataError(
                f"sample {int(part_s[0])}'s token rows are at positions {int(part_pos[0])}.."
                f"{int(part_pos[-1])} ({len(part_pos)} rows), not 0..n-1 (left padding?): the "
                f"loss measures rebuild each sample from its token rows; {NO_LOSSES}"
            )
        by_sample[int(part_s[0])] = torch.from_numpy(part_ids.astype(np.int64))
    return [by_sample[int(x)] for x in samples if int(x) in by_sample]


def _batches(sequences: list[torch.Tensor], batch_tokens: int) -> Iterator[list[torch.Tensor]]:
    """`sequences` in order, in batches whose padded size (count x longest) stays within
    `batch_tokens` (a longer sequence alone)."""
    batch: list[torch.Tensor] = []
    width = 0
    for seq in sequences:
        if batch and (len(batch) + 1) * max(width, len(seq)) > batch_tokens:
            yield batch
            batch, width = [], 0
        batch.append(seq)
        width = max(width, len(seq))
    if batch:
        yield batch


def _padded(batch: list[torch.Tensor], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask), right-padded with id 0 (padding is never predicted nor seen by a
    real position of a causal model)."""
    width = max(len(s) for s in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for i, s in enumerate(batch):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
    return ids.to(device), mask.to(device)


def _logits(model: nn.Module, ids, mask, predicted: torch.Tensor) -> torch.Tensor:
    """The logits (predictions, vocabulary) at the predicting positions, in the model's dtype."""
    out = model(input_ids=ids, attention_mask=mask)
    logits = getattr(out, "logits", out if isinstance(out, torch.Tensor) else None)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise ConfigError(
            no_head(model, getattr(getattr(model, "config", None), "_name_or_path", ""))
        )
    return logits[:, :-1][predicted]


def _vocabulary(model: nn.Module) -> int | None:
    """The model's vocabulary (its output embedding's rows, else its config's), if it says."""
    head = getattr(model, "get_output_embeddings", lambda: None)()
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor):
        return weight.shape[0]
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    return vocab if isinstance(vocab, int) else None


def _log_probs(logits: torch.Tensor) -> Iterator[tuple[slice, torch.Tensor]]:
    """(rows, their float64 log-probabilities) of `logits`, LOG_PROB_BYTES at a time."""
    step = max(1, LOG_PROB_BYTES // (8 * max(1, logits.shape[-1])))
    for lo in range(0, len(logits), step):
        rows = slice(lo, lo + step)
        yield rows, logits[rows].double().log_softmax(-1)


def _device_of(model: nn.Module, name: str, default: torch.device) -> torch.device:
    """Where module `name`'s parameters are (a model placed on several devices)."""
    param = next(model.get_submodule(name).parameters(), None)
    return param.device if param is not None else default


@torch.no_grad()
def loss_measures(model: nn.Module, sequences: list[torch.Tensor], points: dict[int, SplicePoint],
                  transcoders: dict[int, Transcoder] | CrossLayerTranscoder,
                  batch_tokens: int = BATCH_TOKENS, mode: str = "transcoder",
                  ) -> dict[int | str, dict[str, float]]:  # fmt: skip
    """The loss measures (see the module docstring) of each layer of `points` spliced alone, and
    of `all` of them at once, over the next-token predictions of `sequences`. `mode`
    `with_error` splices the transcoders with their errors added back (ce_spliced is then
    ce_clean: a check of the splice)."""
    device = next(model.parameters()).device
    if isinstance(transcoders, CrossLayerTranscoder):
        transcoders = transcoders.to(device)
    else:
        transcoders = {layer: t.to(_device_of(model, points[layer].mlp, device))
                       for layer, t in transcoders.items() if layer in points}  # fmt: skip
    variants: dict[int | str, list[int]] = {layer: [layer] for layer in sorted(points)}
    variants["all"] = sorted(points)
    vocab = _vocabulary(model)
    if vocab:
        batch_tokens = max(1, min(batch_tokens, LOGITS_BYTES // (4 * vocab)))
    sums = {key: {"ce_spliced": 0.0, "ce_zero": 0.0, "kl": 0.0} for key in variants}
    clean_sum, count = 0.0, 0
    for batch in _batches([s for s in sequences if len(s) > 1], batch_tokens):
        ids, mask = _padded(batch, device)
        predicted = mask[:, 1:].bool()
        targets = ids[:, 1:][predicted].unsqueeze(1)
        clean = _logits(model, ids, mask, predicted)
        for rows, lp in _log_probs(clean):
            clean_sum -= float(lp.gather(1, targets[rows]).sum())
        count += len(targets)
        for key, where in variants.items():
            with Splice(model, points, transcoders, mode, layers=where):
                spliced = _logits(model, ids, mask, predicted)
            for (rows, lp), (_, clean_lp) in zip(
                _log_probs(spliced), _log_probs(clean), strict=True
            ):
                sums[key]["ce_spliced"] -= float(lp.gather(1, targets[rows]).sum())
                sums[key]["kl"] += float((clean_lp.exp() * (clean_lp - lp)).sum())
            del spliced
            with Splice(model, points, mode="zero", layers=where):
                zeroed = _logits(model, ids, mask, predicted)
            for rows, lp in _log_probs(zeroed):
                sums[key]["ce_zero"] -= float(lp.gather(1, targets[rows]).sum())
            del zeroed
    if not count:
        raise DataError(
            "no next-token prediction to measure: the held-out samples have fewer than 2 tokens "
            f"each; {NO_LOSSES}"
        )
    ce_clean = clean_sum / count
    out: dict[int | str, dict[str, float]] = {}
    for key, s in sums.items():
        ce_spliced, ce_zero = s["ce_spliced"] / count, s["ce_zero"] / count
        gap = ce_zero - ce_clean
        out[key] = {"ce_clean": ce_clean, "ce_spliced": ce_spliced, "ce_zero": ce_zero,
                    "ce_recovered": (ce_zero - ce_spliced) / gap if gap != 0 else float("nan"),
                    "kl": s["kl"] / count}  # fmt: skip
    log.info("loss measures over %d next-token predictions of %d samples", count, len(sequences))
    return out
