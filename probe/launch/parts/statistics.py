"""The captures' statistics as a run part (`stats.during=run|close`): each value reduced to a
batch's statistics as the hooks take it, the parameter gradients after the backward; the
partials folded into each capture's running statistics as their batch is written
(probe.store.folds.StatsFold), and summary.csv at the finish.

A CPU value is reduced by the run's backend while it is in cache (numba's kernels, or torch). A
GPU value, and under the torch backend a CPU one too (the portable reference of that path), is
reduced by torch where it lives (probe.stats.device_sketch): its quantile sketch and its units'
rows stay on its device and are merged there, all of a batch's sites together, and each site's
accumulator (a dozen numbers) reaches the host in one copy per batch, without a host sync. The
parameter gradients are reduced there too; a stats-only record carries only their layouts."""

from __future__ import annotations

import logging

import pandas as pd
import torch

from probe.hooks import nonfinite
from probe.hooks.capture import BatchCapture, Capture, Key
from probe.hooks.module_select import Selection
from probe.hooks.record import Record
from probe.hooks.step_context import StepContext
from probe.launch.run_part import Finished, RunPart, RunSetup
from probe.stats import backend
from probe.stats.device_sketch import BatchSketches
from probe.stats.running import bounds_for
from probe.store.folds import StatsFold
from probe.store.sink import Sink

log = logging.getLogger("probe")


class Statistics(RunPart):
    """Every run's part: its statistics (`stats.during`: run, close, or none: no table)."""

    name = "statistics"

    def __init__(self, during: str, backend_name: str, module_types: dict[str, str],
                 selected: bool, fail_on_nonfinite: bool = False) -> None:  # fmt: skip
        self.during, self.module_types, self.selected = during, module_types, selected
        self.fail_on_nonfinite = fail_on_nonfinite
        self.cpu = backend.observer(backend_name)  # a CPU value's reduction (numba or torch)
        self.cpu_on_device = backend_name == "torch"  # CPU values take the device's path too
        self.bounds: dict[Key, tuple[float, float] | None] = {}  # by capture
        self.partials: dict[Key, object] = {}  # this batch's, reduced on the host
        self.sketches = BatchSketches()  # this batch's, reduced on their devices

    @classmethod
    def prepare(cls, setup: RunSetup) -> Statistics:
        types = {s.name: s.module_type for s in setup.selections}
        plan = setup.plan
        return cls(plan.stats.during, setup.stats_backend, types, bool(setup.selections),
                   plan.options.fail_on_nonfinite)  # fmt: skip

    def per_batch(self) -> bool:
        return self.selected

    def open(self, sink: Sink) -> None:
        if self.during != "none":
            sink.attach(StatsFold(self.during))

    def loop(self, capture: Capture):
        if self.during == "run":
            capture.listen(self)
        return super().loop(capture)

    def before_forward(self, ctx: StepContext) -> None:
        self.partials = {}
        self.sketches = BatchSketches()
        if self.during == "run":
            self.cpu.begin()  # (the numba backend looks its thread's team up once per batch)

    def took(self, key: Key, value: torch.Tensor, axis: int, sel: Selection,
             batch: BatchCapture) -> None:  # fmt: skip
        self.reduce(key, value, axis)

    def after_forward(self, ctx: StepContext) -> None:
        """The parameter gradients' statistics too; the batch's partials to the sink (those
        reduced on a device with their one copy to the host started)."""
        if self.during != "run":
            return
        for key, t in ctx.grads.items():
            self.reduce(key, t, 1)
        self.partials.update(self.sketches.settle())
        ctx.outputs.folds[self.name] = self.partials

    def handed(self, record: Record) -> None:
        """fail_on_nonfinite: the batch's first capture holding NaN or Inf named (the batch
        written: it is there to inspect)."""
        if self.fail_on_nonfinite:
            nonfinite.check_batch(record, record.outputs.folds.get(self.name, {}))

    def reduce(self, key: Key, value: torch.Tensor, axis: int) -> None:
        """One capture's statistics of this batch, on the host or on its device (the one place
        they are taken)."""
        bounds = self.bounds.get(key, False)
        if bounds is False:
            bounds = self.bounds[key] = bounds_for(self.module_types.get(key[0], ""), key[1])
        if value.is_cpu and not self.cpu_on_device:
            self.partials[key] = self.cpu(value, bounds, axis)
        else:
            self.sketches.add(key, value, bounds, axis)

    def finish(self, done: Finished) -> None:
        """summary.csv (none when no probe was asked for or stats.during=none), and the table
        in the log where options.print_summary asks for it."""
        plan = done.plan
        if not done.counted:
            log.info(
                "stats.during=none: no statistics and no summary.csv; python -m probe.summarize "
                "%s computes them from the rows",
                done.run_dir,
            )
            return
        nonfinite.report(done.datasets or [])
        if not plan.probes:  # (probes=none asks for no layer: no table of them)
            return
        summary = done.summary
        if summary is None:  # (the run makes it before the parts finish)
            raise RuntimeError("the statistics part finished before the summary table was made")
        summary.to_csv(done.run_dir / "summary.csv", index=False)
        if plan.options.print_summary:
            print_summary(summary)


def print_summary(summary: pd.DataFrame) -> None:
    """The summary table through the `probe` logger (the console under the CLI, a notebook's
    log handler under the API)."""
    if summary.empty:
        log.info("summary: no rows (no module was selected)")
        return
    cols = ["layer", "site", "module_type", "shape", "mean", "std", "min", "max", "frac_zero"]
    with pd.option_context("display.max_rows", 200, "display.width", 160, "display.precision", 4):
        log.info("summary:\n%s", summary[cols].to_string(index=False))
