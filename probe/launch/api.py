"""`probe.run(model, data, probes, ...)`: a run of a model already in hand, on the CLI's path.

The CLI composes a config, builds the model and the batches from it and calls `probe.launch.run.run`;
here the caller's model and batches take their place (`probe.launch.run.prepare`), and the config
comes from the same schema and shipped files (Hydra's compose), so both write the same
probe.h5, summary.csv and /stats. Every option of the CLI that is not about building the model
or the data is a keyword of the same name: a shipped file's name (probes="all_convs",
store="stats") or a mapping of its keys.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from probe.config import (
    AttributionConfig,
    DatasetConfig,
    LensConfig,
    ModelConfig,
    ObjectiveConfig,
    StatsConfig,
    StoreConfig,
)
from probe.data.user_batches import UserBatches
from probe.errors import ConfigError
from probe.plan import RunPlan, parse, typed
from probe.shipped import check_shipped, compose_shipped
from probe.store import runfile, runlock

log = logging.getLogger("probe")
GROUPS = {
    "store": StoreConfig,
    "objective": ObjectiveConfig,
    "stats": StatsConfig,
    "attribution": AttributionConfig,
    "lens": LensConfig,
}


def run(
    model: torch.nn.Module,
    data: Iterable,
    probes: str | Mapping,
    *,
    out: str | Path,
    store: str | Mapping = "full",
    objective: str | Mapping | None = None,
    intervene: str | Mapping | None = None,
    stats: str | Mapping | None = None,
    attribution: Mapping | None = None,
    lens: str | Mapping | None = None,
    device: str | None = None,
    seed: int = 0,
    precision: str = "fp32",
    train_mode: bool = False,
    resume: bool = False,
    overwrite: bool = False,
    fail_on_nonfinite: bool = False,
    progress: bool = True,
    print_summary: bool = False,
):
    """Run `probes` on `model` over `data` into the directory `out`; returns the run's reader
    (`probe.open_run`). `data` is an iterable of batches, each a tensor, an (inputs, targets)
    pair or a dict of keyword arguments (input_ids, attention_mask, ...): a DataLoader as it is.
    `device` None keeps the model where it is; `stats` is a backend name or the stats keys;
    `attribution` integrated gradients' keys; `lens` logit, tuned or dla, or its keys. The
    model's training mode is given back as it was; no hook is left on it, on any way out.
    `out` is locked for the run (probe.store.runlock): a second run into it meanwhile is refused."""
    from probe.launch.run import prepare
    from probe.launch.run import run as run_config
    from probe.read.runs import open_run

    out = Path(out)
    if out.exists() and not out.is_dir():  # (before the lock would make it a directory)
        raise ConfigError(f"out={str(out)!r} is a file; give a directory for the run")
    with runlock.reserve(out):  # held for the run (probe.launch.run.run claims it)
        check_out(out, store, resume, overwrite)
        batches = UserBatches(data)
        # (an oversized seed is named before torch sees it)
        plan = run_plan(model, batches, probes, store=store, objective=objective,
                        intervene=intervene, stats=stats, attribution=attribution, lens=lens,
                        device=device, seed=seed, precision=precision, train_mode=train_mode,
                        resume=resume, overwrite=overwrite, fail_on_nonfinite=fail_on_nonfinite,
                        progress=progress, print_summary=print_summary)  # fmt: skip
        training = model.training
        try:
            torch.manual_seed(seed)
            run_config(plan, run_dir=out, prepared=prepare(plan, model, batches))
        finally:
            model.train(training)
    return open_run(out)


def run_plan(
    model: torch.nn.Module,
    batches: UserBatches,
    probes: str | Mapping,
    *,
    store: str | Mapping = "full",
    objective: str | Mapping | None = None,
    intervene: str | Mapping | None = None,
    stats: str | Mapping | None = None,
    attribution: Mapping | None = None,
    lens: str | Mapping | None = None,
    device: str | None = None,
    **options,
) -> RunPlan:
    """The RunPlan of a `run` of `model` over `batches` with these keywords (`options`: seed,
    precision, train_mode, resume, overwrite, fail_on_nonfinite, progress, print_summary), parsed
    as the command line's config is (probe.plan.parse)."""
    cfg = config(probes, store, objective, intervene, stats, model, attribution, lens)
    cfg.device = device or _device_of(model)
    cfg.dataset = OmegaConf.structured(
        DatasetConfig(name="python", batch_size=batches.batch_size, num_samples=batches.num_samples)
    )
    for key, value in options.items():
        set_key(cfg, key, value)
    return parse(cfg, in_hand=True)


def config(
    probes, store, objective, intervene, stats, model, attribution=None, lens=None
) -> DictConfig:
    """The run's config: shipped files by name through Hydra's compose (as the CLI has them),
    mappings merged onto the schema (probe.plan.parse types a mapping of probes or edits), and
    the caller's model named in `model`."""
    overrides = ["print_summary=false"]
    for group, value in (
        ("probes", probes),
        ("store", store),
        ("objective", objective),
        ("intervene", intervene),
        ("lens", lens),
    ):
        if isinstance(value, str):
            check_shipped(group, value)
            overrides.append(f"{group}={value}")
    if isinstance(stats, str):
        overrides.append(f"stats.backend={stats}")
    cfg = compose_shipped(overrides)
    if isinstance(probes, Mapping | DictConfig):
        cfg.probes = {str(name): spec for name, spec in probes.items()}
    elif not isinstance(probes, str):
        raise ConfigError(
            f"probes={probes!r}: give the name of a shipped probe file (e.g. 'all_convs') or a "
            "mapping {name: {layers: [...], capture: [...]}}"
        )
    typed_groups = (("store", store), ("objective", objective), ("stats", stats),
                    ("attribution", attribution), ("lens", lens))  # fmt: skip
    for group, value in typed_groups:
        if isinstance(value, Mapping | DictConfig):
            cfg[group] = typed(GROUPS[group], cfg[group], group, value)
    if isinstance(intervene, Mapping | DictConfig):
        cfg.intervene = OmegaConf.create(dict(intervene))
    cfg.model = OmegaConf.structured(ModelConfig(name=type(model).__name__, library="custom"))
    return cfg


def set_key(cfg: DictConfig, key: str, value) -> None:
    """cfg[key] = value, a value the schema refuses (a precision it does not know, a bool that
    is not one) a ConfigError naming the keyword."""
    try:
        cfg[key] = value
    except OmegaConfBaseException as e:
        raise ConfigError(f"{key}={value!r}: {str(e).splitlines()[0]}") from None


def check_out(out: Path, store, resume: bool, overwrite: bool = False) -> None:
    """`out` must not hold a run already, unless it is resumed or replaced."""
    filename = store.get("filename", "probe.h5") if isinstance(store, Mapping) else "probe.h5"
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out={str(out)!r} is a file; give a directory for the run")
    if resume and overwrite:
        raise ConfigError("resume=True and overwrite=True ask for opposite things; give one")
    if (out / filename).exists() and not (resume or overwrite):
        raise ConfigError(
            f"out={str(out)!r} already holds a run ({filename}: "
            f"{runfile.file_state(out / filename)}); give a new directory, resume=True to "
            "continue it, or overwrite=True to replace it"
        )


def _device_of(model: torch.nn.Module) -> str:
    first = next((t for t in [*model.parameters(), *model.buffers()]), None)
    return str(first.device) if first is not None else "cpu"
