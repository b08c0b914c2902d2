"""A short declarative training, watched: what `python -m probe.train` runs.

The model, dataset and objective are a run's (the objective, averaged over the batch, is the
loss); `train.*` says how to train (optimizer sgd, adam or adamw, lr, steps, momentum,
weight_decay, fix_batch, seed) and `watch.*` how to watch (every, flush_every: options of
probe.watch_options.WatchOptions), with the run's probes. It serves short trainings and sweeps
over them (mup's coordinate check is one multirun over `model.width`), not full recipes.

probe.plan.parse_training reads the composed config once into the TrainingPlan that
`train(plan, out)` runs. docs/training.md is the guide.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import TYPE_CHECKING

from probe.errors import ConfigError
from probe.plan import TrainingPlan, TrainSpec
from probe.watch_options import WatchOptions

if TYPE_CHECKING:
    import torch


def make_optimizer(spec: TrainSpec, params):
    """The torch optimizer `spec` names, over `params`."""
    import torch

    if spec.optimizer == "sgd":
        return torch.optim.SGD(
            params, lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay
        )
    kind = torch.optim.Adam if spec.optimizer == "adam" else torch.optim.AdamW
    return kind(params, lr=spec.lr, weight_decay=spec.weight_decay)


def watch_options(plan: TrainingPlan, out: Path, optimizer) -> WatchOptions:
    """The watch of `plan`: its watch.* keys (each an option of the same name), the run
    directory `out`, the training's optimizer and the top-level `overwrite`."""
    keys = dataclasses.asdict(plan.watch)
    return WatchOptions(out=out, optimizer=optimizer, overwrite=plan.overwrite, **keys)


def tensor_inputs(
    plan: TrainingPlan, inputs: torch.Tensor | dict[str, torch.Tensor]
) -> torch.Tensor:
    """A batch's inputs as the training feeds them to the model: one tensor (a token batch,
    a dict of input_ids, is refused before the watch is made)."""
    if isinstance(inputs, dict):
        raise ConfigError(
            f"python -m probe.train feeds the model one tensor per batch, and dataset="
            f"{plan.data.name} gives token batches (a dict of input_ids): watch your own loop "
            "with probe.watch, or the Hugging Face Trainer with its callback"
        )
    return inputs


def train(plan: TrainingPlan, out: Path) -> list[float]:
    """Train `plan` watched into the run directory `out`; the per-step losses."""
    import torch

    from probe.data.batches import build_batches
    from probe.hooks.objective import build_objective, per_sample
    from probe.launch.run import resolve_device
    from probe.models.build import build_model, model_input
    from probe.train.watched_run import Watch

    t = plan.train
    device = resolve_device(plan.device)
    model = build_model(plan.model, t.seed).train().to(device)
    batches = build_batches(plan.data, plan.model, t.seed, model)
    objective = build_objective(plan.objective, batches.has_targets)
    optimizer = make_optimizer(t, model.parameters())
    data = list(itertools.islice(batches, 1)) if t.fix_batch else list(batches)
    steps = [(tensor_inputs(plan, b.inputs), b.targets) for b in data]  # (inputs, targets)
    torch.manual_seed(t.seed)
    losses = []
    with Watch(model, plan.probes, watch_options(plan, out, optimizer)) as w:
        for step in range(t.steps):
            inputs, targets = steps[step % len(steps)]
            optimizer.zero_grad()
            output = model(model_input(model, inputs, device))
            loss = per_sample(objective, output, targets, inputs).mean()
            loss.backward()
            w.loss(loss)
            optimizer.step()
            losses.append(float(loss.detach()))
    return losses
