"""Build HuggingFace transformers and timm models from `model.*` (library=hf|timm).

Both libraries are optional extras, imported only here. Hub names are checked with one request
before loading: huggingface_hub retries a failed download five times with backoff (about 23 s per
file) before it raises, so without this an offline machine would wait long for a plain error.
"""

from __future__ import annotations

import difflib
import importlib
from pathlib import Path

import torch
from torch import nn

from probe.config import HF_TASKS, ModelConfig
from probe.errors import CheckpointError, ConfigError
from probe.models.placement import check_map, dispatch, hf_options, weight_dtype
from probe.plan import ModelSpec, plain

AUTO_CLASSES = {
    "base": "AutoModel",
    "causal_lm": "AutoModelForCausalLM",
    "masked_lm": "AutoModelForMaskedLM",
    "sequence_classification": "AutoModelForSequenceClassification",
    "token_classification": "AutoModelForTokenClassification",
}
DEFAULT_NUM_CLASSES = ModelConfig.num_classes  # torchvision's default: for hf, "not set"
OFFLINE_HINT = (
    "give model.name=DIR, a folder written by save_pretrained, or build without weights: "
    "model.pretrained=false +model.config.model_type=TYPE (e.g. gpt2, bert, llama)"
)


def require(module: str, extra: str):
    """The imported `module`, or a ConfigError naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(
            f"model.library={extra} needs the {module} package: pip install -e '.[{extra}]'"
        ) from None


def _hub_error(repo_id: str, filename: str) -> Exception | None:
    """None when the hub has `filename` in `repo_id`, else the error of one try (no retries;
    at most HF_HUB_ETAG_TIMEOUT seconds). An offline-mode hub answers at once."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url

    try:
        get_hf_file_metadata(hf_hub_url(repo_id, filename), timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except Exception as e:
        return e
    return None


def _unreachable(error: Exception | None) -> bool:
    """The hub did not answer (no network, offline mode, timeout), unlike 'no such file'."""
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError

    return error is not None and not isinstance(error, (HfHubHTTPError, HFValidationError))


def _cached(repo_id: str, *filenames: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return any(isinstance(try_to_load_from_cache(repo_id, f), str) for f in filenames)


def _check_hub_name(name: str, hint: str) -> dict:
    """Loading options for a hub name that is not a local folder (local_files_only when the hub is
    unreachable but the cache has the model), or a ConfigError that says what is wrong."""
    from huggingface_hub import errors

    no_file = getattr(errors, "RemoteEntryNotFoundError", errors.EntryNotFoundError)  # hub < 1.0

    if name.startswith(("/", ".", "~")) or name.count("/") > 1:
        raise ConfigError(f"model.name={name!r} is not a directory; {hint}")
    error = _hub_error(name, "config.json")
    if error is None:
        return {}
    if _unreachable(error):
        if _cached(name, "config.json"):
            return {"local_files_only": True}
        raise ConfigError(
            f"model.name={name!r} is not a local directory, and the HuggingFace hub cannot be "
            f"reached ({type(error).__name__}) nor is it in the local cache; {hint}"
        )
    if isinstance(error, errors.GatedRepoError):
        raise ConfigError(
            f"model.name={name!r} is a gated repository: accept its terms on huggingface.co and "
            "log in (hf auth login), or give model.name=DIR of a downloaded copy"
        )
    if isinstance(error, no_file):
        raise ConfigError(
            f"model.name={name!r} has no config.json on the HuggingFace hub: is it a transformers "
            "model? (timm models: model=timm)"
        )
    raise ConfigError(
        f"model.name={name!r} is neither a local directory nor a model on the HuggingFace hub "
        f"({_first_line(error)}); check the spelling, or {hint}"
    )


def _hf_config(transformers, cfg, name: str, overrides: dict, load: dict):
    """The model's config: from `name` (a folder or hub name), or for pretrained=false from
    `model.config.model_type` alone, with no network; with the overrides applied."""
    model_type = overrides.pop("model_type", None)
    if cfg.task.endswith("_classification") and cfg.num_classes != DEFAULT_NUM_CLASSES:
        overrides.setdefault("num_labels", int(cfg.num_classes))
    if cfg.pretrained is False and model_type is not None and not Path(name).is_dir():
        if model_type not in transformers.CONFIG_MAPPING:
            known = list(transformers.CONFIG_MAPPING.keys())
            close = difflib.get_close_matches(str(model_type), known, n=5) or known[:5]
            raise ConfigError(
                f"model.config.model_type={model_type!r} is not a transformers model type; "
                f"closest: {', '.join(close)}"
            )
        _check_keys(transformers.CONFIG_MAPPING[model_type](), overrides)
        # the constructor, not setattr: derived fields (head_dim, rope) follow the overrides
        return transformers.AutoConfig.for_model(model_type, **overrides)
    try:
        config, unused = transformers.AutoConfig.from_pretrained(
            name, return_unused_kwargs=True, **load, **overrides
        )  # sets the overrides that are fields of the config
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"model.name={name!r}: its config cannot be loaded ({_first_line(e)}); "
            + ("fix or rewrite its config.json" if Path(name).is_dir() else OFFLINE_HINT)
        ) from None
    if model_type is not None and model_type != config.model_type:
        raise ConfigError(
            f"model.config.model_type={model_type!r} disagrees with model.name={name!r}, a "
            f"{config.model_type!r} model; drop model.config.model_type"
        )
    rope = getattr(config, "rope_parameters", None)
    for key, value in unused.items():
        if isinstance(rope, dict) and key in rope:  # transformers 5 keeps rope_theta in there
            rope[key] = value
        else:
            _check_keys(config, {key: value})
    return config


def _check_keys(config, overrides: dict) -> None:
    """A ConfigError for an override that is no field of the config (a typo would else be set
    as a new attribute that no model reads)."""
    known = set(config.to_dict()) | set(getattr(config, "attribute_map", {}))
    known |= set(getattr(config, "rope_parameters", None) or {})
    for key in overrides:
        if key not in known and not hasattr(config, key):
            close = difflib.get_close_matches(key, sorted(known), n=5)
            raise ConfigError(
                f"model.config.{key} is not a field of {type(config).__name__}; "
                f"closest: {', '.join(close) or 'none'}"
            )


def build_hf(cfg: ModelSpec, seed: int) -> nn.Module:
    """A transformers model for `model.task`: the weights of `model.name` (pretrained unset or
    true), or a random init seeded by `seed` (pretrained=false); in `model.dtype` (precision=bf16
    autocasts besides) and placed by `model.device_map`, use_cache off, in eval mode."""
    transformers = require("transformers", "hf")
    name = str(cfg.name)
    overrides, kwargs = plain(cfg.config), plain(cfg.kwargs)
    no_cache = "use_cache" not in overrides
    load: dict = {}
    if Path(name).expanduser().is_dir():
        name = str(Path(name).expanduser())
        if not (Path(name) / "config.json").is_file():
            raise CheckpointError(
                f"model.name={name!r} is a directory without config.json; give a folder written "
                "by save_pretrained (model and config)"
            )
    elif "model_type" in overrides:  # the shipped configs: offline, built from model.config
        if cfg.pretrained is not False:
            load = _check_hub_name(name, "model.pretrained=false builds it from model.config")
    else:
        load = _check_hub_name(name, OFFLINE_HINT)
    if "trust_remote_code" in kwargs:  # the config's code too
        load["trust_remote_code"] = kwargs["trust_remote_code"]
    config = _hf_config(transformers, cfg, name, overrides, load)
    load.pop("trust_remote_code", None)
    if no_cache:  # probing never needs the KV cache; it would be one more output
        text = getattr(config, "get_text_config", lambda: config)()  # of a multimodal model
        for part in {id(config): config, id(text): text}.values():
            if hasattr(part, "use_cache"):
                part.use_cache = False
    dtype_key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    dtype = {} if {"dtype", "torch_dtype"} & set(kwargs) else {dtype_key: weight_dtype(cfg)}
    auto = getattr(transformers, AUTO_CLASSES[cfg.task])
    torch.manual_seed(seed)  # the random init, and any head that the weights do not hold
    try:
        if cfg.pretrained is False:  # built whole, then placed
            return dispatch(auto.from_config(config, **dtype, **kwargs), cfg).eval()
        placing = hf_options(cfg)
        if isinstance(placing.get("device_map"), dict):  # its names checked on a weightless copy
            from accelerate import init_empty_weights

            with init_empty_weights():
                check_map(auto.from_config(config, **dtype), placing["device_map"])
        model = auto.from_pretrained(name, config=config, **load, **dtype, **placing, **kwargs)
    except ValueError as e:
        if "offload" in str(e):
            raise ConfigError(
                f"model.device_map={cfg.device_map}: {_first_line(e)}; give "
                "model.offload_folder=DIR or more model.max_memory"
            ) from None
        if "Unrecognized configuration class" in str(e):
            raise ConfigError(
                f"model.task={cfg.task} has no {config.model_type!r} model in transformers; "
                f"try another of {', '.join(HF_TASKS)}"
            ) from None
        raise ConfigError(f"model.name={name!r}, model.kwargs={kwargs}: {_first_line(e)}") from None
    except TypeError as e:
        raise ConfigError(f"model.kwargs={kwargs} rejected: {_first_line(e)}") from None
    except (OSError, RuntimeError) as e:
        raise CheckpointError(
            f"model.name={name!r}: the weights cannot be loaded ({_first_line(e)}); "
            "model.pretrained=false builds a seeded random init from the config alone"
        ) from None
    return model.eval()


def build_timm(cfg: ModelSpec, seed: int) -> nn.Module:
    """`timm.create_model(name, pretrained, num_classes, **kwargs)` seeded by `seed`, eval mode."""
    timm, name = require("timm", "timm"), str(cfg.name)
    if not name.startswith(("hf-hub:", "hf_hub:", "local-dir:")) and not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=5, cutoff=0.5)
        raise ConfigError(
            f"unknown timm model {name!r}; closest: {', '.join(close) or 'none'} "
            "(timm.list_models('*pattern*') lists them)"
        )
    pretrained, kwargs = bool(cfg.pretrained), plain(cfg.kwargs)
    if pretrained or name.startswith(("hf-hub:", "hf_hub:")):  # the latter fetch their config
        _check_timm_weights(timm, name)
    torch.manual_seed(seed)
    try:
        model = timm.create_model(
            name, pretrained=pretrained, num_classes=cfg.num_classes, **kwargs
        )
    except (TypeError, ValueError, RuntimeError, OSError) as e:
        if pretrained and not isinstance(e, TypeError):
            raise CheckpointError(
                f"timm model {name!r}: the pretrained weights cannot be loaded ({_first_line(e)}); "
                "download them elsewhere and pass model.checkpoint=PATH (model.pretrained=false)"
            ) from None
        raise ConfigError(
            f"timm model {name!r} with model.kwargs={kwargs} and model.num_classes="
            f"{cfg.num_classes}: {_first_line(e)}"
        ) from None
    return model.eval()


def _check_timm_weights(timm, name: str) -> None:
    """Fail at once when the files live on an unreachable hub and are not cached."""
    repo: str | None
    files: tuple[str, ...]
    if name.startswith(("hf-hub:", "hf_hub:")):
        repo, files = name.split(":", 1)[1].split("@")[0], ("config.json",)
    elif name.startswith("local-dir:"):
        return
    else:
        try:
            pretrained_cfg = timm.models.get_pretrained_cfg(name)
        except RuntimeError as e:  # an unknown tag
            known = timm.list_pretrained(name.split(".")[0] + ".*")
            raise ConfigError(f"model.name={name!r}: {e} Known: {', '.join(known[:8])}") from None
        repo = getattr(pretrained_cfg, "hf_hub_id", None)
        files = ("model.safetensors", "pytorch_model.bin")
    if repo and not _cached(repo, *files) and _unreachable(error := _hub_error(repo, files[0])):
        raise CheckpointError(
            f"timm model {name!r}: its files are on the HuggingFace hub ({repo}), which cannot "
            f"be reached ({type(error).__name__}); download the weights elsewhere and pass "
            "model.pretrained=false model.checkpoint=PATH"
        )


def vocab_size(model: nn.Module) -> int | None:
    """Rows of the input embedding (token ids must stay below it): a transformers model's, else
    the model's first nn.Embedding; None for models without one."""
    try:
        # transformers' method: Module.__getattr__'s type knows submodules and tensors only
        embedding = model.get_input_embeddings()  # type: ignore[operator]
    except (AttributeError, NotImplementedError):  # not a transformers model, or none to give
        embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return embedding.num_embeddings if isinstance(embedding, nn.Embedding) else None


def pad_token_id(model: nn.Module) -> int | None:
    """The padding id of a transformers model's config, if it has one."""
    value = getattr(getattr(model, "config", None), "pad_token_id", None)
    return value if isinstance(value, int) else None


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
