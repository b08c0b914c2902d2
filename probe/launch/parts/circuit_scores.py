"""Circuits as a run part (`circuit.method` set, with dataset=pairs): after the loop, a pass
over the run's batches again scoring every circuit method's edges, the circuits cut and
evaluated (probe.launch.circuit_pass), `/circuit` written through the run's sink; then the
tables and figures."""

from __future__ import annotations

from typing import TYPE_CHECKING

from probe.launch.replay import Replay
from probe.launch.run_part import Finished, RunPart, RunSetup
from probe.plan import RunPlan
from probe.store.sink import Sink

if TYPE_CHECKING:
    from probe.circuits.files import CircuitResult
    from probe.launch.circuit_pass import CircuitPass

# The circuits' machinery (probe.circuits, probe.launch.circuit_pass) is imported where a run
# asks for circuits: every other run's start would import it for nothing.


class CircuitScores(RunPart):
    """`circuit.method` set (with dataset=pairs)."""

    name = "circuit_scores"
    # /circuit (probe.circuits.files.GROUP): the same on every rank, rank 0's in the stitched file
    after = ("circuit",)

    setup: RunSetup  # this run's, given by `start`
    result: CircuitResult  # the pass's, made by `after_loop`

    def __init__(self, circuits: CircuitPass) -> None:
        self.circuits = circuits

    @classmethod
    def check(cls, plan: RunPlan) -> None:
        """Each method of circuit.method known to the registry (probe.circuits.scores.METHODS,
        where `register_method` adds one) and fit for the ablation."""
        if plan.circuit.method:
            from probe.circuits.scores import check_methods

            check_methods(plan.circuit.method, plan.circuit.ablation)

    @classmethod
    def prepare(cls, setup: RunSetup) -> CircuitScores | None:
        """The pass, what the model and the pairs decide checked before the loop."""
        if not setup.plan.circuit.method:
            return None
        from probe.launch.circuit_pass import prepare_circuits

        circuits = prepare_circuits(setup.plan, setup.model, setup.dataset)
        return cls(circuits) if circuits is not None else None

    def per_batch(self) -> bool:
        return False

    def start(self, setup: RunSetup) -> None:
        self.setup = setup

    def after_loop(self, replay: Replay, sink: Sink) -> None:
        """Score, cut and evaluate on every rank (a resumed run that had finished reuses its
        result)."""
        from probe.launch.circuit_pass import reuse, run_circuits

        resume = bool(self.setup.plan.options.resume)
        found = reuse(sink, self.circuits) if resume else None
        self.result = found or run_circuits(self.circuits, replay, sink, self.setup.device, resume)

    def finish(self, done: Finished) -> None:
        from probe.launch.circuit_pass import finish_circuits

        finish_circuits(self.result, done.run_dir, done.h5_path)
