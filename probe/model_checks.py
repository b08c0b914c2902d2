"""Model config errors decided from the config alone (probe.checks runs them with the rest):
which library builds it, its checkpoint file, and where and in which dtype its weights live."""

from __future__ import annotations

import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from probe.config import DEVICE_MAPS, HF_TASKS, LIBRARIES, WEIGHT_DTYPES, require_target
from probe.errors import CheckpointError, ConfigError

# the device types torch.device parses (the pinned torch's list; `auto` is probe's own)
DEVICE_TYPES = (
    "cpu", "cuda", "ipu", "xpu", "mkldnn", "opengl", "opencl", "ideep", "hip", "ve", "fpga",
    "maia", "xla", "lazy", "vulkan", "mps", "meta", "hpu", "mtia", "privateuseone",
)  # fmt: skip
DEVICE = re.compile(rf"^(?:{'|'.join(DEVICE_TYPES)})(?::(?:0|[1-9][0-9]*))?$")


def _choice(key: str, value, known) -> None:
    if value not in known:
        raise ConfigError(f"{key}={value!r} is unknown; choose from {', '.join(known)}")


def _value(node, key: str):
    """node.key, None where it is unset or `???`."""
    if isinstance(node, DictConfig):
        return None if OmegaConf.is_missing(node, key) else node.get(key)
    return getattr(node, key, None)


def at_least(key: str, value, least: int = 1, note: str = "") -> None:
    """A ConfigError naming `key` where `value` is below `least` (None: unset, accepted)."""
    if value is not None and value < least:
        raise ConfigError(f"{key}={value} must be at least {least}{note}")


def model_library(m) -> str:
    """Which library builds model config `m`: custom where a `_target_`, model.name=custom or
    model.library=custom says so (then `_target_` must be given), else model.library."""
    library = _value(m, "library") or "torchvision"
    if library not in LIBRARIES:
        raise ConfigError(f"model.library={library!r} is not one of {', '.join(LIBRARIES)}")
    target = _value(m, "_target_")
    if not (target or _value(m, "name") == "custom" or library == "custom"):
        return library
    require_target("model._target_", target)
    return "custom"


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


def check_model(m) -> None:
    """The model config's values: library, task, classes, checkpoint, placement."""
    library = model_library(m)
    if (
        library == "hf" and m.task not in HF_TASKS
    ):  # probe.models.hub's, after transformers is imported
        raise ConfigError(f"model.task={m.task!r} is not one of {', '.join(HF_TASKS)}")
    at_least("model.num_classes", m.num_classes, note=" (the classes the model outputs)")
    path = _value(m, "checkpoint")
    if path:
        check_checkpoint(path)
    check_placement(m, library)


def check_placement(m, library: str) -> None:
    """model.dtype, device_map, max_memory, offload_folder and low_cpu_mem_usage, as far as the
    config decides them (probe.models.placement checks the map's modules against the model)."""
    _choice("model.dtype", _value(m, "dtype") or "float32", WEIGHT_DTYPES)
    device_map, folder = _value(m, "device_map"), _value(m, "offload_folder")
    if _value(m, "low_cpu_mem_usage") and library != "hf":
        raise ConfigError(
            f"model.low_cpu_mem_usage applies to model=hf (transformers' loading), not to "
            f"model.library={library}; drop it"
        )
    if device_map is not None and library == "hf" and _value(m, "checkpoint"):
        raise ConfigError(
            "model.checkpoint cannot be loaded into a model that model.device_map places (its "
            "offloaded weights are not in memory); save the checkpointed model with "
            "save_pretrained and give model.name=DIR"
        )
    if device_map is None:
        for key in ("max_memory", "offload_folder"):
            if _value(m, key) is not None:
                raise ConfigError(
                    f"model.{key} is set but model.device_map is not, so nothing reads it; "
                    "give model.device_map=auto (or a mapping module -> device)"
                )
        return
    memory = _value(m, "max_memory") or {}
    if not isinstance(memory, DictConfig | dict):
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
    elif isinstance(device_map, DictConfig | dict):
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
