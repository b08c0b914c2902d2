"""A short declarative training, watched: what `python -m probe.train` runs.

The model, dataset and objective are a run's (the objective, averaged over the batch, is the
loss); `train.*` says how to train (optimizer sgd, adam or adamw, lr, steps, momentum,
weight_decay, fix_batch, seed) and `watch.*` how to watch (every, flush_every), with the run's
probes. It serves short trainings and sweeps over them (mup's coordinate check is one multirun
over `model.width`), not full recipes.

`plan(cfg)` is the one place the composed config is read: it gives the typed, checked TrainSpec
that `train(spec, out)` runs. docs/training.md is the guide.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from probe.errors import ConfigError
from probe.train.schedule import Schedule

OPTIMIZERS = ("sgd", "adam", "adamw")


@dataclass(frozen=True)
class TrainSpec:
    """A watched training, typed and checked: the run's model, dataset, objective and probes
    (their config nodes, as the builders take them) and the training and watch settings."""

    model: Any
    dataset: Any
    objective: Any
    probes: dict
    optimizer: str
    lr: float
    steps: int
    momentum: float
    weight_decay: float
    fix_batch: bool
    seed: int
    every: int | str
    flush_every: int
    device: str
    overwrite: bool


def plan(cfg: DictConfig) -> TrainSpec:
    """The TrainSpec of a composed `python -m probe.train` config; bad values are ConfigErrors
    naming the key and the way out."""
    t, w = cfg.train, cfg.watch
    optimizer = str(t.optimizer).lower()
    if optimizer not in OPTIMIZERS:
        raise ConfigError(
            f"train.optimizer={t.optimizer!r} is unknown; choose from {', '.join(OPTIMIZERS)}"
        )
    for key in ("lr", "momentum", "weight_decay"):
        value = float(t[key])
        if not math.isfinite(value) or value < 0:
            raise ConfigError(f"train.{key}={t[key]!r}: give a finite number >= 0")
    if int(t.steps) < 1:
        raise ConfigError(f"train.steps={t.steps!r}: give an int >= 1, the optimizer steps to run")
    every = w.every if w.every == "log" else _int(w.every, "watch.every")
    Schedule(every, "watch.every")  # (an int >= 1 or 'log', else a ConfigError naming it)
    flush_every = _int(w.flush_every, "watch.flush_every")
    if flush_every < 1:
        raise ConfigError(f"watch.flush_every={w.flush_every!r}: give an int >= 1")
    if not cfg.probes:
        raise ConfigError("the training watches no probe; choose probes=all_linear or add one")
    return TrainSpec(
        model=cfg.model, dataset=cfg.dataset, objective=cfg.objective,
        probes=OmegaConf.to_container(cfg.probes, resolve=True), optimizer=optimizer,
        lr=float(t.lr), steps=int(t.steps), momentum=float(t.momentum),
        weight_decay=float(t.weight_decay), fix_batch=bool(t.fix_batch), seed=int(t.seed),
        every=every, flush_every=flush_every, device=str(cfg.device), overwrite=bool(cfg.overwrite),
    )  # fmt: skip


def _int(value, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}={value!r}: give an int")
    return value


def make_optimizer(spec: TrainSpec, params):
    import torch

    if spec.optimizer == "sgd":
        return torch.optim.SGD(
            params, lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay
        )
    kind = torch.optim.Adam if spec.optimizer == "adam" else torch.optim.AdamW
    return kind(params, lr=spec.lr, weight_decay=spec.weight_decay)


def train(spec: TrainSpec, out: Path) -> list[float]:
    """Train `spec` watched into the run directory `out`; the per-step losses."""
    import torch

    from probe.data.batches import build_batches, output_width
    from probe.hooks.objective import build_objective, per_sample
    from probe.models.build import build_model, model_input
    from probe.train.watch import watch

    model = build_model(spec.model, spec.seed).train()
    batches = build_batches(spec.dataset, spec.model, spec.seed, model)
    objective = build_objective(
        spec.objective, batches.has_targets, output_width(model, spec.model)[0]
    )
    optimizer = make_optimizer(spec, model.parameters())
    data = list(batches)[:1] if spec.fix_batch else list(batches)
    torch.manual_seed(spec.seed)
    losses = []
    with watch(model, spec.probes, out=out, optimizer=optimizer, every=spec.every,
               flush_every=spec.flush_every, overwrite=spec.overwrite) as w:  # fmt: skip
        for step in range(spec.steps):
            batch = data[step % len(data)]
            optimizer.zero_grad()
            output = model(model_input(model, batch.inputs, spec.device))
            loss = per_sample(objective, output, batch.targets, batch.inputs).mean()
            loss.backward()
            w.loss(loss)
            optimizer.step()
            losses.append(float(loss.detach()))
    return losses
