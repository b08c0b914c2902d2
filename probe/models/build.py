"""Build the network a config names: torchvision, timm or transformers by name (the last two in
probe.models.hub), a user class by `_target_`, a checkpoint.

torchvision is imported where a torchvision model is built: importing it imports torch._dynamo
(its detection ops ask whether torch.compile is supported), about two seconds that a run of
another model does not need (`torchvision_version` reads its version without it)."""

from __future__ import annotations

import difflib
import importlib.util
import logging
import re
import sys
from pathlib import Path

import torch
from torch import nn

from probe.config import import_target, library_of
from probe.errors import CheckpointError, ConfigError
from probe.models.placement import dispatch
from probe.plan import ModelSpec, plain

log = logging.getLogger("probe")


def classification_models() -> list[str]:
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


_VERSION_LINE = re.compile(r"^__version__ = ['\"]([^'\"]+)['\"]", re.MULTILINE)


def torchvision_version() -> str:
    """`torchvision.__version__` (a run's file records it whatever its model), read from
    torchvision's generated version.py where this process has not imported torchvision."""
    loaded = sys.modules.get("torchvision")
    if loaded is not None:
        return str(loaded.__version__)
    spec = importlib.util.find_spec("torchvision")  # (finds it: runs nothing of it)
    for folder in (spec and spec.submodule_search_locations) or []:
        try:
            found = _VERSION_LINE.search((Path(folder) / "version.py").read_text())
        except OSError:
            continue
        if found:
            return found[1]
    import torchvision

    return str(torchvision.__version__)


def _plain(text: str) -> str:
    """`text` without terminal colour codes (torch's unpickling errors carry some)."""
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def model_input(model: nn.Module, inputs: torch.Tensor, device, non_blocking: bool = False):
    """`inputs` on `device`; floating ones in the dtype of the model's floating parameters, so a
    tensors file saved as float64 (numpy's default) or float16 feeds a float32 model."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    if dtype is not None and inputs.is_floating_point() and inputs.dtype != dtype:
        return inputs.to(device, dtype, non_blocking=non_blocking)
    return inputs.to(device, non_blocking=non_blocking)


def build_model(spec: ModelSpec, seed: int) -> nn.Module:
    """The model of `spec` (a run plan's model) with seeded random init (or the named weights),
    checkpoint loaded, in eval mode.

    `model.library` says where `model.name` comes from; a `_target_` class is always custom."""
    torch.manual_seed(seed)
    kwargs = plain(spec.kwargs)
    library = library_of(spec)
    if library == "custom":
        model = _build_custom(spec._target_, kwargs)
    elif library == "hf":
        from probe.models.hub import build_hf

        model = build_hf(spec, seed)
    elif library == "timm":
        from probe.models.hub import build_timm

        model = build_timm(spec, seed)
    else:
        model = _build_torchvision(spec, kwargs)
    if spec.checkpoint:
        load_checkpoint(model, spec.checkpoint, spec.checkpoint_prefix)
    if library != "hf":  # (transformers loads a model in its dtype and place)
        model = dispatch(model, spec)
    if spec.anatomy:  # what probe.models.anatomy reads for the layer aliases
        model._probe_anatomy = plain(spec.anatomy)
    return model.eval()


def _build_custom(target: str | None, kwargs: dict) -> nn.Module:
    cls = import_target("model._target_", target)
    try:
        model = cls(**kwargs)
    except TypeError as e:
        raise ConfigError(
            f"model._target_={target!r} rejected model.kwargs={kwargs}: {e}"
        ) from None
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model._target_={target!r} built a {type(model).__name__}, not an nn.Module"
        )
    return model


def _build_torchvision(cfg: ModelSpec, kwargs: dict) -> nn.Module:
    import torchvision

    names = classification_models()
    if cfg.name not in names:
        # a missing model.name (None) is not checked before this and fails in difflib with a
        # TypeError (a known bug, left as it is here)
        close: list[str] = difflib.get_close_matches(cfg.name, names, n=5) or names[:5]  # type: ignore[arg-type]
        raise ConfigError(
            f"unknown model {cfg.name!r}; closest torchvision classification models: "
            f"{', '.join(close)}. Use model=torchvision model.name=NAME, or "
            "model=custom model._target_=pkg.mod.Class for your own module"
        )
    if cfg.weights:
        if cfg.num_classes != 1000:
            kwargs.setdefault("num_classes", cfg.num_classes)
        try:
            return torchvision.models.get_model(cfg.name, weights=cfg.weights, **kwargs)
        except (ValueError, KeyError) as e:
            known = [w.name for w in torchvision.models.get_model_weights(cfg.name)]
            raise ConfigError(
                f"model.weights={cfg.weights!r} is not a weights name of {cfg.name} ({e}); choose "
                f"from {', '.join(['DEFAULT', *known])}, or leave it unset for a seeded random init"
            ) from None
        except (OSError, RuntimeError) as e:
            raise CheckpointError(
                f"model.weights={cfg.weights!r} could not be loaded ({e}); this machine may have no "
                "network: download the weights elsewhere and pass model.checkpoint=PATH"
            ) from None
    return torchvision.models.get_model(
        cfg.name, weights=None, num_classes=cfg.num_classes, **kwargs
    )


def load_checkpoint(model: nn.Module, path: str, prefix: str | None = None) -> None:
    """Load a state_dict (weights only, strict keys) and say which keys do not fit. With `prefix`
    only the keys under it are loaded, without it (a wrapper's `module.`, `model.`); a checkpoint
    whose keys all carry such a prefix is named in the error. (probe.model_checks found the file.)"""
    p = Path(path)
    try:
        state = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"model.checkpoint={path!r} is not a readable weights-only checkpoint ({type(e).__name__}: "
            f"{_plain(str(e).splitlines()[0]) if str(e) else ''}); save it with "
            "torch.save(model.state_dict(), path)"
        ) from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(
            f"model.checkpoint={path!r} holds a {type(state).__name__}, not a state_dict of tensors"
        )
    if prefix:
        under = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        if not under:
            raise CheckpointError(
                f"model.checkpoint_prefix={prefix!r}: no key of {path!r} starts with it; its keys "
                f"start {_few(list(state), 3)}"
            )
        if len(under) < len(state):
            log.info("checkpoint: %d keys outside %r left out", len(state) - len(under), prefix)
        state = under
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as e:
        detail = "; ".join(line.strip() for line in str(e).splitlines()[1:4])
        raise CheckpointError(
            f"model.checkpoint={path!r} does not fit {type(model).__name__}: {detail}; "
            "was it saved from another architecture or num_classes?"
        ) from None
    if result.missing_keys or result.unexpected_keys:
        found = key_prefix(list(state), model.state_dict().keys())
        hint = (
            f"; every key carries the prefix {found!r} (a DDP, Lightning or compiled wrapper's): "
            f"load it with model.checkpoint_prefix={found}"
            if found
            else "; was it saved from another architecture or num_classes?"
        )
        raise CheckpointError(
            f"model.checkpoint={path!r} does not fit {type(model).__name__}: "
            f"missing keys {_few(result.missing_keys)}, unexpected keys {_few(result.unexpected_keys)}"
            + hint
        )
    log.info("loaded checkpoint %s: %d tensors into %s", path, len(state), type(model).__name__)


def key_prefix(keys: list[str], wanted) -> str | None:
    """The dotted prefix (`module.`, `model.`, `module._orig_mod.`) common to all `keys` whose
    removal turns them into exactly the `wanted` keys, if there is one."""
    wanted = set(wanted)
    parts = keys[0].split(".")[:-1] if keys else []
    for depth in range(1, len(parts) + 1):
        prefix = ".".join(parts[:depth]) + "."
        if not all(k.startswith(prefix) for k in keys):
            return None
        if {k[len(prefix) :] for k in keys} == wanted:
            return prefix
    return None


def _few(keys: list[str], n: int = 5) -> str:
    shown = ", ".join(keys[:n]) or "none"
    return f"[{shown}{', ...' if len(keys) > n else ''}] ({len(keys)})"
