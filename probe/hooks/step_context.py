"""One batch as every run part sees it (`StepContext`), and what the batch hands the run's sink
beside its captures (`Outputs`): named rows, arrays written once, and each part's partials to
fold. The parts themselves are probe.launch.run_part's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from probe.data.batches import Batch
from probe.hooks.capture import BatchCapture, Capture
from probe.hooks.objective import Objective
from probe.layout import TokenBatch
from probe.plan import RunPlan

Key = tuple[str, str]  # (layer, site): a capture's dataset


@runtime_checkable
class Partial(Protocol):
    """A part's partial of one batch that may lie on a GPU (a capture's statistics reduced on
    its device, its examples per unit): its tensors are copied to the host with the captures,
    without waiting, and `on_host` makes the partial of those copies (readable once the
    record's event has fired)."""

    def tensors(self) -> dict[str, torch.Tensor]: ...

    def on_host(self, tensors: dict[str, torch.Tensor]) -> Partial: ...


@dataclass
class Outputs:
    """What one batch hands the sink beside its captures, by dataset name.

    `samples`: tensors of one row per sample (/model/output, /lens/*, /effects/*), copied to
    the host with the captures (probe.hooks.device.to_host) where they lie on a GPU;
    `batches`: host arrays of one row for this batch (/effects/batch); `once`: host arrays
    written whole with the first batch that brings them (a lens's layer names); `folds`: by
    fold name (probe.store.folds), each capture's partial of this batch (a `Partial`, or a
    host value), folded in as the batch is written."""

    samples: dict[str, torch.Tensor] = field(default_factory=dict)
    batches: dict[str, np.ndarray] = field(default_factory=dict)
    once: dict[str, np.ndarray] = field(default_factory=dict)
    folds: dict[str, dict[Key, Any]] = field(default_factory=dict)


@dataclass
class StepContext:
    """One batch as every part sees it: the model, the batch (the run's own half of a pair,
    `source` the other half's inputs), its inputs and token layout on the device, the hook owner
    and this batch's captures, the forward's output and objective, and the outputs the batch
    hands the sink. Parts may keep what they need between their two calls on `state`."""

    plan: RunPlan
    model: torch.nn.Module
    device: torch.device
    capture: Capture  # the hook owner of the run's sites
    index: int
    batch: Batch
    # the other half of a pairs batch (probe.intervene.passes.split_pair)
    source: dict[str, torch.Tensor] | None
    inputs: torch.Tensor | dict[str, torch.Tensor]  # the batch's inputs on the device
    targets: torch.Tensor | None
    tokens: TokenBatch | None  # on the device (None: not a token batch)
    objective: Objective | None = None  # what the backward explains (None: no backward)
    captured: BatchCapture | None = None  # this batch's captures (`batch_capture`)
    output: Any = None  # the model's output (a tensor, a tuple, a ModelOutput)
    scores: torch.Tensor | None = None  # the objective per sample (with a backward)
    side: dict = field(default_factory=dict)  # the batch's side inputs the objective read
    grads: dict[Key, torch.Tensor] = field(default_factory=dict)  # per-batch parameter gradients
    outputs: Outputs = field(default_factory=Outputs)
    state: dict[str, Any] = field(default_factory=dict)  # by part name, within the batch

    def batch_capture(self) -> BatchCapture:
        """This batch's captures, which the run begins before the forward (a part reads them in
        `after_forward`)."""
        if self.captured is None:
            raise RuntimeError("a batch's captures read before its forward began them")
        return self.captured

    @property
    def precision(self) -> str:
        return self.plan.options.precision

    @property
    def model_output(self) -> str:
        return self.plan.store.model_output
