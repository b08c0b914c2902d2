"""The seam every run feature plugs into: what it is given before the loop (`RunSetup`), on each
batch (`StepContext`) and at the end (`Finished`), and what it hands the writer (`Outputs`).

A feature (`RunFeature`) is made once before the loop by `prepare` (its checks that need the
model or the data; the config's own checks stay in probe.plan's parse), set up per run by
`start`, enters `loop` around the batches with the hook owner, works on each batch in
`before_forward` and `after_forward`, and writes its files in `after_run` (every rank, the file
closed) and `finish` (the rank that writes the run's tables). The run reads the features from a
registry (probe.launch.features) and loops over those the plan asks for.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from probe.data.batches import Batch
from probe.hooks.capture import Capture
from probe.layout import TokenBatch
from probe.plan import RunPlan

Key = tuple[str, str]  # (layer, site): a capture's dataset


@dataclass
class Outputs:
    """What one batch hands the writer beside its captures, by dataset name.

    `samples`: tensors of one row per sample (/model/output, /lens/*, /effects/*);
    `examples`: per capture and kind the examples per unit of this batch, (values, keys)
    (probe.stats.topk); both copied to the host with the captures, without waiting
    (probe.hooks.device.to_host), where they lie on a GPU. `batches`: host arrays of one row
    for this batch (/effects/batch); `once`: host arrays written whole with the first batch
    that brings them (a lens's layer names)."""

    samples: dict[str, torch.Tensor] = field(default_factory=dict)
    batches: dict[str, np.ndarray] = field(default_factory=dict)
    once: dict[str, np.ndarray] = field(default_factory=dict)
    examples: dict[Key, dict[str, Any]] = field(default_factory=dict)


@dataclass
class RunSetup:
    """What a feature is given before the loop: the plan, the model (on its device by `start`),
    the batches and their dataset, the selected sites, the edits, the device and the objective
    (None: no backward)."""

    plan: RunPlan
    model: torch.nn.Module
    batches: Any  # probe.data.batches.OrderedBatches (or a shard's)
    dataset: Any
    selections: list
    edits: list
    device: torch.device
    objective: Any = None
    shard: Any = None  # probe.launch.distributed.Shard
    run_dir: Path | None = None  # set when the run starts
    h5_path: Path | None = None  # the run's file (a torchrun rank writes beside it)


@dataclass
class StepContext:
    """One batch as every feature sees it: the model, the batch (the run's own half of a pair,
    `source` the other half's inputs), its inputs and token layout on the device, the hook owner
    and this batch's captures, the forward's output and objective, and the outputs the batch
    hands the writer. Features may keep what they need between their two calls on `state`."""

    plan: RunPlan
    model: torch.nn.Module
    device: torch.device
    capture: Capture  # the hook owner of the run's sites
    index: int
    batch: Batch
    source: dict | None  # the other half of a pairs batch (probe.intervene.passes.split_pair)
    inputs: Any  # the batch's inputs on the device
    targets: torch.Tensor | None
    tokens: TokenBatch | None  # on the device (None: not a token batch)
    objective: Any = None  # what the backward explains (None: no backward)
    captured: Any = None  # this batch's captures (probe.hooks.capture.BatchCapture)
    output: Any = None  # the model's output
    scores: torch.Tensor | None = None  # the objective per sample (with a backward)
    side: dict = field(default_factory=dict)  # the batch's side inputs the objective read
    grads: dict = field(default_factory=dict)  # per-batch captures (parameter gradients)
    outputs: Outputs = field(default_factory=Outputs)
    state: dict[str, Any] = field(default_factory=dict)  # by feature name, within the batch

    @property
    def precision(self) -> str:
        return self.plan.options.precision

    @property
    def model_output(self) -> str:
        return self.plan.store.model_output


@dataclass
class Finished:
    """What a feature's files are made from once the run's file is closed: the plan, the run's
    directory and file, the run's shard (`world` ranks), and on the rank that writes the tables
    the datasets of the whole run and the summary table."""

    plan: RunPlan
    run_dir: Path
    h5_path: Path
    shard: Any
    datasets: Iterable | None = None  # probe.store.stats_file.DatasetInfo of every dataset
    summary: Any = None  # pandas.DataFrame: summary.csv's rows
    counted: bool = True  # whether the run took statistics (stats.during != none)


class RunFeature:
    """One capability of a run (captures' statistics, edits, a lens, ...). Every method has a
    default that does nothing, so a feature writes only the steps it takes part in."""

    name: ClassVar[str] = ""

    @classmethod
    def prepare(cls, setup: RunSetup) -> RunFeature | None:
        """This run's feature (None: the plan does not ask for it), after the checks that need
        the model or the data."""
        return None

    def start(self, setup: RunSetup) -> None:
        """Per run, the model on its device, before the file opens (a pass for baselines)."""

    def attrs(self) -> dict[str, Any]:
        """The run file's attributes this feature adds."""
        return {}

    def loop(self, capture: Capture) -> AbstractContextManager:
        """Entered around the batches (its hooks), given the hook owner of the run's sites."""
        return contextlib.nullcontext()

    def before_forward(self, ctx: StepContext) -> None:
        """Before the batch's forward (its own passes; the run's captures are idle)."""

    def after_forward(self, ctx: StepContext) -> None:
        """After the forward (and backward): its rows into `ctx.outputs`, its captures into
        `ctx.captured`, more passes with the hooks idle."""

    def after_run(self, done: Finished) -> None:
        """Every rank, the loop whole and the file closed (a phase after the loop)."""

    def finish(self, done: Finished) -> None:
        """The rank that writes the run's tables: this feature's files."""
