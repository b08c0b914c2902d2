"""probe.watch in transformers' Trainer: the callback makes the watch when the training starts,
ends each step around the Trainer's optimizer step, and closes the file when the training ends.

    from probe.integrations.hf import ProbeCallback

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[ProbeCallback("blocks", out="runs/w", every=10)])
    trainer.train()

The watch hooks the Trainer's model and records its optimizer's learning rates (before the
scheduler's step). The gradients are read in `on_pre_optimizer_step`: after the Trainer clips
them (`max_grad_norm`), as the optimizer sees them (`grad_norm`); the norm before clipping,
the one the Trainer logs as `grad_norm`, is train.csv's `grad_norm_preclip`: with
`cb.attach(trainer)` the very value the Trainer's `accelerator.clip_grad_norm_` returned (handed
over, not measured again), else the norm at the end of the step's last backward (the one
accelerate's `sync_gradients` marks); the updates in `on_optimizer_step`. The step's loss is the
Trainer's: the sum of the micro-batches' `output.loss` where the Trainer passes the model
`num_items_in_batch` (each is a partial sum of the step's), else their mean. `log_stats` adds
the chosen statistics of every recorded site, as `probe/<layer>/<site>/<statistic>`, to the
Trainer's own next log (its `loss`, `grad_norm`, `learning_rate` are kept), so `log_history`
and every `report_to` integration (TensorBoard, W&B, MLflow, ...) get them beside the
Trainer's values, and the console does not print them; with `logging_steps` > 1 a recorded
step's statistics wait for the Trainer's next log (a later recorded step's replace them).
That needs the Trainer: add the callback with `cb.attach(trainer)`. `trainer.train(resume_from_checkpoint=...)`
appends to the same file from the checkpoint's step (each checkpoint's save flushes the file).
An exception inside `trainer.train()` leaves the watch open: `cb.close()` closes it (the next
`train()` does too). docs/training.md has the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from probe.errors import ConfigError
from probe.hooks.hookset import HookSet
from probe.integrations.driven import Driven

try:
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
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
        self.unwrap: Callable[[], None] | None = None  # restores the accelerator's clip

    def attach(self, trainer) -> ProbeCallback:
        """Add this callback to `trainer` and keep it, to add `log_stats` to its logs: first
        of its callbacks, so the `report_to` integrations' `on_log` see them, and hidden from
        the callbacks that print the logs."""
        trainer.add_callback(self)
        callbacks = trainer.callback_handler.callbacks
        callbacks.remove(self)
        callbacks.insert(0, self)
        if self.driven.log_stats:
            for printer in [c for c in callbacks if is_printer(c)]:
                hidden: dict[str, float] = {}
                at = callbacks.index(printer)
                callbacks.insert(at + 1, _Unhide(hidden))
                callbacks.insert(at, _Hide(hidden))
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
        self._restore_clip()
        inner = getattr(optimizer, "optimizer", optimizer)  # (accelerate's wrapper)
        self.driven.start(model, inner, state.global_step,
                          on_record=self._keep if self.driven.log_stats else None)  # fmt: skip
        self.hooks.forward(model, self._loss_hook(), name="<model> loss", with_kwargs=True)
        norms = self.watch.watcher.norms
        gradients = getattr(optimizer, "gradient_state", None)  # (accelerate's: the step's last
        if gradients is not None:  # micro-batch syncs the gradients, and its backward is last)
            norms.last_backward = lambda: bool(gradients.sync_gradients)
        if self.trainer is not None and self._hand_over_clip(self.trainer):
            norms.at_backward = False  # (the clip's norm comes: nothing to measure before it)

    def _hand_over_clip(self, trainer) -> bool:
        """Hand the total norm the Trainer's `accelerator.clip_grad_norm_` returns (it clips,
        or with max_grad_norm 0 measures, every step; the value it logs as grad_norm) over to
        the watch as the step's grad_norm_preclip, until the training ends. False where the
        Trainer has no such accelerator."""
        accelerator: Any = getattr(trainer, "accelerator", None)
        clip = getattr(accelerator, "clip_grad_norm_", None)
        if not callable(clip):
            return False
        watcher = self.watch.watcher
        own = "clip_grad_norm_" in vars(accelerator)  # (an instance's own, to put back)

        def clip_grad_norm_(*args, **kwargs):
            total = clip(*args, **kwargs)
            if total is not None:
                watcher.take_clip_norm(total)
            return total

        def unwrap():
            if own:
                accelerator.clip_grad_norm_ = clip
            else:
                del accelerator.clip_grad_norm_

        accelerator.clip_grad_norm_ = clip_grad_norm_
        self.unwrap = unwrap
        return True

    def _restore_clip(self) -> None:
        unwrap, self.unwrap = self.unwrap, None
        if unwrap is not None:
            unwrap()

    def _loss_hook(self):
        def hook(module, args, kwargs, output):
            loss = getattr(output, "loss", None)
            if loss is None and isinstance(output, dict):
                loss = output.get("loss")
            if isinstance(loss, torch.Tensor) and torch.is_grad_enabled():
                # (given num_items_in_batch, the model's loss is the micro-batch's partial sum
                # of the step's mean, and the Trainer logs their sum)
                summed = kwargs.get("num_items_in_batch") is not None
                self.watch.loss(loss, summed=summed)

        return hook

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.watch.before_update()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.watch.after_update()

    def on_log(self, args, state, control, logs=None, **kwargs):
        w = self.watch
        if self.driven.log_stats and w is not None and not w.closed:
            w.watcher.write_staged(wait=True)  # (a GPU's last recorded step: into this log)
        if self.pending and logs is not None:
            metrics, self.pending = self.pending, {}
            logs.update(metrics)
            if state.log_history:  # (the Trainer's copy of this log, appended before on_log)
                state.log_history[-1].update(metrics)

    def on_save(self, args, state, control, **kwargs):
        w = self.watch
        if w is not None and not w.closed:
            w.state_dict()  # (flushes: the file holds every step the checkpoint has seen)

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def close(self, complete: bool = True) -> None:
        """Close the watch, remove the loss hook and give the accelerator its own clip back
        (the end of the training does it)."""
        try:
            self.hooks.remove()
            self._restore_clip()
        finally:
            self.driven.close(complete)

    def _keep(self, step: int, rows: dict, scalars: dict) -> None:
        self.pending = self.driven.metrics(rows)


def is_printer(callback) -> bool:
    """Whether `callback` prints the Trainer's logs (its progress bar, its printer, the
    notebook's)."""
    return isinstance(callback, (PrinterCallback, ProgressCallback)) or type(
        callback
    ).__name__.endswith("ProgressCallback")


class _Hide(TrainerCallback):
    """Takes the `probe/` statistics out of a log before a callback that prints it."""

    def __init__(self, hidden: dict):
        self.hidden = hidden

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs:
            for key in [k for k in logs if k.startswith("probe/")]:
                self.hidden[key] = logs.pop(key)


class _Unhide(_Hide):
    """Puts them back after it (the callbacks after it see the whole log)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None:
            logs.update(self.hidden)
        self.hidden.clear()
