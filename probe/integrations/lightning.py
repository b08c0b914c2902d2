"""probe.watch in Lightning's Trainer: the callback makes the watch when the training starts,
ends each step after Lightning's optimizer step, and closes the file when the training ends.

    from probe.integrations.lightning import ProbeCallback

    trainer = L.Trainer(callbacks=[ProbeCallback("all_convs", out="runs/w", every=10)])
    trainer.fit(module, loader)

The watch hooks the LightningModule (layer names are its own: `net.conv1` for a network kept in
`self.net`), records the first optimizer's learning rates and the precision plugin's grad scale,
and takes the step's loss from `training_step`'s output (the micro-batch's loss, before
Lightning divides it by `accumulate_grad_batches`; the step's is their mean). The gradients
(`param_grad`, `grad_norm`) are read after the optimizer step, before the next step's
`zero_grad`: after Lightning clips them (`gradient_clip_val`), as the optimizer stepped on
them; `on_before_optimizer_step` (after the backward and AMP's unscale, before the clip) gives
the parameters, the learning rates and `grad_norm_preclip` (under manual optimization, where
the module clips before `opt.step()`, the gradients too, and `grad_norm_preclip` is the norm at
the end of the backward, as in a plain loop). Each norm is measured once: `grad_norm` is the
preclip norm again where nothing clipped (probe.train.grad_norms). `log_stats` sends the chosen statistics of every recorded site to the trainer's loggers
(`probe/<layer>/<site>/<statistic>`, at the watch's step). A training resumed from a Lightning
checkpoint appends to the same file from the checkpoint's step. docs/training.md has the rest.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from probe.errors import ConfigError
from probe.integrations.driven import Driven

if TYPE_CHECKING:  # (one base class for mypy: the `lightning` extra's; at run time either)
    from lightning.pytorch.callbacks import Callback
else:
    try:
        from lightning.pytorch.callbacks import Callback
    except ImportError:  # (the standalone package)
        try:
            from pytorch_lightning.callbacks import Callback
        except ImportError as e:
            raise ImportError(
                "probe.integrations.lightning needs Lightning: pip install 'probe[lightning]'"
            ) from e


class ProbeCallback(Callback):
    """Watch a Lightning training into the run directory `out` (probe.watch's file).

    `probes`, `out`, `every` and the other keywords (probe_batch, probe_every, probe_stats,
    edits, flush_every, fail_on_nonfinite, seed, overwrite) are probe.watch's. `log_stats`: the
    statistics (train.csv's columns: abs_mean, norm, ...) whose values go to the trainer's
    loggers at each recorded step."""

    def __init__(self, probes, *, out, every=1, log_stats: Iterable[str] = (), **options):
        self.driven = Driven(probes, out, every, log_stats, options)
        self.global_step = 0

    @property
    def watch(self):
        """The watch (probe.train.watched_run.Watch) while the training runs."""
        return self.driven.watch

    def on_train_start(self, trainer, pl_module) -> None:
        optimizers = list(trainer.optimizers)
        if len(optimizers) > 1:
            raise ConfigError(
                f"the LightningModule has {len(optimizers)} optimizers; ProbeCallback ends a step "
                "at each optimizer step, so it watches a training with one"
            )
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.global_step = trainer.global_step
        send = None
        if self.driven.log_stats:
            send = lambda step, rows, scalars: self._send(trainer, step, rows)  # noqa: E731
        self.driven.start(pl_module, optimizers[0] if optimizers else None,
                          trainer.global_step, scaler, on_record=send)  # fmt: skip
        if pl_module.automatic_optimization:  # (grad_norm_preclip: on_before_optimizer_step)
            norms = self.watch.watcher.norms
            norms.at_backward = norms.learns = False

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        watcher = self.watch.watcher
        watcher.take_params()
        if not pl_module.automatic_optimization:  # (the module clips, if at all, before this)
            watcher.take_grads(optimizer)
            return
        watcher.take_preclip_norm()  # (Lightning clips after this hook)
        watcher.take_lrs(optimizer)  # (its schedulers step before on_train_batch_end)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            if pl_module.automatic_optimization:
                loss = loss * trainer.accumulate_grad_batches
            self.watch.loss(loss)
        if trainer.global_step != self.global_step:  # an optimizer step ran
            self.global_step = trainer.global_step
            if pl_module.automatic_optimization:  # (clipped; zero_grad comes in the next step)
                self.watch.watcher.take_grads(None)
            self.watch.after_update()

    def on_train_end(self, trainer, pl_module) -> None:
        self.driven.close()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.driven.close(complete=False)

    def state_dict(self) -> dict:
        """Lightning's checkpoint of the callback: the file is flushed first, so it holds every
        step the checkpoint has seen."""
        w = self.watch
        return w.state_dict() if w is not None and not w.closed else {}

    def load_state_dict(self, state_dict: dict) -> None:
        """A checkpoint's state, restored by Lightning before the training starts: the watch
        made then resumes with it (the step, and the edits' sample count)."""
        self.driven.restored = dict(state_dict or {})

    def _send(self, trainer, step: int, rows: dict) -> None:
        metrics = self.driven.metrics(rows)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
