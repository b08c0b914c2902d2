"""One batch of a run: its inputs to the device, the forward (and backward) through the hooks
wrapped by the run's parts (probe.launch.run_part), and the Record the sink takes."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from probe.hooks import device as devices
from probe.hooks.backward import resolve_grads
from probe.hooks.capture import Capture
from probe.hooks.forward import call, output_rows, to_device, token_batch
from probe.hooks.objective import per_sample
from probe.hooks.record import Record
from probe.hooks.step_context import Outputs, Partial, StepContext
from probe.intervene.passes import split_pair
from probe.launch.run_part import RunPart, RunSetup


@dataclass
class Prepared:
    """What a run needs before its loop: built once, so a benchmark can repeat the loop alone.
    `setup`: the model, this rank's batches, the selected sites, the edits, the objective, the
    device, the shard; `parts`: the run parts the plan asks for, in the registry's order
    (probe.launch.parts; None: made as the run starts)."""

    setup: RunSetup
    parts: list[RunPart] | None = None

    @property
    def model(self) -> torch.nn.Module:
        return self.setup.model

    @property
    def batches(self) -> Iterable:
        return self.setup.batches

    @property
    def selections(self) -> list:
        return self.setup.selections

    @property
    def device(self) -> torch.device:
        return self.setup.device


def run_batch(setup: RunSetup, parts: list[RunPart], capture: Capture, batch, index: int) -> Record:
    """Forward (and backward when a gradient site is asked for) one batch; return its captures
    and the parts' outputs. Each part's `before_forward` runs before it (in the registry's
    order), its `after_forward` after it (in the reverse order)."""
    plan, model, device, objective = setup.plan, setup.model, setup.device, setup.objective
    precision = plan.options.precision
    batch, source = split_pair(batch, plan.intervene.direction)
    inputs = to_device(model, batch.inputs, device, non_blocking=True)
    targets = batch.targets.to(device, non_blocking=True) if batch.targets is not None else None
    host_tokens = token_batch(batch.inputs)
    tokens = host_tokens.to(device) if host_tokens is not None else None
    ctx = StepContext(plan, model, device, capture, index, batch, source, inputs, targets, tokens,
                      objective)  # fmt: skip
    for part in parts:
        part.before_forward(ctx)
    captured = ctx.captured = capture.begin(batch.size, batch.start, tokens)
    try:
        if objective is None:
            with torch.inference_mode(), devices.autocast(device, precision):
                ctx.output = call(model, inputs)
        else:
            with torch.enable_grad():
                if not isinstance(inputs, dict):  # (token ids are integers: no gradient)
                    inputs = ctx.inputs = inputs.detach().requires_grad_(True)
                with devices.autocast(device, precision):
                    ctx.output = call(model, inputs)
                    ctx.side = dict(batch.side)  # (objective.index=predicted adds its argmax)
                    ctx.scores = per_sample(
                        objective, ctx.output, targets, inputs, tokens, ctx.side
                    )
                ctx.grads = resolve_grads(captured, ctx.scores.sum(), setup.selections)
    finally:
        capture.end()
    ctx.outputs.samples.update(output_rows(ctx.output, ctx.model_output, batch.size, tokens))
    for part in reversed(parts):
        part.after_forward(ctx)
    return _record(ctx, host_tokens)


def samples_only(batch, index: int) -> Record:
    """A batch's record without a forward (a run whose parts all work after the loop): its
    samples' rows alone (/samples/index, targets, names)."""
    return Record(batch.start, batch.size, index, {}, targets=batch.targets)


def _record(ctx: StepContext, host_tokens) -> Record:
    """The batch's captures and outputs, the device's ones copied to the host without waiting
    (one event for all of them: probe.hooks.device.to_host)."""
    captured, batch, outputs = ctx.captured, ctx.batch, ctx.outputs
    if captured is None:
        raise RuntimeError("a batch's record before its forward")
    on_device = {
        (name, key, part): t
        for name, partials in outputs.folds.items()
        for key, p in partials.items()
        if isinstance(p, Partial)
        for part, t in p.tensors().items()
    }
    grads = ctx.grads
    if not captured.keep_values:  # (store.mode=stats: reduced where they lie; their layouts go)
        grads = {key: captured.layout(key, g) for key, g in grads.items()}
    (values, per_batch, host, outputs.samples), ready = devices.to_host(
        captured.values, grads, on_device, outputs.samples
    )
    outputs.folds = _on_host(outputs, host)
    tokens = None
    inputs = batch.inputs  # (a dict where there are host tokens: probe.hooks.forward.token_batch)
    if (
        host_tokens is not None
        and isinstance(inputs, dict)
        and any(s.rows == "tokens" for s in ctx.capture.selections)
    ):
        tokens = host_tokens.rows(inputs["input_ids"], batch.start, batch.side.get("token_labels"))
    release = functools.partial(ctx.capture.pool.give, captured.pooled) if captured.pooled else None
    return Record(
        batch.start, batch.size, ctx.index, values, per_batch, batch.targets, outputs, ready,
        release, captured.axes, tokens, captured.token_keys, captured.unstored, captured.plain,
    )  # fmt: skip


def _on_host(outputs: Outputs, host: dict) -> dict:
    """The parts' partials over their host copies (readable once the record's event fired)."""
    folds = {}
    for name, partials in outputs.folds.items():
        folds[name] = {
            key: p.on_host({part: host[name, key, part] for part in p.tensors()})
            if isinstance(p, Partial)
            else p
            for key, p in partials.items()
        }
    return folds
