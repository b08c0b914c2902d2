"""One probing run of a RunPlan (probe.plan): build, register hooks, stream every batch into the
run's sink, make the run parts' passes over the batches again, summarise."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import h5py
import pandas as pd
import torch
from tqdm.auto import tqdm

from probe.attribute.integrated import check_attribution_run
from probe.config import BACKWARD_SITES, GRAD_EDIT_SITES
from probe.data.batches import RunBatches, build_batches, check_token_data
from probe.data.provenance import describe as describe_dataset
from probe.errors import ConfigError
from probe.hooks.capture import Capture
from probe.hooks.module_select import select_modules
from probe.hooks.objective import build_objective
from probe.hooks.sae_site import load_saes
from probe.intervene.edits import build_edits
from probe.launch import collector, distributed, size_plan
from probe.launch.batch import Prepared, run_batch, samples_only
from probe.launch.distributed import Shard
from probe.launch.interrupt import Interrupted, StopFlag, file_size_errors
from probe.launch.parts import PARTS
from probe.launch.replay import Replay
from probe.launch.run_part import Finished, RunPart, RunSetup
from probe.models import placement
from probe.models.build import build_model, torchvision_version
from probe.plan import RunPlan, parse
from probe.read.tables import summary_frame
from probe.stats import backend
from probe.store import runfile, runlock, swmr
from probe.store.resume import check_identity, check_resumable, file_sha256
from probe.store.sink import RunFile, Sink

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
    the same way). What the plan alone cannot decide (a circuit method's name in its registry)
    is checked before the model is built."""
    plan = as_plan(plan)
    for kind in PARTS:
        kind.check(plan)
    seed = plan.options.seed
    torch.manual_seed(seed)
    model = build_model(plan.model, seed)
    every = build_batches(plan.data, plan.model, seed, model)
    return prepare(plan, model, every)


def prepare(plan: RunPlan, model: torch.nn.Module, every: RunBatches) -> Prepared:
    """This process's batches, the device, the selected sites, the edits, the objective and the
    run parts of a run of `model` over `every` (batches as `probe.data.batches.OrderedBatches`
    gives them)."""
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
    setup = RunSetup(plan, model, batches, every.dataset, selections, edits, device, objective,
                     stats_backend, shard)  # fmt: skip
    parts = prepare_parts(setup)
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
    return Prepared(setup, parts)


def prepare_parts(setup: RunSetup) -> list[RunPart]:
    """The registered parts (probe.launch.parts) the plan asks for, each checked against the
    model and the data."""
    return [p for p in (kind.prepare(setup) for kind in PARTS) if p is not None]


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
    setup = dataclasses.replace(p.setup, plan=plan)
    shard = setup.shard = setup.shard or distributed.shard(setup.batches)[0]
    if not placement.is_placed(setup.model):  # a placed model stays where its map put it
        setup.model.to(setup.device)
    train_mode = plan.options.train_mode
    state = setup.model.state_dict()
    buffers = {k: v.clone() for k, v in state.items()} if train_mode else None
    setup.model.train(train_mode)
    h5_path = setup.h5_path = run_dir / plan.store.filename
    setup.run_dir = run_dir
    parts = p.parts if p.parts is not None else prepare_parts(setup)
    for part in parts:
        part.start(setup)
    sink = _open_sink(setup, parts, shard, h5_path)
    complete = False
    try:
        with StopFlag() as stop:
            whole = _loop(setup, parts, sink, stop, shard)
            if whole:
                replay = Replay(setup.batches, shard, stop, sink.path)
                for part in parts:
                    part.after_loop(replay, sink)
            complete = whole
    finally:
        if buffers is not None:
            setup.model.load_state_dict(buffers)
        sink.close(complete=complete)
    if not complete:
        if stop.requested is None:  # (a loop that is not whole stopped for a signal)
            raise RuntimeError("the run stopped before its end without a signal")
        raise Interrupted(stop.requested, h5_path, f"after {sink.num_samples} samples",
                          sink.num_samples)  # fmt: skip
    done = Finished(plan, run_dir, h5_path, shard, counted=plan.stats.during != "none")
    return _finish(parts, done, sink)


def _open_sink(setup: RunSetup, parts: list[RunPart], shard: Shard, h5_path: Path) -> Sink:
    """The run's sink on a new file (this rank's of `h5_path`), or on the file it resumes once
    that file is checked to be this run's (config, dataset, checkpoint); each part attaches what
    it keeps."""
    plan = setup.plan
    path, options = shard.path(h5_path), plan.options
    runfile.check_existing(path, options.resume, options.overwrite)
    if options.resume and path.is_file():  # this run holds the directory's lock:
        swmr.mark_closed(path)  # "open for write" flags are a killed run's
    resuming = options.resume and check_resumable(path, plan.text)
    batches = setup.batches
    provenance = describe_dataset(
        plan.data, batches if shard.world == 1 else distributed.whole_dataset(batches)
    )
    identity = {"dataset_identity": json.dumps(provenance.identity, sort_keys=True)}
    if plan.model.checkpoint:
        identity["checkpoint_sha256"] = file_sha256(plan.model.checkpoint)
    if resuming:
        check_identity(path, identity)
    attrs = {
        **file_attrs(plan),
        **shard.attrs(),
        "edits": json.dumps([e.describe for e in setup.edits if e.describe]),
        "stats_backend": setup.stats_backend,
        **identity,
        **{k: v for part in parts for k, v in part.attrs().items()},
    }
    file = RunFile(
        path, attrs, bool(resuming), plan.data.batch_size, shard.samples.start,
        len(shard.samples), provenance, {s.name: s.module_type for s in setup.selections},
    )  # fmt: skip
    sink = Sink(file, plan.store)
    try:
        for part in parts:
            part.open(sink)
    except BaseException:
        sink.close(complete=False)
        raise
    if resuming:
        batches.skip(sink.num_batches)
        log.info("resuming %s after %d samples", h5_path, sink.num_samples)
    return sink


def _loop(setup: RunSetup, parts: list[RunPart], sink: Sink, stop: StopFlag, shard: Shard) -> bool:
    """Every batch through the hooks into the sink; whether the loop is whole (a signal stops
    it after the batch in flight). A run whose probes capture nothing and whose parts all work
    after the loop makes no forward: its batches bring their samples' rows alone."""
    plan = setup.plan
    forward = needs_forward(setup, parts)
    keep_values = plan.store.mode == "full"
    capture = Capture(setup.selections, shard.samples.start, keep_values)
    batches = setup.batches
    with contextlib.ExitStack() as hooks:
        if forward:  # what changes the model's values, then what records them, then the rest
            for part in parts:
                hooks.enter_context(part.edits(capture))
            hooks.enter_context(capture)
            for part in parts:
                hooks.enter_context(part.loop(capture))
        collector.release()  # (the command line's start-up held Python's collections)
        bar = tqdm(batches, desc="probe", unit="batch", disable=not plan.options.progress,
                   leave=False)  # fmt: skip
        first = index = sink.num_batches  # (a resumed run starts after its last batch)
        for index, batch in enumerate(bar, start=first):
            if forward:
                record = run_batch(setup, parts, capture, batch, index)
            else:
                record = samples_only(batch, index)
            if index == 0:
                size_plan.announce(record, batches, setup.selections, plan.store, shard)
            sink.put(record)
            for part in parts:
                part.handed(record)
            if stop.requested is not None:
                break
    # a signal during the last batch stops nothing: the run is whole, so it says so
    whole = stop.requested is None or index + 1 - first >= remaining_batches(batches)
    if whole:
        stop.requested = None
    return whole


def needs_forward(setup: RunSetup, parts: list[RunPart]) -> bool:
    """Whether the loop runs the model: unless no probe captures, every part works after the
    loop (circuits, attribution graphs) and the model's output is not asked for by name."""
    if setup.selections or any(part.per_batch() for part in parts):
        return True
    after = any(type(part).after_loop is not RunPart.after_loop for part in parts)
    return not after or setup.plan.store.model_output not in ("auto", "none")


def _finish(parts: list[RunPart], done: Finished, sink: Sink) -> RunResult:
    """The files after the file: each part's (rank 0 of a torchrun job, on the stitched
    file: summary.csv, none when no probe was asked for or stats.during=none; the lens's, the
    edits', the circuit's tables), the log's summary."""
    shard, h5_path = done.shard, done.h5_path
    after = [kind for part in parts for kind in part.after]
    datasets = distributed.finish(shard, h5_path, sink.datasets, after)
    if datasets is None:  # a rank other than 0 under torchrun: rank 0 writes the run's files
        summary = summary_frame(sink.datasets.values())
        return RunResult(done.run_dir, shard.path(h5_path), summary, sink.num_samples)
    done.datasets = datasets
    done.summary = summary_frame(datasets) if done.counted else summary_frame([])
    for part in parts:
        part.finish(done)
    num_samples = shard.dataset_samples if shard.world > 1 else sink.num_samples
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
        "torchvision_version": torchvision_version(),
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
