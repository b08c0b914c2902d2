"""One probing run: build, register hooks, stream every batch to the writer, summarise."""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import pandas as pd
import torch
import torchvision
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from probe.analysis.tables import summary_frame
from probe.build.data import build_batches, check_token_data
from probe.build.models import build_model
from probe.build.provenance import describe as describe_dataset
from probe.build.select import select_modules
from probe.config import GRAD_SITES
from probe.errors import ConfigError
from probe.hooks import device as devices
from probe.hooks import nonfinite
from probe.hooks.capture import Capture, resolve_grads
from probe.hooks.forward import (
    call,
    check_model_output,
    output_rows,
    to_device,
    token_batch,
)
from probe.hooks.objective import batch_loss, build_objective
from probe.hooks.record import Record
from probe.intervene.edits import GRAD_EDIT_SITES, build_edits, first_pass_means
from probe.intervene.passes import Interventions, split_pair
from probe.launch import distributed
from probe.launch import plan as size_plan
from probe.launch.interrupt import Interrupted, StopFlag, file_size_errors
from probe.stats import backend
from probe.stats.backend import DeviceStats
from probe.store import runfile, runlock, swmr
from probe.store.resume import check_identity, check_resumable, file_sha256
from probe.store.writer import ProbeWriter

log = logging.getLogger("probe")


@dataclass
class RunResult:
    run_dir: Path
    h5_path: Path
    summary: pd.DataFrame
    num_samples: int


def output_dir() -> Path:
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(
            f"device={name!r} is not a torch device; use cpu, cuda, cuda:N or auto"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"device={name!r} but no CUDA device is available here; use device=cpu or auto"
        )
    return device


@dataclass
class Plan:
    """What a run needs before its loop: built once, so a benchmark can repeat the loop alone."""

    model: torch.nn.Module
    batches: Iterable
    selections: list
    objective: object
    device: torch.device
    edits: list = field(default_factory=list)
    shard: distributed.Shard | None = None
    stats_backend: str | None = (
        None  # what reduces captures (`probe.stats.backend`); None: stats.backend
    )


def plan(cfg: DictConfig) -> Plan:
    """Build the model and the batches the config names, then `prepare` the run (the Python
    API, `probe.launch.api`, prepares a caller's model and batches the same way)."""
    from probe.checks import check_config

    check_config(cfg)  # what the config alone decides, before any work; types added probes
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, cfg.seed)
    every = build_batches(cfg.dataset, cfg.model, cfg.seed, model)
    return prepare(cfg, model, every)


def prepare(cfg: DictConfig, model: torch.nn.Module, every) -> Plan:
    """This process's batches, the device, the selected sites, the edits and the objective of a
    run of `model` over `every` (batches as `probe.build.data.OrderedBatches` gives them)."""
    shard, batches = distributed.shard(every)
    device = shard.device(resolve_device(cfg.device))
    log.info("device %s (device=%s)", device, cfg.device)
    devices.check_precision(cfg.precision)
    check_model_output(cfg.store.model_output)
    stats_backend = backend.resolve(cfg.stats.backend, device.type)
    backend.use(stats_backend)
    selections = select_modules(model, cfg.probes)
    check_token_data(every.dataset, selections, model)
    edits = build_edits(model, cfg.intervene, cfg.seed)
    wants_grad = any(s in GRAD_SITES for sel in selections for s in sel.sites) or any(
        e.site in GRAD_EDIT_SITES for e in edits
    )
    classes = cfg.model.num_classes if cfg.model.library in ("torchvision", "timm") else None
    objective = build_objective(cfg.objective, batches.has_targets, classes) if wants_grad else None
    for sel in selections:
        log.info(
            "probe %-12s %-28s %-18s %s", sel.probe, sel.name, sel.module_type, ",".join(sel.sites)
        )
    for e in edits:
        log.info("edit  %-12s %-28s %-18s %s", e.name, e.module_name, e.site, e.op)
    log.info(
        "%d modules selected, %d edits; %s samples in %s batches",
        len(selections),
        len(edits),
        "?" if batches.num_samples is None else batches.num_samples,
        "?" if batches.num_samples is None else len(batches),
    )
    if not selections:
        log.warning(
            "no module selected (every probe allows an empty selection): %s will hold the samples "
            "and no layers, and summary.csv no rows",
            cfg.store.filename,
        )
    return Plan(model, batches, selections, objective, device, edits, shard, stats_backend)


def run(cfg: DictConfig, run_dir: Path | None = None, prepared: Plan | None = None) -> RunResult:
    """Run the probes of `cfg`; writes probe.h5 and summary.csv into `run_dir` (default: Hydra's).
    `prepared` reuses a Plan built by `plan(cfg)` (the benchmark times the loop alone). The run
    holds the directory's lock (probe.store.runlock) throughout: one run per directory."""
    run_dir = Path(run_dir) if run_dir is not None else output_dir()
    with runlock.hold(run_dir), file_size_errors():
        return _run(cfg, run_dir, prepared)


def _run(cfg: DictConfig, run_dir: Path, prepared: Plan | None) -> RunResult:
    p = prepared or plan(cfg)
    model, batches, selections, objective = p.model, p.batches, p.selections, p.objective
    device, edits = p.device, p.edits
    shard = p.shard or distributed.shard(batches)[0]
    stats_backend = p.stats_backend or backend.resolve(cfg.stats.backend, device.type)
    model.to(device)
    buffers = {k: v.clone() for k, v in model.state_dict().items()} if cfg.train_mode else None
    model.train(cfg.train_mode)
    tokenizer = cfg.dataset.tokenizer or cfg.model.name
    interventions = Interventions.of(
        model, edits, cfg.intervene, batches.dataset, cfg.dataset.name == "pairs", tokenizer
    )
    h5_path = run_dir / cfg.store.filename
    runfile.check_existing(shard.path(h5_path), bool(cfg.resume), bool(cfg.get("overwrite")))
    if cfg.resume and shard.path(h5_path).is_file():  # this run holds the directory's lock:
        swmr.mark_closed(shard.path(h5_path))  # "open for write" flags are a killed run's
    resuming = bool(cfg.resume) and check_resumable(shard.path(h5_path), cfg)
    provenance = describe_dataset(
        cfg.dataset, batches if shard.world == 1 else batches.dataset.dataset
    )
    identity = {"dataset_identity": json.dumps(provenance.identity, sort_keys=True)}
    if cfg.model.checkpoint:
        identity["checkpoint_sha256"] = file_sha256(cfg.model.checkpoint)
    if resuming:
        check_identity(shard.path(h5_path), identity)
    first_pass_means(model, batches, edits, device)
    writer = ProbeWriter(
        shard.path(h5_path),
        mode=cfg.store.mode,
        compression=cfg.store.compression,
        compression_level=cfg.store.compression_level,
        chunk_bytes=cfg.store.chunk_bytes,
        queue_batches=cfg.store.queue_batches,
        module_types={s.name: s.module_type for s in selections},
        token_layers=frozenset(s.name for s in selections if s.rows == "tokens"),
        attrs={
            **file_attrs(cfg, run_dir),
            **shard.attrs(),
            "edits": json.dumps([e.describe for e in edits]),
            "stats_backend": stats_backend,
            **identity,
            **(interventions.attrs() if interventions is not None else {}),
        },
        resume=resuming,
        batch_rows=cfg.dataset.batch_size,
        flush_seconds=cfg.store.flush_seconds,
        index_offset=shard.samples.start,
        stats_backend=stats_backend,
        direct_io=cfg.store.direct_io,
        total_rows=len(shard.samples),
        provenance=provenance,
    )
    if resuming:
        batches.skip(writer.num_batches)
        log.info("resuming %s after %d samples", h5_path, writer.num_samples)
    complete = False
    stop = StopFlag()
    try:
        on_device = writer.observes_device
        observe = writer.observe if device.type == "cpu" or on_device else None
        keep_values = cfg.store.mode == "full"
        capture = Capture(selections, edits, shard.samples.start, observe, keep_values, on_device)
        precision, fail_on_nonfinite = cfg.precision, cfg.fail_on_nonfinite  # read once
        model_output = cfg.store.model_output
        with capture, stop, interventions or contextlib.nullcontext():
            bar = tqdm(batches, desc="probe", unit="batch", disable=not cfg.progress, leave=False)
            first = index = writer.num_batches  # (a resumed run starts after its last batch)
            for index, batch in enumerate(bar, start=first):
                if observe is not None:
                    writer.begin_batch()
                record = run_batch(
                    model,
                    capture,
                    selections,
                    batch,
                    index,
                    device,
                    objective,
                    interventions,
                    precision,
                    model_output,
                )
                if index == 0:
                    size_plan.announce(record, batches, selections, cfg.store, shard)
                writer.put(record)
                if fail_on_nonfinite:
                    nonfinite.check_batch(record)
                if stop.requested is not None:
                    break
        # a signal during the last batch stops nothing: the run is whole, so it says so
        complete = stop.requested is None or index + 1 - first >= remaining_batches(batches)
        if complete:
            stop.requested = None
    finally:
        if buffers is not None:
            model.load_state_dict(buffers)
        writer.close(complete=complete)
    if stop.requested is not None:
        raise Interrupted(stop.requested, writer.num_samples, h5_path)
    nonfinite.report(writer.datasets.values())
    datasets = distributed.finish(shard, h5_path, writer.datasets)
    if datasets is None:  # a rank other than 0 under torchrun: rank 0 writes the run's files
        summary = summary_frame(writer.datasets.values())
        return RunResult(run_dir, shard.path(h5_path), summary, writer.num_samples)
    summary = summary_frame(datasets)
    summary.to_csv(run_dir / "summary.csv", index=False)
    if interventions is not None:
        interventions.report(h5_path, run_dir)
    if cfg.print_summary:
        print_summary(summary)
    num_samples = shard.dataset_samples if shard.world > 1 else writer.num_samples
    log.info("wrote %s (%d samples)", h5_path, num_samples)
    return RunResult(run_dir, h5_path, summary, num_samples)


def run_batch(
    model,
    capture: Capture,
    selections,
    batch,
    index,
    device,
    objective,
    interventions: Interventions | None = None,
    precision: str = "fp32",
    model_output: str = "auto",
) -> Record:
    """Forward (and backward when a gradient site is asked for) one batch; return its captures.

    With edits, the same batch first runs clean (hooks idle) so the edit's effect on the output
    can be measured in the same run.
    """
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
    per_batch = {}
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
                    loss = batch_loss(objective, output, targets, inputs, tokens)
                per_batch = resolve_grads(captured, loss, selections)
    finally:
        capture.end()
    extra = output_rows(output, model_output, size, tokens)
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
    (values, per_batch, host_stats), ready = devices.to_host(captured.values, per_batch, on_device)
    for key, packed in host_stats.items():  # readable once `ready` has fired
        observed[key].packed = packed
    record = Record(batch.start, size, index, values, per_batch, batch.targets, extra, ready)
    record.batch_rows = batch_rows if passes is not None else {}
    record.counted = observed
    record.axes = captured.axes
    if host_tokens is not None and any(s.rows == "tokens" for s in selections):
        record.tokens = host_tokens.rows(batch.inputs["input_ids"], batch.start)
    if captured.pooled:
        record.release = functools.partial(capture.pool.give, captured.pooled)
    return record


def remaining_batches(batches) -> int | float:
    """How many batches this run's loop has (infinity when the data cannot say)."""
    try:
        return len(batches)
    except TypeError:
        return float("inf")


def file_attrs(cfg: DictConfig, run_dir: Path) -> dict:
    return {
        "config": OmegaConf.to_yaml(cfg, resolve=True),
        "train_mode": bool(cfg.train_mode),
        "seed": int(cfg.seed),
        "torch_version": str(torch.__version__),
        "torchvision_version": str(torchvision.__version__),
        "h5py_version": str(h5py.__version__),
        "hdf5_version": str(h5py.version.hdf5_version),
        "objective": str(cfg.objective.name),
        **model_library_version(cfg.model.library),
    }


def model_library_version(library: str) -> dict:
    """The version of the library the model came from (transformers, timm), as an attribute."""
    module = {"hf": "transformers", "timm": "timm"}.get(library)
    if module is None:
        return {}
    return {f"{module}_version": str(importlib.import_module(module).__version__)}


def print_summary(summary: pd.DataFrame) -> None:
    """The summary table through the `probe` logger (the console under the CLI, a notebook's
    log handler under the API)."""
    if summary.empty:
        log.info("summary: no rows (no module was selected)")
        return
    cols = ["layer", "site", "module_type", "shape", "mean", "std", "min", "max", "frac_zero"]
    with pd.option_context("display.max_rows", 200, "display.width", 160, "display.precision", 4):
        log.info("summary:\n%s", summary[cols].to_string(index=False))
