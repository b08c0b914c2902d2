"""The lens and direct logit attribution as a run part: a reader of the residual stream
(probe.attribute.readout) whose hooks hold each forward's states, its rows per sample, and
lens.csv and dla.csv at the finish."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch

from probe.attribute.readout import build_readout, write_readout_tables
from probe.errors import DataError
from probe.hooks.capture import Capture
from probe.hooks.forward import first_output
from probe.hooks.step_context import StepContext
from probe.launch.run_part import Finished, RunPart, RunSetup


class LensReadout(RunPart):
    """`lens=logit|tuned|dla`."""

    name = "lens_readout"

    def __init__(self, readout: Any) -> None:
        self.readout = readout  # a Lens or a DirectLogit

    @classmethod
    def prepare(cls, setup: RunSetup) -> LensReadout | None:
        """The readout the model's anatomy allows (errors name what the model or data lack)."""
        has_answers = getattr(setup.dataset, "answer", None) is not None
        readout = build_readout(setup.plan.lens, setup.model, has_answers)
        return cls(readout) if readout is not None else None

    def loop(self, capture: Capture) -> AbstractContextManager:
        return self.readout

    def before_forward(self, ctx: StepContext) -> None:
        self.readout.begin()

    def after_forward(self, ctx: StepContext) -> None:
        held = self.readout.end()
        inputs = ctx.batch.inputs
        if not isinstance(inputs, dict):  # (a caller's bare tensor: no token layout to read)
            raise DataError(
                f"lens={ctx.plan.lens.name} reads token batches: give each batch as a dict of "
                "input_ids (and attention_mask), not a bare tensor"
            )
        with torch.no_grad():
            ids = inputs["input_ids"]
            logits = first_output(ctx.output).detach()
            rows, once = self.readout.rows(
                held, logits, ids, ctx.tokens, ctx.batch.side, ctx.plan.lens.position
            )
        ctx.outputs.samples.update(rows)
        ctx.outputs.once.update(once)

    def finish(self, done: Finished) -> None:
        write_readout_tables(done.h5_path, done.run_dir)
