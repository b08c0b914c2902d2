"""One probing run of a RunPlan (probe.plan): build, register hooks, stream every batch to the
writer, summarise."""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import h5py
import pandas as pd
import torch
import torchvision
from tqdm.auto import tqdm

from probe.attribute.integrated import check_attribution_run
from probe.config import BACKWARD_SITES, GRAD_EDIT_SITES
from probe.data.batches import build_batches, check_token_data
from probe.data.provenance import describe as describe_dataset
from probe.errors import ConfigError
from probe.hooks import nonfinite
from probe.hooks.capture import Capture
from probe.hooks.module_select import select_modules
from probe.hooks.objective import build_objective
from probe.hooks.run_feature import Finished, RunFeature, RunSetup
from probe.hooks.sae_site import load_saes
from probe.intervene.edits import build_edits, first_pass_means
from probe.intervene.passes import direction_of
from probe.launch import distributed, size_plan
from probe.launch.batch import BatchStep, Prepared, run_batch
from probe.launch.features import FEATURES
from probe.launch.features.topk_examples import examples_spec
from probe.launch.interrupt import Interrupted, StopFlag, file_size_errors
from probe.models import placement
from probe.models.build import build_model
from probe.plan import RunPlan, parse
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
    """The torch device of `device` (probe.checks took its name): auto is the GPU where there
    is one."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"device={name!r} but no CUDA device is available here; use device=cpu or auto"
        )
    return device


def as_plan(plan: RunPlan | object) -> RunPlan:
    """`plan`, or the RunPlan of a composed config (probe.plan.parse)."""
    return plan if isinstance(plan, RunPlan) else parse(plan)


def build_run(plan: RunPlan) -> Prepared:
    """Build the model and the batches the plan names (a composed config is parsed first), then
    `prepare` the run (the Python API, `probe.launch.api`, prepares a caller's model and batches
    the same way)."""
    plan = as_plan(plan)
    seed = plan.options.seed
    torch.manual_seed(seed)
    model = build_model(plan.model, seed)
    every = build_batches(plan.data, plan.model, seed, model)
    return prepare(plan, model, every)


def prepare(plan: RunPlan, model: torch.nn.Module, every) -> Prepared:
    """This process's batches, the device, the selected sites, the edits and the objective of a
    run of `model` over `every` (batches as `probe.data.batches.OrderedBatches` gives them)."""
    shard, batches = distributed.shard(every)
    options = plan.options
    if placement.is_placed(model):  # accelerate's hooks move each module's inputs in
        device = placement.input_device(model)
        log.info("device %s: where model.device_map runs the model's first module", device)
    else:
        device = shard.device(resolve_device(options.device))
        log.info("device %s (device=%s)", device, options.device)
    stats_backend = backend.resolve(plan.stats.backend, device.type)
    backend.use(stats_backend)
    selections = select_modules(model, plan.probes)
    # (read now: a bad SAE folder stops the run before any file is made)
    selections = load_saes(selections)
    if placement.is_placed(model):
        placement.describe(model, selections)
        placement.check_param_grads(selections)
    check_token_data(every.dataset, selections, model)
    edits = build_edits(model, plan.intervene.edits, options.seed, plan.graph.transcoders)
    wants_grad = any(s in BACKWARD_SITES for sel in selections for s in sel.sites) or any(
        e.site in GRAD_EDIT_SITES for e in edits
    )
    answers = frozenset(
        k for k in ("answer", "wrong") if getattr(every.dataset, k, None) is not None
    )
    objective = None
    if wants_grad:
        objective = build_objective(plan.objective, batches.has_targets, answers)
    check_attribution_run(model, selections, edits, options.train_mode)
    features = prepare_features(
        RunSetup(plan, model, batches, every.dataset, selections, edits, device, objective)
    )
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
    if not selections and plan.probes:  # (probes=none asks for no module)
        log.warning(
            "no module selected (every probe allows an empty selection): %s will hold the samples "
            "and no layers, and summary.csv no rows",
            plan.store.filename,
        )
    return Prepared(
        model, batches, selections, objective, device, edits, shard, stats_backend, features
    )


def prepare_features(setup: RunSetup) -> list[RunFeature]:
    """The registered features (probe.launch.features) the plan asks for, each checked against
    the model and the data."""
    return [f for f in (kind.prepare(setup) for kind in FEATURES) if f is not None]


def run(plan: RunPlan, run_dir: Path | None = None, prepared: Prepared | None = None) -> RunResult:
    """Run the probes of `plan` (a composed config is parsed first); writes probe.h5 and
    summary.csv into `run_dir` (default: Hydra's). `prepared` reuses what `build_run` built (the
    benchmark times the loop alone). The run holds the directory's lock (probe.store.runlock)
    throughout: one run per directory."""
    plan = as_plan(plan)
    run_dir = Path(run_dir) if run_dir is not None else output_dir()
    with runlock.hold(run_dir), file_size_errors():
        return _run(plan, run_dir, prepared)


def _run(plan: RunPlan, run_dir: Path, prepared: Prepared | None) -> RunResult:
    p = prepared or build_run(plan)
    shard = p.shard or distributed.shard(p.batches)[0]
    stats_backend = p.stats_backend or backend.resolve(plan.stats.backend, p.device.type)
    if not placement.is_placed(p.model):  # a placed model stays where its map put it
        p.model.to(p.device)
    train_mode = plan.options.train_mode
    buffers = {k: v.clone() for k, v in p.model.state_dict().items()} if train_mode else None
    p.model.train(train_mode)
    h5_path = run_dir / plan.store.filename
    setup = RunSetup(plan, p.model, p.batches, p.batches.dataset, p.selections, p.edits,
                     p.device, p.objective, shard, run_dir, h5_path)  # fmt: skip
    if p.features is None:  # (a Prepared made by hand: the registry's features, checked now)
        p.features = prepare_features(setup)
    for f in p.features:
        f.start(setup)
    writer = _open_writer(plan, p, shard, h5_path, stats_backend)
    complete, stop = False, StopFlag()
    try:
        complete = _loop(plan, p, shard, writer, stop)
    finally:
        if buffers is not None:
            p.model.load_state_dict(buffers)
        writer.close(complete=complete)
    if stop.requested is not None:
        raise Interrupted(stop.requested, writer.num_samples, h5_path)
    done = Finished(plan, run_dir, h5_path, shard, counted=plan.stats.during != "none")
    for f in p.features:
        f.after_run(done)
    return _finish(p, done, writer)


def _open_writer(plan: RunPlan, p: Prepared, shard, h5_path: Path, stats_backend):
    """The run's writer on a new file, or on the file it resumes once that file is checked to
    be this run's (config, dataset, checkpoint)."""
    path, options = shard.path(h5_path), plan.options
    runfile.check_existing(path, options.resume, options.overwrite)
    if options.resume and path.is_file():  # this run holds the directory's lock:
        swmr.mark_closed(path)  # "open for write" flags are a killed run's
    resuming = options.resume and check_resumable(path, plan.text)
    provenance = describe_dataset(
        plan.data, p.batches if shard.world == 1 else p.batches.dataset.dataset
    )
    identity = {"dataset_identity": json.dumps(provenance.identity, sort_keys=True)}
    if plan.model.checkpoint:
        identity["checkpoint_sha256"] = file_sha256(plan.model.checkpoint)
    if resuming:
        check_identity(path, identity)
    first_pass_means(p.model, p.batches, p.edits, p.device)
    selections = p.selections
    writer = ProbeWriter(
        path,
        plan.store,
        plan.stats,
        module_types={s.name: s.module_type for s in selections},
        token_layers=frozenset(s.name for s in selections if s.rows == "tokens"),
        attrs={
            **file_attrs(plan),
            **shard.attrs(),
            "edits": json.dumps([e.describe for e in p.edits if e.describe]),
            "stats_backend": stats_backend,
            **identity,
            **{k: v for f in p.features for k, v in f.attrs().items()},
        },
        resume=resuming,
        batch_rows=plan.data.batch_size,
        index_offset=shard.samples.start,
        stats_backend=stats_backend,
        total_rows=len(shard.samples),
        provenance=provenance,
        topk=examples_spec(plan),
    )
    if resuming:
        p.batches.skip(writer.num_batches)
        log.info("resuming %s after %d samples", h5_path, writer.num_samples)
    return writer


def _loop(plan: RunPlan, p: Prepared, shard, writer: ProbeWriter, stop) -> bool:
    """Every batch through the hooks into the writer; whether the run is whole (a signal stops
    it after the batch in flight)."""
    on_device = writer.observes_device
    during = plan.stats.during
    in_hooks = during == "run" and (p.device.type == "cpu" or on_device)
    observe = writer.observe if in_hooks else None
    keep_values = plan.store.mode == "full"
    capture = Capture(p.selections, p.edits, shard.samples.start, observe, keep_values, on_device,
                      writer.topk if during == "run" else None, shard.dataset_samples)  # fmt: skip
    is_pairs = plan.data.name == "pairs"  # (which half of a pair is the run's own input)
    step = BatchStep(p, capture, plan, direction_of(plan.intervene, is_pairs))
    fail_on_nonfinite = plan.options.fail_on_nonfinite  # read once
    with contextlib.ExitStack() as hooks:
        hooks.enter_context(capture)
        hooks.enter_context(stop)
        for f in p.features:
            hooks.enter_context(f.loop(capture))
        bar = tqdm(p.batches, desc="probe", unit="batch", disable=not plan.options.progress,
                   leave=False)  # fmt: skip
        first = index = writer.num_batches  # (a resumed run starts after its last batch)
        for index, batch in enumerate(bar, start=first):
            if observe is not None:
                writer.begin_batch()
            record = run_batch(step, batch, index)
            if index == 0:
                size_plan.announce(record, p.batches, p.selections, plan.store, shard)
            writer.put(record)
            if fail_on_nonfinite:
                nonfinite.check_batch(record)
            if stop.requested is not None:
                break
    # a signal during the last batch stops nothing: the run is whole, so it says so
    complete = stop.requested is None or index + 1 - first >= remaining_batches(p.batches)
    if complete:
        stop.requested = None
    return complete


def _finish(p: Prepared, done: Finished, writer: ProbeWriter) -> RunResult:
    """The files after the file: each feature's (rank 0 of a torchrun job, on the stitched
    file: summary.csv, none when no probe was asked for or stats.during=none; the lens's, the
    edits', the circuit's tables), the log's summary."""
    shard, h5_path = done.shard, done.h5_path
    if done.counted:
        nonfinite.report(writer.datasets.values())
    datasets = distributed.finish(shard, h5_path, writer.datasets)
    if datasets is None:  # a rank other than 0 under torchrun: rank 0 writes the run's files
        summary = summary_frame(writer.datasets.values())
        return RunResult(done.run_dir, shard.path(h5_path), summary, writer.num_samples)
    done.datasets = datasets
    done.summary = summary_frame(datasets) if done.counted else summary_frame([])
    for f in p.features:
        f.finish(done)
    num_samples = shard.dataset_samples if shard.world > 1 else writer.num_samples
    log.info("wrote %s (%d samples)", h5_path, num_samples)
    return RunResult(done.run_dir, h5_path, done.summary, num_samples)


def remaining_batches(batches) -> int | float:
    """How many batches this run's loop has (infinity when the data cannot say)."""
    try:
        return len(batches)
    except TypeError:
        return float("inf")


def file_attrs(plan: RunPlan) -> dict:
    """The file's attributes of the run: its config as parsed (resolved YAML), seed, mode and
    objective, and the versions of the libraries that made it."""
    return {
        "config": plan.text,
        "train_mode": bool(plan.options.train_mode),
        "seed": int(plan.options.seed),
        "torch_version": str(torch.__version__),
        "torchvision_version": str(torchvision.__version__),
        "h5py_version": str(h5py.__version__),
        "hdf5_version": str(h5py.version.hdf5_version),
        "objective": str(plan.objective.name),
        **model_library_version(plan.model.library),
    }


def model_library_version(library: str) -> dict:
    """The version of the library the model came from (transformers, timm), as an attribute."""
    module = {"hf": "transformers", "timm": "timm"}.get(library)
    if module is None:
        return {}
    return {f"{module}_version": str(importlib.import_module(module).__version__)}
