"""Circuits as a run feature: after the loop, every circuit method's edge scores over the
pairs, the circuits cut and evaluated (probe.launch.circuit_phase), then /circuit, the tables
and figures."""

from __future__ import annotations

from probe.circuits.files import CircuitResult
from probe.hooks.run_feature import Finished, RunFeature, RunSetup
from probe.launch.circuit_phase import (
    CircuitPhase,
    finish_circuits,
    prepare_circuits,
    reuse,
    run_circuits,
)


class CircuitScores(RunFeature):
    """`circuit.method` set (with dataset=pairs)."""

    name = "circuit"

    setup: RunSetup  # this run's, given by `start`
    result: CircuitResult  # the phase's, made by `after_run`

    def __init__(self, phase: CircuitPhase) -> None:
        self.phase = phase

    @classmethod
    def prepare(cls, setup: RunSetup) -> CircuitScores | None:
        """The phase, what the model and the pairs decide checked before the loop."""
        phase = prepare_circuits(setup.plan, setup.model, setup.dataset)
        return cls(phase) if phase is not None else None

    def start(self, setup: RunSetup) -> None:
        self.setup = setup

    def after_run(self, done: Finished) -> None:
        """Score, cut and evaluate on every rank (a resumed run that had finished reuses its
        result)."""
        resume = done.plan.options.resume
        result = resume and reuse(done.run_dir, done.h5_path, self.phase)
        self.result = result or run_circuits(
            self.phase, self.setup, done.shard, done.run_dir, bool(resume)
        )

    def finish(self, done: Finished) -> None:
        finish_circuits(self.result, done.run_dir, done.h5_path, done.shard.world)
