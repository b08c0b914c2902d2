"""One batch into the model and its answer out: image tensors or token batches (a dict of
`input_ids`, `attention_mask`, ...), passed as keyword arguments where the model takes them, and
the model's output tensors as /model/output rows."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from probe.errors import ModelError, ProbeError
from probe.hooks.names import flatten
from probe.layout import TokenBatch
from probe.models.build import model_input


def to_device(model: nn.Module, inputs, device, non_blocking: bool = False):
    """Inputs on `device`; floating tensors in the model's dtype, token ids left integer."""
    if isinstance(inputs, dict):
        return {k: model_input(model, v, device, non_blocking) for k, v in inputs.items()}
    return model_input(model, inputs, device, non_blocking)


def token_batch(inputs) -> TokenBatch | None:
    """The layout of a token batch (None for other inputs), from its host tensors."""
    if not isinstance(inputs, dict):
        return None
    return TokenBatch.of(inputs["input_ids"], inputs.get("attention_mask"))


def _keywords(model: nn.Module) -> tuple[set[str], bool]:
    """The keyword names `model.forward` takes, and whether it takes **kwargs."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return set(), True
    names = {p.name for p in params if p.kind != p.VAR_KEYWORD}
    return names, any(p.kind == p.VAR_KEYWORD for p in params)


def call(model: nn.Module, inputs):
    """model(inputs), or model(**inputs) with the keys its forward takes; a model that takes no
    `input_ids` gets the ids as its one positional argument."""
    try:
        if not isinstance(inputs, dict):
            return model(inputs)
        names, open_ended = _keywords(model)
        if "input_ids" not in names and not open_ended:
            return model(inputs["input_ids"])
        return model(**{k: v for k, v in inputs.items() if open_ended or k in names})
    except ProbeError:  # ours already names the value and the way out
        raise
    except Exception as e:
        raise ModelError(
            f"the model's forward raised {type(e).__name__}: {e}; {_hint(inputs)}"
        ) from e


def _hint(inputs) -> str:
    if isinstance(inputs, dict):
        shape = tuple(inputs["input_ids"].shape)
        return (
            f"check that the token batch (input_ids {shape}) fits the model: its vocabulary, "
            "its maximum length (dataset.seq_len) and the inputs it takes"
        )
    return (
        f"check that the dataset's input shape {tuple(inputs.shape[1:])} fits the model "
        "(dataset.image_size, dataset.channels)"
    )


def output_rows(
    output, mode: str, size: int, tokens: TokenBatch | None, name: str = "model/output"
) -> dict[str, torch.Tensor]:
    """The model's output tensors by /model/output path ('model/output', 'model/output.logits',
    ...) as float32 CPU copies, one row per sample (tensors without the batch axis, such as an
    HF loss, are left out). `last` keeps a token model's last real position (its next-token
    logits), `auto` does so for token batches, `none` keeps nothing."""
    if mode == "none":
        return {}
    last = tokens is not None and mode in ("last", "auto")
    rows = {}
    for path, t in flatten(output):
        if t.ndim == 0 or t.shape[0] != size:
            continue
        if last:
            t = at_last_token(t, tokens)
        rows[f"{name}{path}"] = t.detach().to("cpu", torch.float32, copy=True)
    if not rows:
        raise ModelError(f"the model returned {type(output).__name__} with no tensor in it")
    return rows


def answer(output, tokens: TokenBatch | None) -> torch.Tensor:
    """The model's answer per sample: its first output, at the last real token of token layouts."""
    return at_last_token(first_output(output), tokens)


def at_last_token(t: torch.Tensor, tokens: TokenBatch | None) -> torch.Tensor:
    """Each sample's row at its last real token, for a (N, T, ...) layout; others as they are."""
    if tokens is None or t.ndim < 3 or t.shape[1] != tokens.length:
        return t
    return t[torch.arange(len(t), device=t.device), tokens.last]


def first_output(output) -> torch.Tensor:
    """The model's (first) output tensor with a batch axis: logits of an HF ModelOutput."""
    t = output if isinstance(output, torch.Tensor) else None
    if t is None:
        t = next((x for _, x in flatten(output) if x.ndim > 0), None)
    if t is None:
        raise ModelError(f"the model returned {type(output).__name__} with no tensor in it")
    return t
