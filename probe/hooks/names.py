"""How captured values are named: a module's output or input, however nested (tuples, named
tuples, dicts, dataclasses such as transformers' outputs), as tensors at stable paths, and the
dataset name each one gets (`output`, `output.1`, `output.logits`, `output@1` for a 2nd call)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from probe.site_keys import SiteKey


def flatten(value: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) pairs of a nested output: '' for a tensor, '.0', '.logits', '.0.aux' below it."""
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from flatten(v, f"{prefix}.{k}")
    elif isinstance(value, tuple) and hasattr(value, "_fields"):
        for k in value._fields:
            yield from flatten(getattr(value, k), f"{prefix}.{k}")
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            yield from flatten(v, f"{prefix}.{i}")
    elif hasattr(value, "__dataclass_fields__"):
        for k in value.__dataclass_fields__:
            yield from flatten(getattr(value, k), f"{prefix}.{k}")


def dataset_name(site: str, path: str, call: int) -> str:
    """Stable name of one captured tensor: `output`, `output.1` (tuple item), `output@1` (2nd
    call); probe.site_keys.SiteKey parses it back."""
    return str(SiteKey(site, path, call))


def replace_tensors(value: Any, fn, prefix: str = "") -> Any:
    """`value` with every tensor t at path p replaced by fn(p, t), the structure rebuilt around it."""
    if isinstance(value, torch.Tensor):
        return fn(prefix, value)
    if isinstance(value, dict):
        return type(value)((k, replace_tensors(v, fn, f"{prefix}.{k}")) for k, v in value.items())
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(
            *(replace_tensors(getattr(value, k), fn, f"{prefix}.{k}") for k in value._fields)
        )
    if isinstance(value, list | tuple):
        return type(value)(replace_tensors(v, fn, f"{prefix}.{i}") for i, v in enumerate(value))
    return value
