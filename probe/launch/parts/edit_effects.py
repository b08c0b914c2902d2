"""Edits and their effects, the patching grid and attribution patching as a run part: the
means a `mean` edit takes from a first pass over the data, the passes before each edited
forward and what they measure (probe.intervene.passes), effects.csv or patching.csv at the
finish."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from probe.hooks.capture import Capture
from probe.hooks.step_context import StepContext
from probe.intervene.edit_hooks import EditHooks
from probe.intervene.edits import Edit, first_pass_means
from probe.intervene.passes import Interventions, direction_of
from probe.launch.run_part import Finished, RunPart, RunSetup


class EditEffects(RunPart):
    """A run with edits or a patching grid (`intervene.*`)."""

    name = "edit_effects"
    interventions: Interventions  # this run's, made by `start`
    declared: list[Edit]  # the run's edits, bound to the model, given by `start`

    @classmethod
    def prepare(cls, setup: RunSetup) -> EditEffects | None:
        """The part, where a patch from the pair has pairs to take it from."""
        plan = setup.plan
        if not setup.edits and plan.intervene.grid is None:
            return None
        direction_of(plan.intervene, plan.data.name == "pairs")
        return cls()

    def start(self, setup: RunSetup) -> None:
        """The means `op=mean source=first_pass` edits take (a clean pass over the data), and
        the passes of this run (their state is the run's: made again for each)."""
        first_pass_means(setup.model, setup.batches, setup.edits, setup.device)
        self.declared = setup.edits
        plan = setup.plan
        tokenizer = plan.data.tokenizer or plan.model.name
        is_pairs = plan.data.name == "pairs"
        found = Interventions.of(
            setup.model, setup.edits, plan.intervene, setup.dataset, is_pairs, tokenizer
        )
        if found is None:  # (prepare asked for edits or a grid: `of` makes one)
            raise RuntimeError("intervene: edits or a grid were asked for and none was made")
        self.interventions = found

    def attrs(self) -> dict[str, Any]:
        return self.interventions.attrs()

    def edits(self, capture: Capture) -> AbstractContextManager:
        """The edits' hooks, acting in the capture's passes, before it records."""
        return EditHooks(self.declared, capture)

    def loop(self, capture: Capture) -> AbstractContextManager:
        """The hooks of the passes before the edited one, and of the grid."""
        return self.interventions

    def before_forward(self, ctx: StepContext) -> None:
        ctx.state[self.name] = self.interventions.before(ctx)

    def after_forward(self, ctx: StepContext) -> None:
        interventions = self.interventions
        ctx.outputs.samples.update(interventions.after(ctx.state[self.name], ctx))
        ctx.outputs.batches.update(interventions.batch_rows)
        interventions.batch_rows = {}
        interventions.release()

    def finish(self, done: Finished) -> None:
        self.interventions.report(done.h5_path, done.run_dir)
