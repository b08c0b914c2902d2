"""The checks of a run's model config before torch is imported (probe.plan calls them, once, with
the rest of probe.checks): which library builds it, its checkpoint file, and where and in which
dtype its weights live. probe.models.placement checks the map against the model itself."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from probe.checks import DEVICE, at_least, choice
from probe.config import (
    DEVICE_MAPS,
    HF_TASKS,
    LIBRARIES,
    WEIGHT_DTYPES,
    library_of,
    require_target,
)
from probe.errors import CheckpointError, ConfigError
from probe.specs import ModelSpec


def check_library(m: ModelSpec) -> str:
    """The library that builds model spec `m` (probe.config.library_of); a custom model must name
    its class in `_target_`."""
    if (m.library or "torchvision") not in LIBRARIES:
        raise ConfigError(f"model.library={m.library!r} is not one of {', '.join(LIBRARIES)}")
    library = library_of(m)
    if library == "custom":
        require_target("model._target_", m._target_)
    return library


def check_checkpoint(path) -> Path:
    """The path of model.checkpoint, which must be a file."""
    p = Path(path)
    if p.is_dir():
        inside = sorted(f.name for f in p.iterdir() if f.suffix in (".pt", ".pth", ".bin"))[:3]
        raise CheckpointError(
            f"model.checkpoint={path!r} is a directory; give the checkpoint file itself, e.g. "
            f"model.checkpoint={p / (inside[0] if inside else 'model.pt')}"
            + (f" (it holds {', '.join(inside)})" if inside else "")
        )
    if not p.is_file():
        raise CheckpointError(
            f"model.checkpoint={path!r} does not exist; give the path of a .pt state_dict"
        )
    return p


def check_model(m: ModelSpec) -> None:
    """The model config's values: library, task, classes, checkpoint, placement."""
    library = check_library(m)
    if library == "hf" and m.task not in HF_TASKS:
        raise ConfigError(f"model.task={m.task!r} is not one of {', '.join(HF_TASKS)}")
    at_least("model.num_classes", m.num_classes, note=" (the classes the model outputs)")
    path = m.checkpoint
    if path:
        check_checkpoint(path)
    check_placement(m, library)


def check_placement(m: ModelSpec, library: str) -> None:
    """model.dtype, device_map, max_memory, offload_folder and low_cpu_mem_usage, as far as the
    config decides them (probe.models.placement checks the map's modules against the model)."""
    choice("model.dtype", m.dtype or "float32", WEIGHT_DTYPES)
    device_map, folder = m.device_map, m.offload_folder
    if m.low_cpu_mem_usage and library != "hf":
        raise ConfigError(
            f"model.low_cpu_mem_usage applies to model=hf (transformers' loading), not to "
            f"model.library={library}; drop it"
        )
    if device_map is not None and library == "hf" and m.checkpoint:
        raise ConfigError(
            "model.checkpoint cannot be loaded into a model that model.device_map places (its "
            "offloaded weights are not in memory); save the checkpointed model with "
            "save_pretrained and give model.name=DIR"
        )
    if device_map is None:
        for key in ("max_memory", "offload_folder"):
            if getattr(m, key) is not None:
                raise ConfigError(
                    f"model.{key} is set but model.device_map is not, so nothing reads it; "
                    "give model.device_map=auto (or a mapping module -> device)"
                )
        return
    memory = m.max_memory or {}
    if not isinstance(memory, Mapping):
        raise ConfigError(
            f"model.max_memory={memory!r} is not a mapping device -> size; give e.g. "
            "model.max_memory={0:20GiB,cpu:64GiB}"
        )
    if isinstance(device_map, str | int):
        text = str(device_map)
        if text not in DEVICE_MAPS and not DEVICE.match(text) and not text.isdigit():
            raise ConfigError(
                f"model.device_map={device_map!r} is unknown; choose from "
                f"{', '.join(DEVICE_MAPS)}, a device (cuda:0, cpu) or a mapping module -> device"
            )
        places = [str(k) for k in memory]
    elif isinstance(device_map, Mapping):
        places = [str(v) for v in device_map.values()]
        for module, place in device_map.items():
            if place != "disk" and not DEVICE.match(str(place)) and not str(place).isdigit():
                raise ConfigError(
                    f"model.device_map[{module!r}]={place!r} is not a device; give cpu, disk, "
                    "cuda:N or a GPU index"
                )
    else:
        raise ConfigError(
            f"model.device_map={device_map!r} is neither a strategy ({', '.join(DEVICE_MAPS)}) "
            "nor a mapping module -> device"
        )
    if "disk" in places and not folder:
        raise ConfigError(
            "model.device_map offloads to disk but model.offload_folder is not set; give "
            "model.offload_folder=DIR (a folder with room for the offloaded weights)"
        )
