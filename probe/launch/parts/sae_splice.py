"""SAE splices as a run part: each spliced SAE's extra forwards per batch
(probe.intervene.splice), sae.csv and sae_tokens.npz once the loop is done."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from probe.hooks import device as devices
from probe.hooks.capture import Capture
from probe.hooks.sae_site import sae_site
from probe.hooks.step_context import StepContext
from probe.intervene.splice import SpliceReport
from probe.launch.run_part import RunPart, RunSetup

log = logging.getLogger("probe")


class SaeSplice(RunPart):
    """A run whose probes load SAEs (`probes.<name>.sae`)."""

    name = "sae_splice"

    report: SpliceReport  # this loop's, made by `loop`
    model: torch.nn.Module
    folder: Path  # the run file's folder (a torchrun rank's too)

    @classmethod
    def prepare(cls, setup: RunSetup) -> SaeSplice | None:
        return cls() if any(sae_site(s) is not None for s in setup.selections) else None

    def start(self, setup: RunSetup) -> None:
        self.model = setup.model
        self.folder = setup.h5_path.parent if setup.h5_path is not None else Path(".")

    @contextlib.contextmanager
    def loop(self, capture: Capture) -> Iterator[None]:
        """The report of this run's SAEs; once the loop is done (a signal's stop too) sae.csv
        and the promoted examples, each rank its own (a torchrun job's are not merged)."""
        self.report = SpliceReport(capture)
        yield
        table = self.report.table()
        table.to_csv(self.folder / "sae.csv", index=False)
        log.info("wrote %s (%d layers with an SAE)", self.folder / "sae.csv", len(table))
        promoted = self.report.promoted(self.model)
        if promoted:  # (feature cards show them: probe.report.cards)
            # numpy's stub lets ** fill savez's allow_pickle (a bool); the keys are layer names
            np.savez(self.folder / "sae_tokens.npz", **promoted)  # type: ignore[arg-type]

    def after_forward(self, ctx: StepContext) -> None:
        """More forwards, recording nothing: each spliced SAE alone, its layer zeroed, clean."""
        precision = functools.partial(devices.autocast, ctx.device, ctx.precision)
        b = ctx.batch
        self.report.measure(ctx.model, ctx.inputs, ctx.tokens, b.size, b.start, precision)
