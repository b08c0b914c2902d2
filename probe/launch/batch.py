"""One batch of a run: its inputs to the device, the edits' passes before it, the forward (and
backward) through the hooks, and the Record the writer takes."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from probe.attribute.integrated import Integrated
from probe.attribute.maps import take_maps
from probe.hooks import device as devices
from probe.hooks.backward import resolve_grads
from probe.hooks.capture import Capture
from probe.hooks.forward import call, first_output, output_rows, to_device, token_batch
from probe.hooks.objective import per_sample
from probe.hooks.record import Record
from probe.intervene.passes import Interventions, split_pair
from probe.plan import RunPlan
from probe.stats.backend import DeviceStats


@dataclass
class Prepared:
    """What a run needs before its loop: built once, so a benchmark can repeat the loop alone."""

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
    integrated: Integrated | None = None  # made by the run (its baselines may need a pass)
    readout: object = None  # the lens or direct logit attribution (probe.attribute.readout)
    circuit: object = None  # probe.launch.circuit_phase.CircuitPhase: edge scores after the loop


@dataclass
class BatchStep:
    """What every batch of a run goes through: what was prepared (the model on its device, the
    selections, the objective, integrated gradients, the readout), the hooks, the edits' passes,
    and the plan's word on how the forward runs (precision, store.model_output, lens.position)."""

    prepared: Prepared
    capture: Capture
    plan: RunPlan
    interventions: Interventions | None = None
    splice: object = None  # the spliced SAEs' extra forwards (probe.intervene.splice)

    model = property(lambda self: self.prepared.model)
    selections = property(lambda self: self.prepared.selections)
    device = property(lambda self: self.prepared.device)
    objective = property(lambda self: self.prepared.objective)
    integrated = property(lambda self: self.prepared.integrated)
    readout = property(lambda self: self.prepared.readout)
    precision = property(lambda self: self.plan.options.precision)
    model_output = property(lambda self: self.plan.store.model_output)
    position = property(lambda self: self.plan.lens.position)  # where a readout reads the answer


def run_batch(step: BatchStep, batch, index: int) -> Record:
    """Forward (and backward when a gradient site is asked for) one batch; return its captures.

    With edits, the same batch first runs clean (hooks idle) so the edit's effect on the output
    can be measured in the same run.
    """
    model, capture, selections, device = step.model, step.capture, step.selections, step.device
    objective, interventions, precision = step.objective, step.interventions, step.precision
    model_output = step.model_output
    batch, source = split_pair(batch, interventions.direction if interventions else "noise")
    size = batch.size
    inputs = to_device(model, batch.inputs, device, non_blocking=True)
    targets = batch.targets.to(device, non_blocking=True) if batch.targets is not None else None
    host_tokens = token_batch(batch.inputs)
    tokens = host_tokens.to(device) if host_tokens is not None else None
    passes = None
    if interventions is not None:
        passes = interventions.before(model, batch, inputs, source, tokens, device, precision)
    captured = capture.begin(size, batch.start, tokens)
    per_batch, held = {}, None
    if step.readout is not None:
        step.readout.begin()
    try:
        if objective is None:
            with torch.inference_mode(), devices.autocast(device, precision):
                output = call(model, inputs)
        else:
            with torch.enable_grad():
                if not isinstance(inputs, dict):  # (token ids are integers: no gradient)
                    inputs = inputs.detach().requires_grad_(True)
                with devices.autocast(device, precision):
                    output = call(model, inputs)
                    side = dict(batch.side)  # (objective.index=predicted adds its argmax)
                    scores = per_sample(objective, output, targets, inputs, tokens, side)
                per_batch = resolve_grads(captured, scores.sum(), selections)
            take_maps(captured, tokens)
    finally:
        capture.end()
        if step.readout is not None:
            held = step.readout.end()
    if step.splice is not None:  # (more forwards, recording nothing)
        ctx = functools.partial(devices.autocast, device, precision)
        step.splice.measure(model, inputs, tokens, size, batch.start, ctx)
    if step.integrated is not None and captured.attributed:  # (more forwards, hooks idle)
        step.integrated.take(captured, step, inputs, targets, tokens, side, scores)
    extra = output_rows(output, model_output, size, tokens)
    once = {}
    if step.readout is not None:
        with torch.no_grad():
            ids = batch.inputs["input_ids"]
            rows, once = step.readout.rows(
                held, first_output(output).detach(), ids, tokens, batch.side, step.position
            )
        extra.update(rows)
    if passes is not None:
        run = (model, device, precision, capture)
        extra.update(interventions.after(passes, output, batch, inputs, tokens, model_output, run))
        batch_rows, interventions.batch_rows = interventions.batch_rows, {}
        interventions.release()
    observed = captured.observed
    if capture.observe_device:  # parameter gradients' statistics too, where they lie
        for key, t in per_batch.items():
            if not t.is_cpu:
                observed[key] = capture.observe(key, t, 1)
    on_device = {k: v.packed for k, v in observed.items() if isinstance(v, DeviceStats)}
    examples = {
        (key, kind, i): t
        for key, kinds in captured.topk_partials.items()
        for kind, pair in kinds.items()
        for i, t in enumerate(pair)
    }
    (values, per_batch, host_stats, examples), ready = devices.to_host(
        captured.values, per_batch, on_device, examples
    )
    for key, packed in host_stats.items():  # readable once `ready` has fired
        observed[key].packed = packed
    record = Record(batch.start, size, index, values, per_batch, batch.targets, extra, ready)
    record.batch_rows = batch_rows if passes is not None else {}
    record.counted = observed
    record.axes = captured.axes
    record.token_keys = captured.token_keys
    record.unstored, record.plain = captured.unstored, captured.plain
    record.once = once
    for (key, kind, i), t in examples.items():  # readable once `ready` has fired
        pair = record.topk.setdefault(key, {}).setdefault(kind, [None, None])
        pair[i] = t
    if host_tokens is not None and any(s.rows == "tokens" for s in selections):
        record.tokens = host_tokens.rows(
            batch.inputs["input_ids"], batch.start, batch.side.get("token_labels")
        )
    if captured.pooled:
        record.release = functools.partial(capture.pool.give, captured.pooled)
    return record
