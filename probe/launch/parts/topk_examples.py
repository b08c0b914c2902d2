"""Top-k examples as a run part (`stats.topk`, `stats.bottomk`, `stats.topk_quantiles`): each
capture's examples per unit of a batch found on its own device as the hooks take it, exactly and
without a host sync (probe.hooks.batch_topk), folded into the run's best as their batch is
written (probe.store.folds.ExamplesFold, /topk beside /stats)."""

from __future__ import annotations

import torch

from probe.errors import ConfigError
from probe.hooks.batch_topk import BatchExamples, TopKSpec, partial, row_keys
from probe.hooks.capture import BatchCapture, Capture, Key
from probe.hooks.module_select import Selection
from probe.hooks.step_context import StepContext
from probe.launch.run_part import RunPart, RunSetup
from probe.plan import RunPlan
from probe.store.folds import ExamplesFold
from probe.store.sink import Sink


def examples_spec(plan: RunPlan) -> TopKSpec | None:
    """What stats.topk, stats.bottomk and stats.topk_quantiles ask to keep (None: nothing)."""
    s = plan.stats
    spec = TopKSpec(s.topk, s.bottomk, s.topk_quantiles, plan.options.seed)
    return spec if spec.sizes() and s.during != "none" else None


class TopkExamples(RunPart):
    """The examples per unit of every capture."""

    name = "topk_examples"

    def __init__(self, spec: TopKSpec, during: str, rows: int, first: int, selected: bool) -> None:
        self.spec, self.during, self.selected = spec, during, selected
        self.rows, self.first = rows, first  # the samples the run visits, its first one's index
        self.partials: dict[Key, BatchExamples] = {}  # this batch's

    @classmethod
    def prepare(cls, setup: RunSetup) -> TopkExamples | None:
        spec = examples_spec(setup.plan)
        if spec is None:
            return None
        shard = setup.shard
        rows = shard.dataset_samples if shard is not None else 0
        first = shard.samples.start if shard is not None else 0
        return cls(spec, setup.plan.stats.during, rows, first, bool(setup.selections))

    def per_batch(self) -> bool:
        return self.selected

    def open(self, sink: Sink) -> None:
        sink.attach(ExamplesFold(self.spec, self.during))

    def loop(self, capture: Capture):
        if self.during == "run":
            capture.listen(self)
        return super().loop(capture)

    def before_forward(self, ctx: StepContext) -> None:
        self.partials = {}

    def took(self, key: Key, value: torch.Tensor, axis: int, sel: Selection,
             batch: BatchCapture) -> None:  # fmt: skip
        """The batch's best rows per unit of one capture, on its device (the one place they are
        found)."""
        by_token = key in batch.token_keys
        found = row_keys(value, axis, batch.start, batch.tokens, by_token)
        if batch.start == self.first:  # (judged once, on the first batch's rows)
            check_examples(self.spec, self.rows * len(found[1]) // max(batch.size, 1), key)
        self.partials[key] = BatchExamples(partial(*found, self.spec))

    def after_forward(self, ctx: StepContext) -> None:
        if self.during == "run":
            ctx.outputs.folds[self.name] = self.partials


def check_examples(spec: TopKSpec, rows: int, key: Key) -> None:
    """More examples per unit than the run has rows (with their positions) cannot be kept."""
    for name, k in (("stats.topk", spec.top), ("stats.bottomk", spec.bottom)):
        if k > rows:
            raise ConfigError(
                f"{name}={k} is more than the {rows} rows (samples x positions) layer "
                f"{key[0]!r} {key[1]} gives in this run; ask for at most {rows}"
            )
