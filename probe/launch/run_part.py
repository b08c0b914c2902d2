"""The seam every run part plugs into: what it is given before the loop (`RunSetup`), on each
batch (probe.hooks.step_context's `StepContext`), after the loop (a `Replay` of the run's
batches and the run's `Sink`) and at the end (`Finished`).

A part (`RunPart`: the captures' statistics, the top-k examples, the edits, attribution maps,
SAE splices, a lens, circuits, attribution graphs) checks what the plan alone cannot in `check`
(before the model is built), is made once by `prepare` (its checks that need the model or the
data; the config's own checks stay in probe.plan's parse), set up per run by `start`, attaches
what it keeps to the sink in `open`, enters `edits` (before the capture's hooks) and `loop`
(after them) around the batches, works
on each batch in `before_forward` and `after_forward` (and `handed`, once the sink has the
batch), makes its pass over the batches again in
`after_loop` (every rank, the file still open), and writes its tables in `finish` (the rank that
writes the run's tables). The run reads the parts from a registry (probe.launch.parts) and loops
over those the plan asks for.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch.utils.data import Dataset

from probe.data.batches import RunBatches
from probe.hooks.capture import Capture
from probe.hooks.module_select import Selection
from probe.hooks.objective import Objective
from probe.hooks.record import Record
from probe.hooks.step_context import StepContext
from probe.intervene.edits import Edit
from probe.launch.distributed import Shard
from probe.launch.replay import Replay
from probe.plan import RunPlan
from probe.store.groups import GroupKind
from probe.store.sink import Sink
from probe.store.stats_file import DatasetInfo

if TYPE_CHECKING:
    import pandas as pd


@dataclass
class RunSetup:
    """What a part is given before the loop: the plan, the model (on its device by `start`), this
    rank's batches and the dataset behind them, the selected sites, the edits, the device, the
    objective (None: no backward), the backend of CPU statistics, the rank's shard, and once the
    run starts its directory and file."""

    plan: RunPlan
    model: torch.nn.Module
    batches: RunBatches  # probe.data.batches.OrderedBatches, or a caller's own (probe.run)
    dataset: Dataset | None  # the batches' (its pairs' answers, its token ids; None: a caller's)
    selections: list[Selection]
    edits: list[Edit]
    device: torch.device
    objective: Objective | None = None
    stats_backend: str = "torch"  # what reduces CPU captures (probe.stats.backend)
    shard: Shard | None = None
    run_dir: Path | None = None  # set when the run starts
    h5_path: Path | None = None  # the run's file (a torchrun rank writes beside it)


@dataclass
class Finished:
    """What a part's files are made from once the run's file is closed: the plan, the run's
    directory and file, the run's shard (`world` ranks), and on the rank that writes the tables
    the datasets of the whole run and the summary table."""

    plan: RunPlan
    run_dir: Path
    h5_path: Path
    shard: Shard
    datasets: Iterable[DatasetInfo] | None = None
    summary: pd.DataFrame | None = None  # summary.csv's rows
    counted: bool = True  # whether the run took statistics (stats.during != none)


class RunPart:
    """One capability of a run (the captures' statistics, edits, a lens, ...). Every method has
    a default that does nothing, so a part writes only the steps it takes part in.

    `after`: what it writes after the loop that a torchrun job's stitch takes from the ranks'
    files: a keyed group's kind (concatenated in rank order) or a group's name (written whole,
    taken from rank 0)."""

    name: ClassVar[str] = ""
    after: ClassVar[tuple[GroupKind | str, ...]] = ()

    @classmethod
    def check(cls, plan: RunPlan) -> None:
        """What the plan alone cannot decide (a name a registry knows), before the model is
        built."""

    @classmethod
    def prepare(cls, setup: RunSetup) -> RunPart | None:
        """This run's part (None: the plan does not ask for it), after the checks that need the
        model or the data."""
        return None

    def per_batch(self) -> bool:
        """Whether it works on each batch's forward (a pass after the loop does not: a run whose
        probes capture nothing and whose parts have no per-batch work skips the forward)."""
        return True

    def start(self, setup: RunSetup) -> None:
        """Per run, the model on its device, before the file opens (a pass for baselines)."""

    def attrs(self) -> dict[str, Any]:
        """The run file's attributes this part adds."""
        return {}

    def open(self, sink: Sink) -> None:
        """The run's file is open (a resumed one restored): attach what this part keeps of the
        written batches (probe.store.folds)."""

    def edits(self, capture: Capture) -> AbstractContextManager:
        """Its hooks that change what the model computes, entered before the capture hangs its
        own, so that a probe at the same site records the changed value; they act in the
        capture's passes."""
        return contextlib.nullcontext()

    def loop(self, capture: Capture) -> AbstractContextManager:
        """Entered around the batches (its hooks, after the capture's), given the hook owner of
        the run's sites."""
        return contextlib.nullcontext()

    def before_forward(self, ctx: StepContext) -> None:
        """Before the batch's forward (its own passes; the run's captures are idle)."""

    def after_forward(self, ctx: StepContext) -> None:
        """After the forward (and backward): its rows into `ctx.outputs`, its captures into
        `ctx.captured`, more passes with the hooks idle."""

    def handed(self, record: Record) -> None:
        """The batch's record is in the sink's hands (its rows are kept, whatever follows):
        checks of what it holds."""

    def after_loop(self, replay: Replay, sink: Sink) -> None:
        """Every rank, the loop whole, the file open: a pass over the run's batches again
        (`replay`), writing through `sink`."""

    def finish(self, done: Finished) -> None:
        """The rank that writes the run's tables: this part's files."""
