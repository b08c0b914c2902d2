"""Where a model's weights live, and in which dtype: `model.dtype` and accelerate's device maps.

A device map spreads a model's modules over GPUs and offloads others to CPU memory or disk;
accelerate's hooks move an offloaded module's weights onto its execution device just before it
runs. A placed model stays where it was put: the run never moves it, its inputs go to the device
of the module that takes them, and every capture is read where its tensor is. HF models are
loaded straight into place by transformers (`hf_options`); others are built, then dispatched.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import cast

import torch
from torch import nn

from probe.config import DEVICE_MAPS
from probe.errors import ConfigError

log = logging.getLogger("probe")
WEIGHT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
OFFLOADED = ("cpu", "disk")  # places whose modules run on the main device (accelerate's rule)


def weight_dtype(cfg) -> torch.dtype:
    """The torch dtype of `model.dtype` (checked by probe.model_checks) of a model spec."""
    return WEIGHT_DTYPES[str(cfg.dtype or "float32")]


def _place(value):
    """A device map's value as accelerate takes it: a GPU index as an int, else the string."""
    text = str(value)
    return int(text) if text.isdigit() else text


def device_map(cfg):
    """`model.device_map` as accelerate takes it: None, a strategy or device, or a dict."""
    value = cfg.device_map
    if value is None:
        return None
    if not isinstance(value, Mapping):
        return _place(value)
    return {str(k): _place(v) for k, v in value.items()}


def max_memory(cfg) -> dict | None:
    """`model.max_memory` as accelerate takes it: device -> size."""
    value = cfg.max_memory
    if value is None:
        return None
    return {_place(k): v for k, v in value.items()}


def check_devices(places) -> None:
    """A ConfigError for a GPU the map names that this machine does not have."""
    count = torch.cuda.device_count()
    for place in places:
        text = str(place)
        if text in OFFLOADED or text in DEVICE_MAPS:
            continue
        index = int(text) if text.isdigit() else None
        if text.startswith("cuda"):
            index = int(text.split(":")[1]) if ":" in text else 0
        if index is not None and index >= count:
            raise ConfigError(
                f"model.device_map names GPU {text!r} but this machine has "
                f"{count or 'no'} CUDA device{'s' if count != 1 else ''}; map those modules to "
                "an existing GPU, cpu or disk"
            )


def hf_options(cfg) -> dict:
    """from_pretrained's placement arguments for `model.*` (none when no map is given)."""
    mapping = device_map(cfg)
    out: dict = {}
    if cfg.low_cpu_mem_usage:
        out["low_cpu_mem_usage"] = True  # (transformers 5 always loads this way)
    if mapping is None:
        return out
    check_devices(mapping.values() if isinstance(mapping, dict) else [mapping])
    out["device_map"] = mapping
    if cfg.max_memory is not None:
        out["max_memory"] = max_memory(cfg)
    if cfg.offload_folder:
        out["offload_folder"] = str(cfg.offload_folder)
    return out


def check_map(model: nn.Module, mapping: dict) -> None:
    """A ConfigError for a map key that names no module of `model`, or for weights no key
    places (accelerate would warn, then fail half-way through loading)."""
    modules = dict(model.named_modules())
    for key in mapping:
        if key and key not in modules:
            close = difflib.get_close_matches(key, list(modules), n=3)
            raise ConfigError(
                f"model.device_map names {key!r}, which is no module of {type(model).__name__}"
                f"; closest: {', '.join(close) or 'none'} (python -m probe.sites lists them)"
            )
    if "" in mapping:
        return
    keys = [k + "." for k in mapping]
    loose = [n for n in model.state_dict() if not any(n.startswith(k) for k in keys)]
    if loose:
        owners = sorted({n.rsplit(".", 1)[0] for n in loose})
        raise ConfigError(
            f"model.device_map places no device for the weights of {', '.join(owners[:4])}"
            f"{' ...' if len(owners) > 4 else ''}; map those modules (or a parent) too"
        )


def dispatch(model: nn.Module, cfg) -> nn.Module:
    """`model` cast to `model.dtype` and, with a device map, placed by accelerate: the map
    given, or one accelerate infers for the strategy within `model.max_memory`."""
    model = model.to(weight_dtype(cfg))
    mapping = device_map(cfg)
    if mapping is None:
        return model
    from accelerate import dispatch_model, infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    memory = max_memory(cfg)
    if isinstance(mapping, str | int) and str(mapping) in DEVICE_MAPS:
        no_split = list(getattr(model, "_no_split_modules", None) or [])
        if mapping != "sequential":
            memory = get_balanced_memory(
                model, memory, no_split, low_zero=mapping == "balanced_low_0"
            )
        mapping = infer_auto_device_map(model, memory, no_split)
    elif not isinstance(mapping, dict):
        mapping = {"": mapping}
    check_devices(mapping.values())
    check_map(model, mapping)
    folder = cfg.offload_folder
    if "disk" in mapping.values() and not folder:
        raise ConfigError(
            "model.device_map offloads to disk (with model.max_memory) but model.offload_folder "
            "is not set; give model.offload_folder=DIR"
        )
    model = dispatch_model(model, mapping, offload_dir=str(folder) if folder else None)
    model.hf_device_map = mapping
    return model


def is_placed(model: nn.Module) -> bool:
    """Whether a device map placed `model` (then nothing moves it)."""
    return isinstance(getattr(model, "hf_device_map", None), dict)


def _device_map(model: nn.Module) -> dict[str, int | str]:
    """A placed model's device map (module name: GPU index, device or "cpu"/"disk")."""
    # a plain attribute, not a parameter, buffer or submodule as Module.__getattr__'s type says
    return cast("dict[str, int | str]", model.hf_device_map)


def _main_device(mapping: dict) -> torch.device:
    """Where offloaded modules run: the map's first GPU, else the CPU (accelerate's rule)."""
    gpus = [p for p in mapping.values() if str(p) not in OFFLOADED]
    return _torch_device(gpus[0]) if gpus else torch.device("cpu")


def _torch_device(place) -> torch.device:
    return torch.device(f"cuda:{place}" if isinstance(place, int) else place)


def placement(model: nn.Module, name: str) -> tuple[str, torch.device]:
    """(where module `name`'s weights are kept, the device it runs on) under the model's map."""
    mapping = _device_map(model)
    owner = max(
        (k for k in mapping if not k or name == k or name.startswith(k + ".")),
        key=len,
        default=None,
    )
    if owner is None:  # a module above the map's keys (the model itself): its first entry's
        owner = next(iter(mapping))
    place = mapping[owner]
    runs = _hook_device(model, owner)
    if runs is None:  # accelerate's rule: offloaded modules run on the main device
        runs = _main_device(mapping) if str(place) in OFFLOADED else _torch_device(place)
    return str(place), runs


def _hook_device(model: nn.Module, name: str) -> torch.device | None:
    """The execution device accelerate's hook on module `name` moves its inputs to, if any."""
    try:
        hook = getattr(model.get_submodule(name), "_hf_hook", None)
    except AttributeError:
        return None
    for h in getattr(hook, "hooks", None) or [hook]:
        device = getattr(h, "execution_device", None)
        if device is not None:
            return _torch_device(device)
    return None


def input_device(model: nn.Module) -> torch.device:
    """Where a placed model takes its inputs: the device its first mapped module runs on."""
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    first = min(_device_map(model), key=lambda k: order.get(k, len(order)))
    return placement(model, first)[1]


def describe(model: nn.Module, selections) -> None:
    """Log where each selected layer's weights live and where it runs."""
    for sel in selections:
        kept, runs = placement(model, sel.name)
        offloaded = kept == "disk" or (kept == "cpu" and runs.type != "cpu")
        moved = f", weights kept on {kept} and moved in per call" if offloaded else ""
        log.info("placed %-28s runs on %s%s", sel.name, runs, moved)


def check_param_grads(selections) -> None:
    """param_grad of an offloaded module has no gradient to give: accelerate hands the module
    a fresh copy of its weights each call, and the parameters stay on the meta device."""
    for sel in selections:
        if "param_grad" not in sel.sites:
            continue
        if any(p.device.type == "meta" for p in sel.module.parameters()):
            raise ConfigError(
                f"probe {sel.probe!r} asks for param_grad of {sel.name!r}, whose weights are "
                "offloaded by model.device_map (cpu or disk): they are moved in per call and "
                "get no gradient; map that module to a GPU, or capture grad_output instead"
            )


def _hooks_of(module: nn.Module) -> list:
    """accelerate's hooks on `module` (a SequentialHook's parts), none where it has none."""
    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        return []
    return list(getattr(hook, "hooks", None) or [hook])


def execution_device(module: nn.Module) -> torch.device:
    """Where `module` runs: the execution device of accelerate's hook on it or on a module inside
    it (a device map that offloads keeps the weights elsewhere until the forward), else its
    first parameter's or buffer's device, else the CPU."""
    for inner in module.modules():
        for hook in _hooks_of(inner):
            device = getattr(hook, "execution_device", None)
            if device is not None:
                return _torch_device(device)
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    return torch.device("cpu")


@contextmanager
def onloaded(module: nn.Module) -> Iterator[nn.Module]:
    """`module`'s own weights on its execution device for the block, where a device map
    offloaded them (accelerate keeps them on the meta device outside the module's forward, so a
    forward hook, which runs after it, finds them gone); nothing to do elsewhere."""
    hooks = [h for h in _hooks_of(module) if getattr(h, "offload", False)]
    for hook in hooks:
        hook.pre_forward(module)
    try:
        yield module
    finally:
        for hook in reversed(hooks):
            hook.post_forward(module, None)
