"""probe.watch in transformers' Trainer: the callback makes the watch when the training starts,
ends each step around the Trainer's optimizer step, and closes the file when the training ends.

    from probe.integrations.hf import ProbeCallback

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[ProbeCallback("blocks", out="runs/w", every=10)])
    trainer.train()

The watch hooks the Trainer's model and records its optimizer's learning rates (before the
scheduler's step). The gradients are read in `on_pre_optimizer_step`: after the Trainer clips
them (`max_grad_norm`), as the optimizer sees them; the updates in `on_optimizer_step`. The
step's loss is the mean of the losses the model returns (`output.loss`) in the step's forwards.
`log_stats` sends the chosen statistics of every recorded site through `trainer.log`, so every
`report_to` integration (TensorBoard, W&B, MLflow, ...) gets them as
`probe/<layer>/<site>/<statistic>` at the Trainer's global step; that needs the Trainer:
add the callback with `cb.attach(trainer)`. `trainer.train(resume_from_checkpoint=...)`
appends to the same file from the checkpoint's step (each checkpoint's save flushes the file).
An exception inside `trainer.train()` leaves the watch open: `cb.close()` closes it (the next
`train()` does too). docs/training.md has the rest.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from probe.errors import ConfigError
from probe.hooks.hookset import HookSet
from probe.integrations.driven import Driven

try:
    from transformers import TrainerCallback
except ImportError as e:
    raise ImportError("probe.integrations.hf needs transformers: pip install 'probe[hf]'") from e


class ProbeCallback(TrainerCallback):
    """Watch a transformers Trainer's training into the run directory `out` (probe.watch's
    file).

    `probes`, `out`, `every` and the other keywords (probe_batch, probe_every, probe_stats,
    edits, flush_every, fail_on_nonfinite, seed, overwrite) are probe.watch's. `log_stats`: the
    statistics (train.csv's columns: abs_mean, norm, ...) sent to the Trainer's log at each
    recorded step (with `attach(trainer)`)."""

    def __init__(self, probes, *, out, every=1, log_stats: Iterable[str] = (), **options):
        self.driven = Driven(probes, out, every, log_stats, options)
        self.trainer = None
        self.pending: dict[str, float] = {}
        self.hooks = HookSet("probe.integrations.hf: the model's loss")

    def attach(self, trainer) -> ProbeCallback:
        """Add this callback to `trainer` and keep it, to send `log_stats` through its log."""
        trainer.add_callback(self)
        self.trainer = trainer
        return self

    @property
    def watch(self):
        """The watch (probe.train.watched_run.Watch) while the training runs."""
        return self.driven.watch

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.driven.log_stats and self.trainer is None:
            raise ConfigError(
                "ProbeCallback(log_stats=...) sends the statistics through the Trainer's log: "
                "add the callback with cb.attach(trainer) instead of Trainer(callbacks=[cb])"
            )
        self.hooks.remove()
        inner = getattr(optimizer, "optimizer", optimizer)  # (accelerate's wrapper)
        self.driven.start(model, inner, state.global_step,
                          on_record=self._keep if self.driven.log_stats else None)  # fmt: skip
        self.hooks.forward(model, self._loss_hook(), name="<model> loss")

    def _loss_hook(self):
        def hook(module, args, output):
            loss = getattr(output, "loss", None)
            if loss is None and isinstance(output, dict):
                loss = output.get("loss")
            if isinstance(loss, torch.Tensor) and torch.is_grad_enabled():
                self.watch.loss(loss)

        return hook

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.watch.before_update()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.watch.after_update()

    def on_step_end(self, args, state, control, **kwargs):
        if self.pending:
            metrics, self.pending = self.pending, {}
            self.trainer.log(metrics)

    def on_save(self, args, state, control, **kwargs):
        w = self.watch
        if w is not None and not w.closed:
            w.state_dict()  # (flushes: the file holds every step the checkpoint has seen)

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def close(self, complete: bool = True) -> None:
        """Close the watch and remove the loss hook (the end of the training does it)."""
        try:
            self.hooks.remove()
        finally:
            self.driven.close(complete)

    def _keep(self, step: int, rows: dict, scalars: dict) -> None:
        self.pending = self.driven.metrics(rows)
