"""Attribution maps and integrated gradients as a run part: each batch's maps from the
backward's gradients (probe.attribute.maps), ig_output from more passes with the hooks idle
(probe.attribute.integrated), and attribution.csv at the finish."""

from __future__ import annotations

import logging

from probe.attribute.integrated import Integrated, baselines
from probe.attribute.maps import take_maps
from probe.attribute.table import attribution_table
from probe.hooks.step_context import StepContext
from probe.launch.run_part import Finished, RunPart, RunSetup

log = logging.getLogger("probe")


class AttributionMaps(RunPart):
    """A run with a backward (an objective): its attribution sites."""

    name = "attribution_maps"

    def __init__(self) -> None:
        self.integrated: Integrated | None = None

    @classmethod
    def prepare(cls, setup: RunSetup) -> AttributionMaps | None:
        return cls() if setup.objective is not None else None

    def start(self, setup: RunSetup) -> None:
        """ig_output's baselines (attribution.baseline=mean takes a pass over the batches)."""
        self.integrated = None
        if any("ig_output" in s.sites for s in setup.selections):
            a, plan = setup.plan.attribution, setup.plan
            base = baselines(
                a, setup.model, setup.batches, setup.selections, setup.device,
                plan.options.precision,
            )  # fmt: skip
            self.integrated = Integrated(a.steps, a.method, a.internal_batch_size, base)

    def after_forward(self, ctx: StepContext) -> None:
        captured = ctx.batch_capture()
        take_maps(captured, ctx.tokens)
        if self.integrated is not None and captured.attributed:  # (more forwards, hooks idle)
            self.integrated.take(
                captured, ctx, ctx.inputs, ctx.targets, ctx.tokens, ctx.side, ctx.scores
            )

    def finish(self, done: Finished) -> None:
        if not (done.counted and done.plan.probes):
            return
        attributions = attribution_table(done.datasets)
        if len(attributions):
            attributions.to_csv(done.run_dir / "attribution.csv", index=False)
            log.info("wrote %s (%d sites)", done.run_dir / "attribution.csv", len(attributions))
