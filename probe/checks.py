"""Config errors decided from the config alone, before torch is imported or a model is built.

The deep checks (probe.data, probe.store, probe.objective, ...) stay where they are, for callers
that build those pieces directly; these repeat them with the same messages so that a command line
mistake is reported in a fraction of a second instead of after the imports and the model. The
name lists below copy the deep modules' own (tests/test_cli_newcomer.py holds them equal), since
importing those modules would import torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import os
import re
import typing
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from probe.config import (
    DTYPES,
    GRAD_SITES,
    HF_TASKS,
    LIBRARIES,
    REDUCTIONS,
    ROWS,
    SITES,
    TOKEN_REDUCTIONS,
    Config,
    GridSpec,
    ProbeSpec,
    edit_specs,
    typed,
)
from probe.errors import CheckpointError, ConfigError, DataError

DATASETS = ("synthetic", "fakedata", "imagefolder", "tensors", "tokens", "text", "random_tokens", "pairs")  # fmt: skip
PRECISIONS = ("fp32", "bf16", "fp16")  # probe.device
MODEL_OUTPUTS = ("auto", "full", "last", "none")  # probe.forward
STATS_BACKENDS = ("auto", "torch", "numba")  # probe.backend
COMPRESSIONS = ("none", "lzf", "gzip")  # probe.store
OBJECTIVES = ("cross_entropy", "logit", "output_sum", "lm_loss", "custom")  # probe.objective
EDIT_SITES = ("input", "output", "grad_output", "grad_input")  # probe.intervene
GRAD_EDIT_SITES = ("grad_output", "grad_input")
OPS = ("zero", "scale", "add", "clamp", "noise", "mean", "custom", "patch")
# the device types torch.device parses (the pinned torch's list; `auto` is probe's own)
DEVICE_TYPES = (
    "cpu", "cuda", "ipu", "xpu", "mkldnn", "opengl", "opencl", "ideep", "hip", "ve", "fpga",
    "maia", "xla", "lazy", "vulkan", "mps", "meta", "hpu", "mtia", "privateuseone",
)  # fmt: skip
DEVICE = re.compile(rf"^(?:{'|'.join(DEVICE_TYPES)})(?::(?:0|[1-9][0-9]*))?$")


def check_config(cfg: DictConfig) -> None:
    """Raise the error a run would raise later for a value the config alone decides (same type
    and message). Types each probe as a ProbeSpec in place first: one added on the command line
    composes untyped, and select_modules reads ProbeSpec's defaults."""
    typed_probes(cfg)
    _model(cfg.model)
    _dataset(cfg.dataset)
    _device(cfg)
    _probes(cfg.probes)
    edits = _edits(cfg.get("intervene"))
    _objective(cfg, edits)
    _store(cfg.store)


def typed_probes(cfg: DictConfig) -> None:
    """Every entry of cfg.probes merged onto ProbeSpec (a misspelt key is a ConfigError naming
    it and ProbeSpec's keys); untyped entries are replaced by their typed form."""
    probes = cfg.get("probes") or {}
    done = {name: typed(ProbeSpec, node, f"probe {name!r}") for name, node in probes.items()}
    untyped = [n for n in done if OmegaConf.get_type(probes._get_node(n)) is not ProbeSpec]
    if untyped:
        with read_write(cfg.probes), open_dict(cfg.probes):
            for name in untyped:
                cfg.probes[name] = done[name]


def _value(node, key: str):
    """node.key, None where it is unset or `???`."""
    return None if OmegaConf.is_missing(node, key) else node.get(key)


def _model(m) -> None:
    library = _value(m, "library") or "torchvision"
    if library not in LIBRARIES:
        raise ConfigError(f"model.library={library!r} is not one of {', '.join(LIBRARIES)}")
    target, name = _value(m, "_target_"), _value(m, "name")
    if (target or name == "custom" or library == "custom") and target is None:
        raise ConfigError(
            "model._target_ is missing; name what to import, e.g. model._target_=probe.zoo.LeNet"
        )
    if library == "hf" and not target and m.task not in HF_TASKS:
        raise ConfigError(f"model.task={m.task!r} is not one of {', '.join(HF_TASKS)}")
    path = _value(m, "checkpoint")
    if path and not Path(path).is_file():
        raise CheckpointError(
            f"model.checkpoint={path!r} does not exist; give the path of a .pt state_dict"
        )


def _dataset(d) -> None:
    if d.batch_size < 1:
        raise ConfigError(f"dataset.batch_size={d.batch_size} must be at least 1")
    if d.num_samples is not None and d.num_samples < 1:
        raise ConfigError(
            f"dataset.num_samples={d.num_samples} must be at least 1 (or null for all)"
        )
    if d.name not in DATASETS:
        raise ConfigError(f"unknown dataset {d.name!r}; choose one of {', '.join(DATASETS)}")
    for key in ("image_size", "channels", "num_classes"):
        if d.get(key) is not None and d[key] < 1:
            raise ConfigError(
                f"dataset.{key}={d[key]} must be at least 1 (or null for the model's own)"
            )
    root, path = _value(d, "root"), _value(d, "path")
    if d.name == "imagefolder":
        if root is None:
            raise ConfigError(
                "dataset=imagefolder needs dataset.root=DIR (a folder of class folders)"
            )
        if not Path(str(root)).is_dir():
            raise DataError(
                f"dataset.root={str(root)!r} is not a directory; give a folder of class sub-folders"
            )
    if d.name == "tensors":
        if path is None:
            raise ConfigError("dataset=tensors needs dataset.path=FILE (a .pt file of inputs)")
        p = Path(str(path))
        if p.is_dir():
            raise DataError(f"dataset.path={str(path)!r} is a directory; give a .pt file of inputs")
        if not p.is_file():
            raise DataError(f"dataset.path={str(path)!r} does not exist; give a .pt file of inputs")
        if not os.access(p, os.R_OK):
            raise DataError(
                f"dataset.path={str(path)!r} cannot be read (permission denied); fix its permissions"
            )


def _device(cfg) -> None:
    name = cfg.device
    if name != "auto" and not DEVICE.match(str(name)):
        raise ConfigError(f"device={name!r} is not a torch device; use cpu, cuda, cuda:N or auto")
    if cfg.precision not in PRECISIONS:
        raise ConfigError(
            f"precision={cfg.precision!r} is unknown; choose from {', '.join(PRECISIONS)}"
        )
    mode = cfg.store.model_output
    if mode not in MODEL_OUTPUTS:
        raise ConfigError(
            f"store.model_output={mode!r} is unknown; choose from {', '.join(MODEL_OUTPUTS)}"
        )
    backend = cfg.stats.backend
    if backend not in STATS_BACKENDS:
        raise ConfigError(
            f"stats.backend={backend!r} is unknown; choose from {', '.join(STATS_BACKENDS)}"
        )
    if backend == "numba" and importlib.util.find_spec("numba") is None:
        raise ConfigError(
            "stats.backend=numba needs numba, which is not installed: pip install -e "
            "'.[fast]', or use stats.backend=torch"
        )


def _probes(probes) -> None:
    """probe.select's checks of each spec that need no model."""
    for name, spec in probes.items():
        for site in spec.capture:
            if site not in SITES:
                raise ConfigError(
                    f"probe {name!r}: capture site {site!r} is unknown; choose from {', '.join(SITES)}"
                )
        if not spec.capture:
            raise ConfigError(
                f"probe {name!r}: capture is empty; list sites from {', '.join(SITES)}"
            )
        for key, known in (("reduce", REDUCTIONS), ("dtype", DTYPES), ("rows", ROWS)):
            if spec[key] not in known:
                raise ConfigError(
                    f"probe {name!r}: {key}={spec[key]!r} is unknown; choose from {', '.join(known)}"
                )
        if spec.rows == "tokens" and spec.reduce != "none":
            raise ConfigError(
                f"probe {name!r}: rows: tokens keeps every token, so it takes reduce: none, not "
                f"{spec.reduce!r} (the token reductions {', '.join(TOKEN_REDUCTIONS)} give one row "
                "per sample)"
            )
        axis = spec.unit_axis
        if axis != "auto" and (isinstance(axis, bool) or not isinstance(axis, int) or axis == 0):
            raise ConfigError(
                f"probe {name!r}: unit_axis={axis!r} is neither auto nor a nonzero axis; give auto, "
                "1 (channels of N, C, H, W) or -1 (features of N, T, C)"
            )
        if spec.match not in ("all", "any"):
            raise ConfigError(f"probe {name!r}: match={spec.match!r} is unknown; choose all or any")


def _edits(intervene) -> dict:
    """probe.intervene's checks of each edit that need no model; the typed edits."""
    edits = edit_specs(intervene)
    for name, spec in edits.items():
        if spec.site not in EDIT_SITES:
            raise ConfigError(
                f"intervene {name!r}: site={spec.site!r} is unknown; choose from {', '.join(EDIT_SITES)}"
            )
        if spec.op not in OPS:
            raise ConfigError(
                f"intervene {name!r}: op={spec.op!r} is unknown; choose from {', '.join(OPS)}"
            )
        if spec.op == "clamp" and spec.min is None and spec.max is None:
            raise ConfigError(
                f"intervene {name!r}: op=clamp needs min and/or max (e.g. +intervene.{name}.max=1.0)"
            )
        if spec.op == "noise" and spec.std < 0:
            raise ConfigError(f"intervene {name!r}: std={spec.std} must be >= 0")
        if spec.op == "mean":
            _mean_source(name, spec)
    if intervene and intervene.get("grid") is not None:
        typed(GridSpec, intervene.grid, "intervene.grid")
    return edits


def _mean_source(name: str, spec) -> None:
    if spec.site not in ("input", "output"):
        raise ConfigError(
            f"intervene {name!r}: op=mean applies to input/output sites, not {spec.site}"
        )
    if not spec.source:
        raise ConfigError(
            f"intervene {name!r}: op=mean needs a source of means: source=first_pass (an extra pass "
            "over the dataset) or source=PATH of an earlier run's probe.h5 that captured this site"
        )
    if spec.source != "first_pass" and not Path(spec.source).is_file():
        raise DataError(
            f"intervene {name!r}: source={spec.source!r} is not a file; give the probe.h5 of an "
            "earlier run that captured this site, or source=first_pass"
        )


def _objective(cfg, edits: dict) -> None:
    """probe.objective's checks, where the run differentiates: a gradient site of a probe that
    must select something, or a gradient edit."""
    grads = any(
        s in GRAD_SITES
        for spec in cfg.probes.values()
        if not spec.allow_empty
        for s in spec.capture
    ) or any(e.site in GRAD_EDIT_SITES for e in edits.values())
    if not grads:
        return
    o = cfg.objective
    if o.name not in OBJECTIVES:
        raise ConfigError(f"unknown objective {o.name!r}; choose one of {', '.join(OBJECTIVES)}")
    if o.name == "logit":
        k = _value(o, "index")
        if k is None:
            raise ConfigError(
                "objective=logit needs the logit to differentiate: add objective.index=K "
                "(0 for the first output)"
            )
        n = cfg.model.num_classes if cfg.model.library in ("torchvision", "timm") else None
        if n is not None and not -n <= k < n:
            raise ConfigError(
                f"objective.index={k} is out of range for a model output of {n} logits; "
                f"give 0 <= index < {n}"
            )
    if o.name == "custom" and _value(o, "_target_") is None:
        raise ConfigError(
            "objective._target_ is missing; name what to import, e.g. "
            "objective._target_=my_losses.per_sample_loss"
        )


def _store(s) -> None:
    """probe.store's checks (a WriteError there, where a ProbeWriter is made directly)."""
    if s.compression not in COMPRESSIONS:
        raise ConfigError(
            f"store.compression={s.compression!r} is unknown; choose from {', '.join(COMPRESSIONS)}"
        )
    if s.mode not in ("full", "stats"):
        raise ConfigError(f"store.mode={s.mode!r} is unknown; choose full or stats")
    if s.queue_batches < 1:
        raise ConfigError(f"store.queue_batches={s.queue_batches} must be at least 1")
    level = s.compression_level
    if s.compression == "gzip" and level is not None and not 0 <= level <= 9:
        raise ConfigError(
            f"store.compression_level={level} is out of range for gzip; give 0-9 "
            "(1 is fastest, 9 smallest)"
        )


def unread_keys(cfg: DictConfig) -> list[str]:
    """A message per key of `cfg` that the schema (config.Config) does not have: Hydra's `+key=`
    adds any key, even a misspelt one, which nothing would read. Dict-typed fields (model.kwargs,
    model.config, probes and intervene, typed elsewhere) are free-form and not looked into."""
    return list(_unread(cfg, Config, ""))


def _unread(node: DictConfig, schema, prefix: str):
    hints = typing.get_type_hints(schema)
    for key in node:
        if not prefix and key == "hydra":
            continue
        path = f"{prefix}{key}"
        if key not in hints:
            close = difflib.get_close_matches(str(key), list(hints), n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            yield f"{path} is not a key probe reads{hint}; it has no effect"
            continue
        child = node._get_node(key)
        nested = isinstance(child, DictConfig) and not child._is_missing() and not child._is_none()
        if nested and dataclasses.is_dataclass(hints[key]):
            yield from _unread(child, hints[key], f"{path}.")
