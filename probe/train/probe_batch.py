"""A fixed batch evaluated while the model trains: a probing run of the model as it stands.

At each of its steps (`probe_every`) the batch runs through the model in eval mode without
gradients, as `probe.run` runs it, into `probe_batch/<step>/` of the watched run: a run directory
with probe.h5, summary.csv and `.hydra/overrides.yaml` saying `step=<step>`, so `probe_batch/` is
a sweep over steps that every analysis reads (CKA between steps, linear probes, top-k examples).
The training does not notice: every module's train/eval flag, every buffer (BatchNorm's running
statistics) and every random state (torch's CPU and CUDA generators, Python's and numpy's) are
put back as they were.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from torch import nn

from probe.data.user_batches import UserBatches
from probe.errors import ConfigError, ProbeError
from probe.hooks.forward import call, to_device
from probe.launch import api
from probe.launch.run import prepare
from probe.launch.run import run as run_config
from probe.plan import probe_specs
from probe.store.steps_file import PROBE_BATCH
from probe.train.schedule import Schedule
from probe.train.watched_sites import value_probes

log = logging.getLogger("probe")
FOLDER = PROBE_BATCH


@contextlib.contextmanager
def untouched(model: nn.Module):
    """Whatever runs inside leaves the model's flags and buffers and every random state as it
    found them."""
    flags = [(m, m.training) for m in model.modules()]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    python, numpy = random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        for m, training in flags:
            m.training = training
        with torch.no_grad():
            for b, value in buffers:
                b.copy_(value)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        random.setstate(python)
        np.random.set_state(numpy)


class ProbeBatch:
    """Evaluates `batch` (a tensor, an (inputs, targets) pair or a dict of keyword arguments)
    with the value sites of `probes` into `root`/<step>/ at the steps of `schedule`."""

    def __init__(self, model: nn.Module, probes, batch, root: Path, schedule: Schedule,
                 stats=None):  # fmt: skip
        self.model, self.batch, self.root, self.schedule = model, batch, Path(root), schedule
        run_probes = value_probes(probes)
        if not run_probes:
            names = ", ".join(probe_specs(probes, run_sites=False))
            raise ConfigError(
                f"probe_batch is evaluated with the probes' value sites, and the probes ({names}) "
                "capture none; add output or input to a probe's capture, or drop probe_batch"
            )
        batches = UserBatches([batch])  # (a batch of the wrong kind is a DataError now)
        self.plan = api.run_plan(
            model, batches, run_probes, stats=stats, progress=False, print_summary=False,
            overwrite=True,
        )  # fmt: skip

    def check_fits(self) -> None:
        """One forward of the batch (everything put back after): a batch the model cannot take
        is a ConfigError before the training starts."""
        first = next(iter(UserBatches([self.batch])))
        device = _device_of(self.model)
        try:
            with untouched(self.model), torch.no_grad():
                self.model.eval()
                call(self.model, to_device(self.model, first.inputs, device))
        except ProbeError as e:
            raise ConfigError(f"probe_batch does not fit the model: {e}") from None

    def forget_from(self, step: int) -> None:
        """Remove the evaluations of `step` and later (a training resumed at `step` makes them
        again)."""
        if not self.root.is_dir():
            return
        for d in self.root.iterdir():
            if d.is_dir() and d.name.isdigit() and int(d.name) >= step:
                shutil.rmtree(d)

    def evaluate(self, step: int) -> Path | None:
        """The batch at `step` if the schedule takes it: its run directory."""
        if not self.schedule.records(step):
            return None
        run_dir = self.root / str(step)
        if run_dir.exists():
            shutil.rmtree(run_dir)
        batches = UserBatches([self.batch])
        options = dataclasses.replace(self.plan.options, device=_device_of(self.model))
        plan = dataclasses.replace(self.plan, options=options)  # (the model may have moved)
        quiet = log.level
        log.setLevel(max(logging.WARNING, log.getEffectiveLevel()))  # (a run's log per step)
        try:
            with untouched(self.model):
                run_config(plan, run_dir=run_dir, prepared=prepare(plan, self.model, batches))
        finally:
            log.setLevel(quiet)
        hydra = run_dir / ".hydra"
        hydra.mkdir(exist_ok=True)
        (hydra / "overrides.yaml").write_text(f"- step={step}\n")
        return run_dir


def _device_of(model: nn.Module) -> str:
    first = next((t for t in [*model.parameters(), *model.buffers()]), None)
    return str(first.device) if first is not None else "cpu"
