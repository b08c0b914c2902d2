"""Top-k examples as a run feature: each batch's examples per unit (taken in the hooks,
probe.hooks.batch_topk) handed to the writer, which keeps the run's best with the statistics."""

from __future__ import annotations

from probe.hooks.batch_topk import TopKSpec
from probe.hooks.run_feature import RunFeature, RunSetup, StepContext
from probe.plan import RunPlan


def examples_spec(plan: RunPlan) -> TopKSpec | None:
    """What stats.topk, stats.bottomk and stats.topk_quantiles ask to keep (None: nothing)."""
    s = plan.stats
    spec = TopKSpec(s.topk, s.bottomk, s.topk_quantiles, plan.options.seed)
    return spec if spec.sizes() and s.during != "none" else None


class TopkExamples(RunFeature):
    """`stats.topk`, `stats.bottomk`, `stats.topk_quantiles`."""

    name = "examples"

    @classmethod
    def prepare(cls, setup: RunSetup) -> TopkExamples | None:
        return cls() if examples_spec(setup.plan) is not None else None

    def after_forward(self, ctx: StepContext) -> None:
        """The batch's (values, keys) per dataset and kind, copied to the host with the
        captures."""
        for key, kinds in ctx.captured.topk_partials.items():
            ctx.outputs.examples[key] = dict(kinds)
