"""Config errors decided from the config alone, before torch is imported or a model is built.

Each check that needs neither torch nor a model lives here once: the modules that build the
pieces (probe.data.batches, probe.data.tokens, probe.models.build, probe.hooks.select, probe.intervene.edits, probe.hooks.objective)
call these functions, so a caller that builds a piece directly gets the same error, and
`check_config` calls them all first, so that a command line mistake is reported in a fraction of
a second instead of after the imports and the model. The name lists are probe.config's. The checks
of probe.hooks.device, probe.hooks.forward, probe.stats.backend, probe.store.writer, probe.models.hub and probe.launch.run's device are
still repeated here with their messages (tests/test_cli_newcomer.py holds them equal).
"""

from __future__ import annotations

import difflib
import importlib.util
import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from probe.config import (
    BACKWARD_SITES,
    DATASETS,
    DTYPES,
    EDIT_SITES,
    GRAD_EDIT_SITES,
    IG_METHODS,
    LOGIT_INDICES,
    OBJECTIVES,
    OPS,
    REDUCTIONS,
    ROWS,
    SITES,
    TOKEN_REDUCTIONS,
    Config,
    GridSpec,
    ProbeSpec,
    edit_specs,
    require_target,
    typed,
)
from probe.errors import ConfigError, DataError
from probe.model_checks import DEVICE, _choice, _value, at_least, check_model

SEED_LIMIT = 1 << 40


def check_config(cfg: DictConfig) -> None:
    """Raise the error a run would raise later for a value the config alone decides (same type
    and message). Types each probe as a ProbeSpec in place first: one added on the command line
    composes untyped, and select_modules reads ProbeSpec's defaults."""
    typed_probes(cfg)
    check_seed("seed", cfg.seed)
    check_model(cfg.model)
    _dataset(cfg.dataset)
    check_run_options(cfg)
    for name, spec in cfg.probes.items():
        check_probe_spec(name, spec)
        check_match(f"probe {name!r}", spec.match)
    edits = _edits(cfg.get("intervene"))
    _objective(cfg, edits)


def typed_probes(cfg: DictConfig) -> None:
    """Every entry of cfg.probes merged onto ProbeSpec (a misspelt key is a ConfigError naming
    it and ProbeSpec's keys); untyped entries are replaced by their typed form."""
    probes = cfg.get("probes") or {}
    for name, node in probes.items():  # `+probes.head.layers=fc` composes a string, not a list
        for key, value in node.items() if isinstance(node, DictConfig) else ():
            if key in ("layers", "types", "exclude", "capture") and isinstance(value, str):
                raise ConfigError(
                    f"probe {name!r}: {key}={value!r} is not a list; write it in brackets: "
                    f"probes.{name}.{key}=[{value}]"
                )
    done = {name: typed(ProbeSpec, node, f"probe {name!r}") for name, node in probes.items()}
    untyped = [n for n in done if OmegaConf.get_type(probes._get_node(n)) is not ProbeSpec]
    if untyped:
        with read_write(cfg.probes), open_dict(cfg.probes):
            for name in untyped:
                cfg.probes[name] = done[name]


def check_seed(key: str, seed) -> None:
    """Seeds derived from `seed` (seed * 1_000_003 + sample, edit, layer) must fit torch's 64-bit
    generators; a larger one would fail deep in the data loader."""
    if seed is not None and not -SEED_LIMIT < seed < SEED_LIMIT:
        raise ConfigError(
            f"{key}={seed} is out of range: the seeds derived from it (per sample, per edit) must "
            f"fit torch's 64-bit generator; give |{key}| < 2**40 ({SEED_LIMIT}), e.g. {key}=0"
        )


# -- dataset (probe.data.batches) -------------------------------------------------------------------------
def check_dataset(d) -> None:
    """The dataset config's sizes and name, and the root or path its kind needs."""
    at_least("dataset.batch_size", d.batch_size)
    at_least("dataset.num_samples", d.num_samples, note=" (or null for all)")
    if d.name not in DATASETS:
        raise ConfigError(f"unknown dataset {d.name!r}; choose one of {', '.join(DATASETS)}")
    for key in ("image_size", "channels", "num_classes"):
        at_least(f"dataset.{key}", d.get(key), note=" (or null for the model's own)")
    at_least("dataset.num_workers", d.num_workers, 0, " (0 loads in the main process)")
    if d.name in ("text", "random_tokens"):
        at_least("dataset.seq_len", d.seq_len, note=" (tokens per row)")
    if d.name == "imagefolder":
        at_least("dataset.resize", d.resize, note=" (pixels)")
        at_least("dataset.crop", d.crop, note=" (pixels)")
        if any(v <= 0 for v in d.std):
            raise ConfigError(f"dataset.std={list(d.std)} must be > 0 (inputs are divided by it)")
    if d.name == "imagefolder" and _value(d, "root") is None:
        raise ConfigError("dataset=imagefolder needs dataset.root=DIR (a folder of class folders)")
    if d.name == "tensors" and _value(d, "path") is None:
        raise ConfigError("dataset=tensors needs dataset.path=FILE (a .pt file of inputs)")


def check_root(root) -> Path:
    """dataset.root of dataset=imagefolder, which must be a directory."""
    p = Path(str(root))
    if not p.is_dir():
        raise DataError(
            f"dataset.root={str(root)!r} is not a directory; give a folder of class sub-folders"
        )
    return p


def check_data_file(
    path, what: str = "a .pt file of inputs", fix: str = "; fix its permissions"
) -> Path:
    """dataset.path, which must be a readable file; `what` says what it holds (dataset=tensors'
    by default; probe.data.tokens gives its own, and no `fix`)."""
    p = Path(str(path))
    if p.is_dir():
        raise DataError(f"dataset.path={str(path)!r} is a directory; give {what}")
    if not p.is_file():
        raise DataError(f"dataset.path={str(path)!r} does not exist; give {what}")
    if not os.access(p, os.R_OK):
        raise DataError(f"dataset.path={str(path)!r} cannot be read (permission denied){fix}")
    return p


def _dataset(d) -> None:
    check_dataset(d)
    if d.name == "imagefolder":
        check_root(_value(d, "root"))
    if d.name == "tensors":
        check_data_file(_value(d, "path"))
    tok = str(_value(d, "tokenizer") or "")  # a local folder (a hub name has at most one "/")
    local = tok.startswith(("/", ".", "~")) or tok.count("/") > 1
    if d.name in ("text", "pairs") and local and not Path(tok).expanduser().is_dir():
        raise DataError(
            f"dataset.tokenizer={tok!r} is not a directory; give a folder saved with "
            "tokenizer.save_pretrained(DIR), or leave it unset for the model's"
        )


def check_run_options(cfg) -> None:
    """The options of how a run runs: device, precision, /model/output, the statistics backend
    and store.* (the run checks them here too when its config did not come through
    check_config: the Python API's)."""
    _store(cfg.store, str(cfg.stats.get("during", "run")))
    for key in ("topk", "bottomk", "topk_quantiles"):
        at_least(f"stats.{key}", cfg.stats.get(key, 0), 0, " (0: off)")
    name = cfg.device
    if name != "auto" and not DEVICE.match(str(name)):
        raise ConfigError(f"device={name!r} is not a torch device; use cpu, cuda, cuda:N or auto")
    # precision, store.model_output, stats.backend, store.mode and store.compression are Choices
    # of the schema: Hydra refused any other value when it composed the config
    if cfg.stats.backend == "numba" and importlib.util.find_spec("numba") is None:
        raise ConfigError(
            "stats.backend=numba needs numba, which is not installed: pip install -e "
            "'.[fast]', or use stats.backend=torch"
        )


# -- probes (probe.hooks.select) ------------------------------------------------------------------------
def check_probe_spec(name: str, spec) -> None:
    """A probe's sites, reduction, dtype, rows and unit axis (a ProbeSpec or its DictConfig)."""
    for site in spec.capture:
        if site not in SITES:
            raise ConfigError(
                f"probe {name!r}: capture site {site!r} is unknown; choose from {', '.join(SITES)}"
            )
    if not spec.capture:
        raise ConfigError(f"probe {name!r}: capture is empty; list sites from {', '.join(SITES)}")
    for key, known in (("reduce", REDUCTIONS), ("dtype", DTYPES), ("rows", ROWS)):
        _choice(f"probe {name!r}: {key}", getattr(spec, key), known)
    if spec.rows == "tokens" and spec.reduce != "none":
        raise ConfigError(
            f"probe {name!r}: rows: tokens keeps every token, so it takes reduce: none, not "
            f"{spec.reduce!r} (the token reductions {', '.join(TOKEN_REDUCTIONS)} give one row "
            "per sample)"
        )
    grid = getattr(spec, "cam_grid", None)
    if grid is not None and (len(grid) != 2 or any(int(g) < 1 for g in grid)):
        raise ConfigError(
            f"probe {name!r}: cam_grid={list(grid)} is not a grid; give [height, width] of the "
            "token grid, e.g. cam_grid: [14, 14] for a ViT-B/16 at 224 px"
        )
    at_least(f"probes.{name}.cam_skip_tokens", getattr(spec, "cam_skip_tokens", 0), 0)
    axis = spec.unit_axis
    if axis != "auto" and (isinstance(axis, bool) or not isinstance(axis, int) or axis == 0):
        raise ConfigError(
            f"probe {name!r}: unit_axis={axis!r} is neither auto nor a nonzero axis; give auto, "
            "1 (channels of N, C, H, W) or -1 (features of N, T, C)"
        )


def check_match(label: str, match: str) -> None:
    """`match` of a probe, edit or grid: all or any of its layer patterns."""
    if match not in ("all", "any"):
        raise ConfigError(f"{label}: match={match!r} is unknown; choose all or any")


# -- edits (probe.intervene.edits) ----------------------------------------------------------------------
def check_edit(name: str, spec) -> None:
    """An edit's site and op, checked before its modules are matched."""
    _choice(f"intervene {name!r}: site", spec.site, EDIT_SITES)
    _choice(f"intervene {name!r}: op", spec.op, OPS)


def check_edit_op(name: str, spec) -> None:
    """The arguments of an edit's op (clamp, noise, mean), checked as its op is made."""
    if spec.op == "clamp" and spec.min is None and spec.max is None:
        raise ConfigError(
            f"intervene {name!r}: op=clamp needs min and/or max (e.g. +intervene.{name}.max=1.0)"
        )
    check_seed(f"intervene.{name}.seed", spec.seed)
    if spec.op == "noise" and spec.std < 0:
        raise ConfigError(f"intervene {name!r}: std={spec.std} must be >= 0")
    if spec.op != "mean":
        return
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


def _edits(intervene) -> dict:
    """The typed edits, each checked as far as no model is needed."""
    edits = edit_specs(intervene)
    for name, spec in edits.items():
        check_edit(name, spec)
        check_edit_op(name, spec)
    if intervene and intervene.get("grid") is not None:
        typed(GridSpec, intervene.grid, "intervene.grid")
    return edits


# -- objective (probe.hooks.objective) ------------------------------------------------------------------
def check_objective(o, num_outputs: int | None) -> None:
    """The objective's name, a logit's index (below `num_outputs` where it is known) and a custom
    one's `_target_`."""
    if o.name not in OBJECTIVES:
        raise ConfigError(f"unknown objective {o.name!r}; choose one of {', '.join(OBJECTIVES)}")
    if o.name in ("logit", "logprob"):
        k = _value(o, "index")
        if k is None:
            raise ConfigError(
                f"objective={o.name} needs the class to explain: add objective.index=K (0 for the "
                "first output), objective.index=target (each sample's label) or "
                "objective.index=predicted (the model's argmax)"
            )
        if isinstance(k, str) and k in LOGIT_INDICES:
            return
        if isinstance(k, bool) or not isinstance(k, int):
            raise ConfigError(
                f"objective.index={k!r} is neither a class number nor one of "
                f"{', '.join(LOGIT_INDICES)}"
            )
        if num_outputs is not None and not -num_outputs <= k < num_outputs:
            raise ConfigError(
                f"objective.index={k} is out of range for a model output of {num_outputs} logits; "
                f"give 0 <= index < {num_outputs}"
            )
    if o.name == "custom":
        require_target("objective._target_", _value(o, "_target_"))


def _objective(cfg, edits: dict) -> None:
    """Where the run differentiates: a gradient site of a probe that must select something, or a
    gradient edit. The output width is known for torchvision and timm models."""
    grads = any(
        s in BACKWARD_SITES
        for spec in cfg.probes.values()
        if not spec.allow_empty
        for s in spec.capture
    ) or any(e.site in GRAD_EDIT_SITES for e in edits.values())
    if grads:
        n = cfg.model.num_classes if cfg.model.library in ("torchvision", "timm") else None
        check_objective(cfg.objective, n)
    if any(s == "ig_output" for spec in cfg.probes.values() for s in spec.capture):
        check_attribution(cfg.get("attribution"))


def check_attribution(a) -> None:
    """attribution.* of integrated gradients (ig_output)."""
    if a is None:
        return
    if a.steps < 2:
        raise ConfigError(
            f"attribution.steps={a.steps} must be at least 2 (points between the baseline and "
            "the activation; 32 by default, more for a smaller completeness gap)"
        )
    _choice("attribution.method", a.method, IG_METHODS)
    at_least("attribution.internal_batch_size", a.internal_batch_size, note=" (rows per pass)")
    base = str(a.baseline)
    if base not in ("zeros", "mean") and not (Path(base) / "probe.h5").is_file():
        raise ConfigError(
            f"attribution.baseline={base!r} is neither zeros, mean nor a run directory holding "
            "probe.h5; give zeros, mean (this run's mean of the layer) or an earlier run's "
            "directory that captured the layer's output"
        )


def _store(s, during: str = "run") -> None:
    """store.* (and stats.during, which needs stored rows): the writer takes them as they are."""
    at_least("store.queue_batches", s.queue_batches)
    if s.mode == "stats" and during != "run":
        raise ConfigError(
            f"stats.during={during} needs store.mode=full: a statistics-only run keeps no rows to "
            "compute them from later; use stats.during=run"
        )
    at_least("store.chunk_bytes", s.chunk_bytes, note=" (bytes per HDF5 chunk; default 1048576)")
    at_least("store.flush_seconds", s.flush_seconds, 0, " (0 flushes after every batch)")
    name = str(s.filename)
    if not name or Path(name).is_absolute() or name.startswith("~") or ".." in Path(name).parts:
        raise ConfigError(
            f"store.filename={name!r} is outside the run directory: the file must live in the run "
            "directory (hydra.run.dir); give a relative name such as store.filename=probe.h5, and "
            "choose the folder with hydra.run.dir=DIR"
        )
    level = s.compression_level
    if s.compression == "gzip" and level is not None and not 0 <= level <= 9:
        raise ConfigError(
            f"store.compression_level={level} is out of range for gzip; give 0-9 "
            "(1 is fastest, 9 smallest)"
        )


def unread_keys(cfg) -> list[str]:
    """A message per key of `cfg` that the schema (probe.config.Config) does not have: Hydra's `+key=`
    adds any key, even a misspelt one, which nothing would read. Dict-typed fields (model.kwargs,
    model.config, probes and intervene, typed elsewhere) are free-form and not looked into."""
    return list(_unread(cfg, Config, ""))


def _unread(node, schema, prefix: str):
    import dataclasses
    import typing

    from omegaconf import DictConfig

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
