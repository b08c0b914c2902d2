"""One probing run: build, register hooks, stream every batch to the writer, summarise."""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np
import pandas as pd
import torch
import torchvision
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from probe.attribute.integrated import Integrated, baselines, check_attribution_run
from probe.attribute.readout import build_readout, write_readout_tables
from probe.attribute.table import attribution_table
from probe.checks import check_config, check_run_options
from probe.config import BACKWARD_SITES
from probe.data.batches import build_batches, check_token_data
from probe.data.provenance import describe as describe_dataset
from probe.errors import ConfigError
from probe.hooks import nonfinite
from probe.hooks.capture import Capture
from probe.hooks.examples import TopKSpec
from probe.hooks.objective import build_objective
from probe.hooks.sae_site import load_saes
from probe.hooks.select import select_modules
from probe.intervene.edits import GRAD_EDIT_SITES, build_edits, first_pass_means
from probe.intervene.passes import Interventions
from probe.intervene.splice import SpliceReport
from probe.launch import distributed, size_plan
from probe.launch.batch import BatchStep, run_batch
from probe.launch.circuit_phase import (
    CircuitPhase,
    finish_circuits,
    prepare_circuits,
    reuse,
    run_circuits,
)
from probe.launch.interrupt import Interrupted, StopFlag, file_size_errors
from probe.models import placement
from probe.models.build import build_model
from probe.read.tables import summary_frame
from probe.stats import backend
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
class Prepared:
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
    integrated: Integrated | None = None  # made by the run (its baselines may need a pass)
    readout: object = None  # the lens or direct logit attribution (probe.attribute.readout)
    circuit: CircuitPhase | None = None  # edge scores and circuits after the loop


def build_run(cfg: DictConfig) -> Prepared:
    """Build the model and the batches the config names, then `prepare` the run (the Python
    API, `probe.launch.api`, prepares a caller's model and batches the same way)."""
    check_config(cfg)  # what the config alone decides, before any work; types added probes
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, cfg.seed)
    every = build_batches(cfg.dataset, cfg.model, cfg.seed, model)
    return prepare(cfg, model, every)


def prepare(cfg: DictConfig, model: torch.nn.Module, every) -> Prepared:
    """This process's batches, the device, the selected sites, the edits and the objective of a
    run of `model` over `every` (batches as `probe.data.batches.OrderedBatches` gives them)."""
    shard, batches = distributed.shard(every)
    if placement.is_placed(model):  # accelerate's hooks move each module's inputs in
        device = placement.input_device(model)
        log.info("device %s: where model.device_map runs the model's first module", device)
    else:
        device = shard.device(resolve_device(cfg.device))
        log.info("device %s (device=%s)", device, cfg.device)
    check_run_options(cfg)  # checked once more: the Python API's config skips check_config
    stats_backend = backend.resolve(cfg.stats.backend, device.type)
    backend.use(stats_backend)
    selections = select_modules(model, cfg.probes)
    # (read now: a bad SAE folder stops the run before any file is made)
    selections = load_saes(selections)
    if placement.is_placed(model):
        placement.describe(model, selections)
        placement.check_param_grads(selections)
    check_token_data(every.dataset, selections, model)
    edits = build_edits(model, cfg.intervene, cfg.seed)
    wants_grad = any(s in BACKWARD_SITES for sel in selections for s in sel.sites) or any(
        e.site in GRAD_EDIT_SITES for e in edits
    )
    classes = cfg.model.num_classes if cfg.model.library in ("torchvision", "timm") else None
    answers = frozenset(
        k for k in ("answer", "wrong") if getattr(every.dataset, k, None) is not None
    )
    objective = None
    if wants_grad:
        objective = build_objective(cfg.objective, batches.has_targets, classes, answers)
    check_attribution_run(model, selections, edits, bool(cfg.train_mode))
    readout = build_readout(cfg.lens, model, "answer" in answers)
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
    prepared = Prepared(model, batches, selections, objective, device, edits, shard, stats_backend)
    prepared.readout = readout
    prepared.circuit = prepare_circuits(cfg, model, every.dataset)
    return prepared


def run(
    cfg: DictConfig, run_dir: Path | None = None, prepared: Prepared | None = None
) -> RunResult:
    """Run the probes of `cfg`; writes probe.h5 and summary.csv into `run_dir` (default: Hydra's).
    `prepared` reuses what `build_run(cfg)` built (the benchmark times the loop alone). The run
    holds the directory's lock (probe.store.runlock) throughout: one run per directory."""
    run_dir = Path(run_dir) if run_dir is not None else output_dir()
    with runlock.hold(run_dir), file_size_errors():
        return _run(cfg, run_dir, prepared)


def _run(cfg: DictConfig, run_dir: Path, prepared: Prepared | None) -> RunResult:
    p = prepared or build_run(cfg)
    shard = p.shard or distributed.shard(p.batches)[0]
    stats_backend = p.stats_backend or backend.resolve(cfg.stats.backend, p.device.type)
    if not placement.is_placed(p.model):  # a placed model stays where its map put it
        p.model.to(p.device)
    buffers = {k: v.clone() for k, v in p.model.state_dict().items()} if cfg.train_mode else None
    p.model.train(cfg.train_mode)
    tokenizer = cfg.dataset.tokenizer or cfg.model.name
    interventions = Interventions.of(
        p.model, p.edits, cfg.intervene, p.batches.dataset, cfg.dataset.name == "pairs", tokenizer
    )
    if any("ig_output" in s.sites for s in p.selections):
        a = cfg.attribution
        base = baselines(a, p.model, p.batches, p.selections, p.device, cfg.precision)
        p.integrated = Integrated(a.steps, a.method, a.internal_batch_size, base)
    h5_path = run_dir / cfg.store.filename
    writer = _open_writer(cfg, p, shard, run_dir, h5_path, stats_backend, interventions)
    complete, stop = False, StopFlag()
    try:
        complete = _loop(cfg, p, shard, writer, interventions, stop)
    finally:
        if buffers is not None:
            p.model.load_state_dict(buffers)
        writer.close(complete=complete)
    if stop.requested is not None:
        raise Interrupted(stop.requested, writer.num_samples, h5_path)
    circuit = None
    if p.circuit is not None:
        circuit = cfg.resume and reuse(run_dir, h5_path, p.circuit)
        circuit = circuit or run_circuits(p.circuit, p, shard, run_dir, bool(cfg.resume))
    return _finish(cfg, run_dir, h5_path, shard, writer, interventions, circuit)


def _open_writer(
    cfg, p: Prepared, shard, run_dir: Path, h5_path: Path, stats_backend, interventions
):
    """The run's writer on a new file, or on the file it resumes once that file is checked to
    be this run's (config, dataset, checkpoint)."""
    path = shard.path(h5_path)
    runfile.check_existing(path, bool(cfg.resume), bool(cfg.get("overwrite")))
    if cfg.resume and path.is_file():  # this run holds the directory's lock:
        swmr.mark_closed(path)  # "open for write" flags are a killed run's
    resuming = bool(cfg.resume) and check_resumable(path, cfg)
    provenance = describe_dataset(
        cfg.dataset, p.batches if shard.world == 1 else p.batches.dataset.dataset
    )
    identity = {"dataset_identity": json.dumps(provenance.identity, sort_keys=True)}
    if cfg.model.checkpoint:
        identity["checkpoint_sha256"] = file_sha256(cfg.model.checkpoint)
    if resuming:
        check_identity(path, identity)
    first_pass_means(p.model, p.batches, p.edits, p.device)
    store, selections = cfg.store, p.selections
    writer = ProbeWriter(
        path,
        mode=store.mode,
        compression=store.compression,
        compression_level=store.compression_level,
        chunk_bytes=store.chunk_bytes,
        queue_batches=store.queue_batches,
        module_types={s.name: s.module_type for s in selections},
        token_layers=frozenset(s.name for s in selections if s.rows == "tokens"),
        attrs={
            **file_attrs(cfg, run_dir),
            **shard.attrs(),
            "edits": json.dumps([e.describe for e in p.edits]),
            "stats_backend": stats_backend,
            **identity,
            **(interventions.attrs() if interventions is not None else {}),
        },
        resume=resuming,
        batch_rows=cfg.dataset.batch_size,
        flush_seconds=store.flush_seconds,
        index_offset=shard.samples.start,
        stats_backend=stats_backend,
        direct_io=store.direct_io,
        total_rows=len(shard.samples),
        provenance=provenance,
        stats_during=cfg.stats.during,
        topk=examples_spec(cfg),
    )
    if resuming:
        p.batches.skip(writer.num_batches)
        log.info("resuming %s after %d samples", h5_path, writer.num_samples)
    return writer


def examples_spec(cfg) -> TopKSpec | None:
    """What stats.topk, stats.bottomk and stats.topk_quantiles ask to keep (None: nothing)."""
    s = cfg.stats
    spec = TopKSpec(s.get("topk", 0), s.get("bottomk", 0), s.get("topk_quantiles", 0), cfg.seed)
    return spec if spec.sizes() and s.during != "none" else None


def _loop(cfg, p: Prepared, shard, writer: ProbeWriter, interventions, stop: StopFlag) -> bool:
    """Every batch through the hooks into the writer; whether the run is whole (a signal stops
    it after the batch in flight)."""
    on_device = writer.observes_device
    in_hooks = cfg.stats.during == "run" and (p.device.type == "cpu" or on_device)
    observe = writer.observe if in_hooks else None
    keep_values = cfg.store.mode == "full"
    capture = Capture(p.selections, p.edits, shard.samples.start, observe, keep_values, on_device,
                      writer.topk if cfg.stats.during == "run" else None, shard.dataset_samples)  # fmt: skip
    step = BatchStep(
        p.model,
        capture,
        p.selections,
        p.device,
        p.objective,
        interventions,
        cfg.precision,
        cfg.store.model_output,
        p.integrated,
        p.readout,
        cfg.lens.position,
        SpliceReport(capture) if any(t.sae is not None for t in capture.hooked) else None,
    )
    fail_on_nonfinite = cfg.fail_on_nonfinite  # read once
    readout = p.readout or contextlib.nullcontext()
    with capture, stop, interventions or contextlib.nullcontext(), readout:
        bar = tqdm(p.batches, desc="probe", unit="batch", disable=not cfg.progress, leave=False)
        first = index = writer.num_batches  # (a resumed run starts after its last batch)
        for index, batch in enumerate(bar, start=first):
            if observe is not None:
                writer.begin_batch()
            record = run_batch(step, batch, index)
            if index == 0:
                size_plan.announce(record, p.batches, p.selections, cfg.store, shard)
            writer.put(record)
            if fail_on_nonfinite:
                nonfinite.check_batch(record)
            if stop.requested is not None:
                break
    if step.splice is not None:  # (each rank its own: a torchrun job's are not merged)
        table = step.splice.table()
        table.to_csv(writer.path.parent / "sae.csv", index=False)
        log.info("wrote %s (%d layers with an SAE)", writer.path.parent / "sae.csv", len(table))
        promoted = step.splice.promoted(p.model)
        if promoted:  # (feature cards show them: probe.report.cards)
            np.savez(writer.path.parent / "sae_tokens.npz", **promoted)
    # a signal during the last batch stops nothing: the run is whole, so it says so
    complete = stop.requested is None or index + 1 - first >= remaining_batches(p.batches)
    if complete:
        stop.requested = None
    return complete


def _finish(cfg, run_dir: Path, h5_path: Path, shard, writer, interventions, circuit=None):
    """The files after the file: summary.csv (rank 0 of a torchrun job, on the stitched file),
    the edits' effects, the circuit's files, the log's summary; the RunResult."""
    counted = cfg.stats.during != "none"
    if counted:
        nonfinite.report(writer.datasets.values())
    datasets = distributed.finish(shard, h5_path, writer.datasets)
    if datasets is None:  # a rank other than 0 under torchrun: rank 0 writes the run's files
        summary = summary_frame(writer.datasets.values())
        return RunResult(run_dir, shard.path(h5_path), summary, writer.num_samples)
    summary = summary_frame(datasets) if counted else summary_frame([])
    if counted:
        summary.to_csv(run_dir / "summary.csv", index=False)
        attributions = attribution_table(datasets)
        if len(attributions):
            attributions.to_csv(run_dir / "attribution.csv", index=False)
            log.info("wrote %s (%d sites)", run_dir / "attribution.csv", len(attributions))
    if cfg.lens.name != "none":
        write_readout_tables(h5_path, run_dir)
    else:
        log.info(
            "stats.during=none: no statistics and no summary.csv; python -m probe.summarize "
            "%s computes them from the rows",
            run_dir,
        )
    if interventions is not None:
        interventions.report(h5_path, run_dir)
    if circuit is not None:
        finish_circuits(circuit, run_dir, h5_path, shard.world)
    if cfg.print_summary and counted:
        print_summary(summary)
    num_samples = shard.dataset_samples if shard.world > 1 else writer.num_samples
    log.info("wrote %s (%d samples)", h5_path, num_samples)
    return RunResult(run_dir, h5_path, summary, num_samples)


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
