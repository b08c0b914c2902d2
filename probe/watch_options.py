"""The options of a watched training, declared once: `WatchOptions`.

Each option is one field: its name, type, default and its check (a ConfigError naming the bad
value and the way out). `probe.watch`'s keywords, `Watch`, the trainers' callbacks
(probe.integrations) and `python -m probe.train` (its `watch.*` keys, config.WatchKeys) take
their options from here; what needs the model (the probes' modules, the edits' layers, the probe
batch's fit) is checked by the watch itself (probe.train.watched_run).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from probe.errors import ConfigError

if TYPE_CHECKING:
    import torch

LOG = "log"  # `every="log"`: steps 0, 1, 2, 4, 8, ...


class GradScaling(Protocol):
    """AMP's GradScaler as the watch reads it: its current scale."""

    def get_scale(self) -> float: ...


def check_out(key: str, out: Any) -> None:
    if Path(out).exists() and not Path(out).is_dir():
        raise ConfigError(f"{key}={str(out)!r} is a file; give a directory for the run")


def check_every(key: str, every: Any) -> None:
    """`every` and `probe_every`: an int >= 1 or "log"."""
    if every == LOG:
        return
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ConfigError(
            f"{key}={every!r}: give an int >= 1 (record every N-th step; 1: every "
            f"step) or {LOG!r} (steps 0, 1, 2, 4, 8, ...)"
        )


def check_probe_every(key: str, every: Any) -> None:
    if every is not None:
        check_every(key, every)


def check_optimizer(key: str, optimizer: Any) -> None:
    import torch

    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"{key} is a {type(optimizer).__name__}, not a torch.optim.Optimizer; pass "
            "the optimizer whose step() ends each training step, or leave it out and call "
            "w.step() after each step"
        )


def check_scaler(key: str, scaler: Any) -> None:
    if scaler is not None and not callable(getattr(scaler, "get_scale", None)):
        raise ConfigError(
            f"{key} is a {type(scaler).__name__}, not AMP's GradScaler (no get_scale)"
        )


def check_edits(key: str, edits: Any) -> None:
    """A mapping name -> edit spec (each spec is parsed as the intervene group's, and checked
    to be on a gradient site, by the watch: probe.train.watched_run)."""
    if edits and not isinstance(edits, Mapping):
        raise ConfigError(
            f"{key} is a {type(edits).__name__}; give a mapping name -> edit spec, e.g. "
            "{'freeze': {'layers': ['layer3.*'], 'site': 'grad_output', 'op': 'zero'}}"
        )


def check_flush_every(key: str, flush_every: Any) -> None:
    if isinstance(flush_every, bool) or not isinstance(flush_every, int) or flush_every < 1:
        raise ConfigError(
            f"{key}={flush_every!r}: give an int >= 1, the recorded steps between "
            "flushes of the file (a kill loses at most the steps after the last flush)"
        )


def option(default: Any, check: Callable[[str, Any], None] | None = None, *,
           from_trainer: bool = False) -> Any:  # fmt: skip
    """A field of WatchOptions: its default, its check(key, value), and whether a trainer's
    callback sets it from the trainer (the user does not give it there)."""
    return field(default=default, metadata={"check": check, "from_trainer": from_trainer})


@dataclass(frozen=True)
class WatchOptions:
    """How a training is watched: every keyword of `probe.watch` after the model and the probes
    (docs/training.md's table). Made, it has passed every check that needs no model."""

    out: str | Path = field(metadata={"check": check_out, "from_trainer": False})
    every: int | str = option(1, check_every)
    optimizer: torch.optim.Optimizer | None = option(None, check_optimizer, from_trainer=True)
    scaler: GradScaling | None = option(None, check_scaler, from_trainer=True)
    probe_batch: Any = option(None)  # (checked on the model: probe.train.probe_batch)
    probe_every: int | str | None = option(None, check_probe_every)
    probe_stats: Mapping[str, Any] | None = option(None)  # (checked as a run's stats keys)
    edits: Mapping[str, Any] | None = option(None, check_edits)
    flush_every: int = option(10, check_flush_every)
    fail_on_nonfinite: bool = option(False)
    seed: int = option(0)
    overwrite: bool = option(False)
    hook_optimizer: bool = option(True, from_trainer=True)

    def __post_init__(self) -> None:
        for f in fields(self):
            check_option(f, f.name, getattr(self, f.name))

    @property
    def optimizer_hooked(self) -> bool:
        """Whether the optimizer's step hooks end the steps (an optimizer, not declined)."""
        return self.optimizer is not None and bool(self.hook_optimizer)


def check_option(f: Field[Any], key: str, value: Any) -> None:
    """Field `f`'s check of `value`, its messages naming `key`."""
    check = f.metadata.get("check")
    if check is not None:
        check(key, value)


def names() -> tuple[str, ...]:
    """Every option's name, in declaration order."""
    return tuple(f.name for f in fields(WatchOptions))


def user_options() -> tuple[str, ...]:
    """The options a trainer's callback takes from the user (the others come from the
    trainer: its optimizer, its grad scaler, its own step hooks)."""
    return tuple(f.name for f in fields(WatchOptions) if not f.metadata["from_trainer"])


def check_keys(values: Mapping[str, Any], prefix: str) -> None:
    """Config keys naming options (`python -m probe.train`'s watch.*), each checked as its
    option is, its messages naming `prefix` + the key; a key that is no option is refused."""
    declared = {f.name: f for f in fields(WatchOptions)}
    for key, value in values.items():
        if key not in declared:
            raise ConfigError(
                f"{prefix}{key} is no option of the watch; choose from {', '.join(declared)}"
            )
        check_option(declared[key], f"{prefix}{key}", value)
