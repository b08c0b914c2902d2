"""One batch of a run: its inputs to the device, the forward (and backward) through the hooks
wrapped by the run's features (probe.hooks.run_feature), and the Record the writer takes."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from probe.hooks import device as devices
from probe.hooks.backward import resolve_grads
from probe.hooks.capture import Capture
from probe.hooks.forward import call, output_rows, to_device, token_batch
from probe.hooks.objective import per_sample
from probe.hooks.record import Record
from probe.hooks.run_feature import RunFeature, StepContext
from probe.intervene.passes import split_pair
from probe.plan import RunPlan
from probe.stats.backend import DeviceStats


@dataclass
class Prepared:
    """What a run needs before its loop: built once, so a benchmark can repeat the loop alone.
    `features`: the run features the plan asks for, in the registry's order
    (probe.launch.features)."""

    model: torch.nn.Module
    batches: Iterable
    selections: list
    objective: object
    device: torch.device
    edits: list = field(default_factory=list)
    shard: object = None  # probe.launch.distributed.Shard
    stats_backend: str | None = (
        None  # what reduces captures (probe.stats.backend); None: stats.backend
    )
    features: list[RunFeature] | None = None  # None: the registry's, prepared as the run starts


@dataclass
class BatchStep:
    """What every batch of a run goes through: what was prepared, the hooks, the plan, and
    which half of a pairs batch is the run's own input (`direction`: denoise, the corrupt one)."""

    prepared: Prepared
    capture: Capture
    plan: RunPlan
    direction: str = "noise"


def run_batch(step: BatchStep, batch, index: int) -> Record:
    """Forward (and backward when a gradient site is asked for) one batch; return its captures
    and the features' outputs. Each feature's `before_forward` runs before it (in the registry's
    order), its `after_forward` after it (in the reverse order)."""
    p, capture, plan = step.prepared, step.capture, step.plan
    model, device, objective, features = p.model, p.device, p.objective, p.features or []
    precision = plan.options.precision
    batch, source = split_pair(batch, step.direction)
    inputs = to_device(model, batch.inputs, device, non_blocking=True)
    targets = batch.targets.to(device, non_blocking=True) if batch.targets is not None else None
    host_tokens = token_batch(batch.inputs)
    tokens = host_tokens.to(device) if host_tokens is not None else None
    ctx = StepContext(plan, model, device, capture, index, batch, source, inputs, targets, tokens,
                      objective)  # fmt: skip
    for f in features:
        f.before_forward(ctx)
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
                ctx.grads = resolve_grads(captured, ctx.scores.sum(), p.selections)
    finally:
        capture.end()
    ctx.outputs.samples.update(output_rows(ctx.output, ctx.model_output, batch.size, tokens))
    for f in reversed(features):
        f.after_forward(ctx)
    return _record(ctx, host_tokens)


def _record(ctx: StepContext, host_tokens) -> Record:
    """The batch's captures and outputs, the device's ones copied to the host without waiting
    (one event for all of them: probe.hooks.device.to_host)."""
    captured, batch, outputs = ctx.captured, ctx.batch, ctx.outputs
    observed = captured.observed
    on_device = {k: v.packed for k, v in observed.items() if isinstance(v, DeviceStats)}
    examples = {
        (key, kind, i): t
        for key, kinds in outputs.examples.items()
        for kind, pair in kinds.items()
        for i, t in enumerate(pair)
    }
    (values, per_batch, host_stats, examples, outputs.samples), ready = devices.to_host(
        captured.values, ctx.grads, on_device, examples, outputs.samples
    )
    for key, packed in host_stats.items():  # readable once `ready` has fired
        observed[key].packed = packed
    outputs.examples = {}
    for (key, kind, i), t in examples.items():  # readable once `ready` has fired
        pair = outputs.examples.setdefault(key, {}).setdefault(kind, [None, None])
        pair[i] = t
    tokens = None
    if host_tokens is not None and any(s.rows == "tokens" for s in ctx.capture.selections):
        tokens = host_tokens.rows(
            batch.inputs["input_ids"], batch.start, batch.side.get("token_labels")
        )
    release = functools.partial(ctx.capture.pool.give, captured.pooled) if captured.pooled else None
    return Record(
        batch.start, batch.size, ctx.index, values, per_batch, batch.targets, outputs, ready,
        observed, release, captured.axes, tokens, captured.token_keys, captured.unstored,
        captured.plain,
    )  # fmt: skip
