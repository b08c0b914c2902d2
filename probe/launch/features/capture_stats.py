"""Captures and statistics as a run feature: the statistics of the per-batch gradients where
they lie (a GPU), and summary.csv at the finish."""

from __future__ import annotations

import logging

import pandas as pd

from probe.hooks.run_feature import Finished, RunFeature, RunSetup, StepContext

log = logging.getLogger("probe")


class CaptureStats(RunFeature):
    """Every run's: the hook owner's captures reduced to statistics (in the hooks, or by the
    writer), and their table."""

    name = "statistics"

    @classmethod
    def prepare(cls, setup: RunSetup) -> CaptureStats:
        return cls()

    def after_forward(self, ctx: StepContext) -> None:
        """Parameter gradients' statistics on their device too, where the hooks reduce there."""
        capture, observed = ctx.capture, ctx.captured.observed
        if capture.observe_device:
            for key, t in ctx.grads.items():
                if not t.is_cpu:
                    observed[key] = capture.observe(key, t, 1)

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
        if not plan.probes:  # (probes=none asks for no layer: no table of them)
            return
        done.summary.to_csv(done.run_dir / "summary.csv", index=False)
        if plan.options.print_summary:
            print_summary(done.summary)


def print_summary(summary: pd.DataFrame) -> None:
    """The summary table through the `probe` logger (the console under the CLI, a notebook's
    log handler under the API)."""
    if summary.empty:
        log.info("summary: no rows (no module was selected)")
        return
    cols = ["layer", "site", "module_type", "shape", "mean", "std", "min", "max", "frac_zero"]
    with pd.option_context("display.max_rows", 200, "display.width", 160, "display.precision", 4):
        log.info("summary:\n%s", summary[cols].to_string(index=False))
