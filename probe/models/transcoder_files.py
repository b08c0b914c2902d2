"""Transcoder sets on disk: circuit-tracer's YAML and the file layouts it reads, SAELens's
transcoder folders, and the check of a set against the model it is used on.

A set is a YAML (circuit-tracer's transcoder-set config) naming, per block, a file:

    model_name: gpt2
    feature_input_hook: mlp.hook_in   # reads mlp_in; ln2.hook_normalized: mlp_normalized;
                                      # hook_resid_mid: resid_mid
    feature_output_hook: hook_mlp_out         # or mlp.hook_out
    transcoders:
      - {id: gpt2-0, layer: 0, filepath: layer_0.safetensors}   # relative to the YAML's folder
      - {id: gpt2-1, layer: 1, filepath: "hf://org/repo/layer_1.safetensors?revision=main"}

circuit-tracer 0.5's lists of bare paths (the layer is the position) and its cache folders
(config.yaml without `transcoders`, beside layer_<i>.safetensors) read too. Each file is one of:

- `relu_skip` (circuit-tracer's safetensors): W_enc (d_tc, d_in), W_dec (d_tc, d_out) (0.5) or
  (d_out, d_tc) (its first release: told apart by b_enc (d_tc,) and b_dec (d_out,)), b_enc,
  b_dec, optional W_skip (d_out, d_in), optional `activation_function.threshold` (JumpReLU);
- `gemma_scope` (a .npz): W_enc (d_in, d_tc), W_dec (d_tc, d_out), b_enc, b_dec, threshold;
- Gemma Scope 2 (safetensors, lower case): w_enc (d_in, d_tc), w_dec (d_tc, d_out), b_enc,
  b_dec, threshold, optional affine_skip_connection (d_in, d_out);
- `saelens`: a folder with cfg.json (architecture transcoder, skip_transcoder or
  jumprelu_transcoder; d_in, d_sae, d_out) and sae_weights.safetensors (W_enc (d_in, d_sae),
  W_dec (d_sae, d_out), b_enc, b_dec, W_skip (d_out, d_in), threshold).

In memory every set has probe.models.transcoder's orientation. `check_transcoders` compares a set
with a model's width and depth; `save_transcoders` writes a YAML and per-layer files that
circuit-tracer's loaders read.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from probe.errors import ConfigError
from probe.models.cross_layer_transcoder import AnyTranscoders, CrossLayerTranscoder
from probe.models.set_files import local_file
from probe.models.transcoder import INPUT_HOOKS, OUTPUT_HOOKS, Transcoder, TranscoderSet

CONFIG_FILE = "config.yaml"
SAVE_LAYOUTS = ("relu_skip", "gemma_scope")
SAELENS_ARCHITECTURES = {"transcoder": "relu", "skip_transcoder": "relu"}
SAELENS_ARCHITECTURES |= {"jumprelu_transcoder": "jumprelu"}
HOOK_OF_READS = {reads: hook for hook, reads in INPUT_HOOKS.items()}
HOOK_OF_WRITES = {writes: hook for hook, writes in OUTPUT_HOOKS.items()}
THRESHOLD_KEYS = ("activation_function.threshold", "threshold")
RESAVE = (
    "save the set again in circuit-tracer's layout (probe.models.transcoder_files."
    "save_transcoders, or circuit-tracer's TranscoderSet.to_safetensors)"
)


def _config_path(path: Path) -> Path:
    """The YAML of a set: `path` itself, or the one YAML of a folder (config.yaml first)."""
    if path.is_file():
        return path
    if not path.is_dir():
        raise ConfigError(
            f"no transcoder set at {path}: give circuit-tracer's transcoder-set YAML or the folder "
            "holding it"
        )
    if (path / CONFIG_FILE).is_file():
        return path / CONFIG_FILE
    yamls = sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml"))
    if len(yamls) != 1:
        found = ", ".join(p.name for p in yamls) or "none"
        raise ConfigError(
            f"{path} should hold one transcoder-set YAML (found: {found}): give the YAML's path"
        )
    return yamls[0]


def _entries(config: dict, yaml_path: Path) -> list[dict]:
    """[{id, layer, filepath, ...}] of a config: its list of dicts, its list of paths (the layer
    is the position), or a cache folder's layer_<i>.safetensors files."""
    listed = config.get("transcoders")
    if listed is None:
        files = sorted(yaml_path.parent.glob("layer_*.safetensors"))
        listed = {int(p.stem.split("_", 1)[1]): p.name for p in files if p.stem[6:].isdigit()}
        listed = [listed[i] for i in sorted(listed)] if listed else []
        if not listed:
            raise ConfigError(
                f"{yaml_path} lists no `transcoders` and its folder holds no layer_<i>.safetensors"
            )
    if not isinstance(listed, list):
        raise ConfigError(f"{yaml_path}: `transcoders` should be a list, not {listed!r}")
    out = []
    for i, entry in enumerate(listed):
        if isinstance(entry, str):
            entry = {"layer": i, "filepath": entry}
        if not isinstance(entry, dict) or "filepath" not in entry or "layer" not in entry:
            raise ConfigError(
                f"{yaml_path}: transcoder {i} is {entry!r}; each needs `layer` and `filepath` "
                "(and an `id`), or is a path"
            )
        layer = entry["layer"]
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise ConfigError(f"{yaml_path}: transcoder {i} has layer={layer!r}, not a block index")
        out.append(entry)
    return out


def _hook(config: dict, key: str, known, yaml_path: Path) -> str:
    value = config.get(key)
    if value not in known:
        raise ConfigError(
            f"{yaml_path}: {key}={value!r}; probe reads sets whose {key} is one of "
            f"{', '.join(known)}"
        )
    return str(value)  # one of known's names


def load_transcoders(path: str | Path, dtype: torch.dtype | None = None,
                     every_block: bool = True) -> AnyTranscoders:  # fmt: skip
    """The set a transcoder-set YAML (or a folder holding one) names, each file's layout found
    from its keys and shapes, in `dtype` (None: as stored), on the CPU; a config with
    `model_kind: cross_layer_transcoder` gives a CrossLayerTranscoder (probe.models.clt_files).
    A per-layer set must hold every block 0..n-1 unless `every_block` is False (a fit of some
    blocks, measured by `python -m probe.fit --evaluate`)."""
    import yaml

    yaml_path = _config_path(Path(path).expanduser())
    try:
        config = yaml.safe_load(yaml_path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{yaml_path} is not YAML ({e})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{yaml_path} holds {config!r}, not a transcoder-set config")
    reads = INPUT_HOOKS[_hook(config, "feature_input_hook", INPUT_HOOKS, yaml_path)]
    writes = OUTPUT_HOOKS[_hook(config, "feature_output_hook", OUTPUT_HOOKS, yaml_path)]
    kind = config.get("model_kind", "transcoder_set")
    if kind == "cross_layer_transcoder":
        from probe.models.clt_files import read_cross_layer

        return read_cross_layer(yaml_path, config, reads, dtype)
    if kind != "transcoder_set":
        raise ConfigError(
            f"{yaml_path}: model_kind={kind!r}; probe reads circuit-tracer's transcoder_set and "
            "cross_layer_transcoder"
        )
    transcoders, ids = {}, {}
    for entry in _entries(config, yaml_path):
        layer = entry["layer"]
        if layer in transcoders:
            raise ConfigError(f"{yaml_path} names two transcoders for layer {layer}: keep one")
        file = local_file(str(entry["filepath"]), yaml_path.parent)
        t = read_transcoder(file, layer, activation=entry.get("activation"), k=entry.get("k"))
        transcoders[layer] = t.to(dtype) if dtype is not None else t
        ids[layer] = str(entry.get("id", f"layer_{layer}"))
    if not transcoders:
        raise ConfigError(f"{yaml_path} lists no transcoders")
    missing = sorted(set(range(max(transcoders) + 1)) - set(transcoders))
    if missing and every_block:
        raise ConfigError(
            f"{yaml_path} has no transcoder for layer(s) {missing}: a set needs one for every "
            "block 0..n-1"
        )
    return TranscoderSet(
        transcoders, reads=reads, writes=writes, model_name=config.get("model_name"), ids=ids,
        source=str(yaml_path), every_block=every_block,
    )  # fmt: skip


def _tensors(file: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """A file's tensors and what describes them (safetensors metadata; SAELens's cfg.json)."""
    if file.is_dir() or file.name == "sae_weights.safetensors":
        folder = file if file.is_dir() else file.parent
        cfg_file = folder / "cfg.json"
        if not cfg_file.is_file():
            raise ConfigError(
                f"{folder} is a folder without cfg.json: a transcoder file is a .safetensors or "
                ".npz, or a SAELens transcoder folder (cfg.json + sae_weights.safetensors)"
            )
        try:
            cfg = json.loads(cfg_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{cfg_file} is not JSON ({e})") from None
        weights = folder / "sae_weights.safetensors"
        if not weights.is_file():
            raise ConfigError(f"{folder} has cfg.json but no sae_weights.safetensors")
        tensors = _read_safetensors(weights)[0]
        return tensors, {"saelens": cfg if isinstance(cfg, dict) else {}}
    if not file.is_file():
        raise ConfigError(f"no transcoder file at {file}: fix the set's filepath")
    if file.suffix == ".npz":
        try:
            with np.load(file) as npz:
                return {k: torch.from_numpy(np.array(npz[k])) for k in npz.files}, {"npz": True}
        except (OSError, ValueError) as e:
            raise ConfigError(f"{file} is not a readable .npz ({e})") from None
    return _read_safetensors(file)


def _read_safetensors(file: Path) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}  # noqa: SIM118
    except Exception as e:
        raise ConfigError(
            f"{file} is neither a .npz nor a safetensors file ({e}): transcoder files are "
            "circuit-tracer's .safetensors, Gemma Scope's .npz or SAELens folders"
        ) from None


def _need(tensors: dict, name: str, file: Path, layout: str) -> torch.Tensor:
    if name not in tensors:
        raise ConfigError(
            f"{file} ({layout} layout) has no {name}; found: {', '.join(sorted(tensors)) or 'none'}"
            f": {RESAVE}"
        )
    return tensors[name]


def _shape_error(file: Path, layout: str, name: str, got, want: dict[str, tuple]) -> ConfigError:
    said = " or ".join(f"{label} = {shape}" for label, shape in want.items())
    transposed = any(tuple(got) == tuple(reversed(s)) for s in want.values())
    why = "the file is transposed" if transposed else "the file's tensors disagree"
    return ConfigError(
        f"{file} ({layout} layout): {name} has shape {tuple(got)}, want {said}: {why}; {RESAVE}"
    )


def _vector(tensors: dict, name: str, file: Path, layout: str) -> torch.Tensor:
    t = _need(tensors, name, file, layout)
    if t.dim() != 1:
        raise ConfigError(f"{file} ({layout} layout): {name} has shape {tuple(t.shape)}, not 1-D")
    return t


def read_transcoder(file: str | Path, layer: int, activation: str | None = None,
                    k: int | None = None) -> Transcoder:  # fmt: skip
    """One transcoder from a file (layout found from its keys and shapes). `activation` / `k`
    (a YAML entry's, or the file's metadata) make a topk transcoder of a relu file."""
    file = Path(file)
    tensors, meta = _tensors(file)
    if "saelens" in meta:
        found = _saelens(tensors, meta["saelens"], file)
    elif "w_enc" in tensors:
        found = _gemma_scope_2(tensors, file)
    elif meta.get("npz"):
        found = _gemma_scope(tensors, file)
    else:
        found = _relu_skip(tensors, file)
    activation = activation or meta.get("activation") or found.pop("activation")
    found.pop("activation", None)
    if activation == "topk":
        k = int(k if k is not None else meta.get("k", 0)) or None
        found.pop("threshold", None)
    return Transcoder(**found, layer=layer, activation=activation, k=k)


def _relu_skip(tensors: dict, file: Path) -> dict:
    layout = "relu_skip"
    b_enc, b_dec = _vector(tensors, "b_enc", file, layout), _vector(tensors, "b_dec", file, layout)
    d_tc, d_out = len(b_enc), len(b_dec)
    W_enc, W_dec = _need(tensors, "W_enc", file, layout), _need(tensors, "W_dec", file, layout)
    if W_enc.dim() != 2 or W_enc.shape[0] != d_tc:
        d_in = W_enc.shape[0] if W_enc.shape[-1] == d_tc else W_enc.shape[-1]
        want = {"(d_tc, d_in)": (d_tc, d_in)}
        raise _shape_error(file, layout, "W_enc", W_enc.shape, want)
    d_in = W_enc.shape[1]
    if tuple(W_dec.shape) == (d_tc, d_out):  # circuit-tracer 0.5 (acts @ W_dec)
        pass
    elif tuple(W_dec.shape) == (d_out, d_tc):  # its first release stored W_dec transposed
        W_dec = W_dec.T
    else:
        want = {"(d_tc, d_out)": (d_tc, d_out), "(d_out, d_tc)": (d_out, d_tc)}
        raise _shape_error(file, layout, "W_dec", W_dec.shape, want)
    out: dict[str, torch.Tensor | str] = {
        "W_enc": W_enc.T.contiguous(),
        "b_enc": b_enc,
        "W_dec": W_dec.contiguous(),
    }
    out |= {"b_dec": b_dec, "activation": "relu"}
    if tensors.get("W_skip") is not None:
        W_skip = tensors["W_skip"]
        if tuple(W_skip.shape) != (d_out, d_in):
            raise _shape_error(
                file, layout, "W_skip", W_skip.shape, {"(d_out, d_in)": (d_out, d_in)}
            )
        out["W_skip"] = W_skip
    threshold = next((tensors[k] for k in THRESHOLD_KEYS if k in tensors), None)
    for name in ("log_thresholds", "log_threshold"):
        if threshold is None and name in tensors:
            threshold = tensors[name].exp()
    if threshold is not None:
        if tuple(threshold.shape) != (d_tc,):
            raise _shape_error(file, layout, "threshold", threshold.shape, {"(d_tc,)": (d_tc,)})
        out |= {"threshold": threshold, "activation": "jumprelu"}
    return out


def _gemma_scope(tensors: dict, file: Path) -> dict:
    layout = "gemma_scope"
    b_enc, b_dec = _vector(tensors, "b_enc", file, layout), _vector(tensors, "b_dec", file, layout)
    d_tc, d_out = len(b_enc), len(b_dec)
    W_enc, W_dec = _need(tensors, "W_enc", file, layout), _need(tensors, "W_dec", file, layout)
    threshold = _need(tensors, "threshold", file, layout)
    if W_enc.dim() != 2 or W_enc.shape[1] != d_tc:
        d_in = W_enc.shape[-1] if W_enc.shape[0] == d_tc else W_enc.shape[0]
        want = {"(d_in, d_tc)": (d_in, d_tc)}
        raise _shape_error(file, layout, "W_enc", W_enc.shape, want)
    if tuple(W_dec.shape) != (d_tc, d_out):
        raise _shape_error(file, layout, "W_dec", W_dec.shape, {"(d_tc, d_out)": (d_tc, d_out)})
    if tuple(threshold.shape) != (d_tc,):
        raise _shape_error(file, layout, "threshold", threshold.shape, {"(d_tc,)": (d_tc,)})
    return {"W_enc": W_enc, "b_enc": b_enc, "W_dec": W_dec, "b_dec": b_dec,
            "threshold": threshold, "activation": "jumprelu"}  # fmt: skip


def _gemma_scope_2(tensors: dict, file: Path) -> dict:
    renamed = {"W_enc": tensors["w_enc"], "W_dec": _need(tensors, "w_dec", file, "Gemma Scope 2")}
    renamed |= {k: v for k, v in tensors.items() if k in ("b_enc", "b_dec", "threshold")}
    out = _gemma_scope(renamed, file)
    skip = tensors.get("affine_skip_connection")
    if skip is not None:
        d_in, d_out = out["W_enc"].shape[0], out["W_dec"].shape[1]
        if tuple(skip.shape) != (d_in, d_out):
            want = {"(d_in, d_out)": (d_in, d_out)}
            raise _shape_error(file, "Gemma Scope 2", "affine_skip_connection", skip.shape, want)
        out["W_skip"] = skip.T.contiguous()
    return out


def _saelens(tensors: dict, cfg: dict, file: Path) -> dict:
    layout = "SAELens"
    arch = cfg.get("architecture")
    if arch not in SAELENS_ARCHITECTURES:
        raise ConfigError(
            f"{file}: cfg.json architecture={arch!r} is not a SAELens transcoder; probe reads "
            f"{', '.join(SAELENS_ARCHITECTURES)}"
        )
    norm = cfg.get("normalize_activations")
    if norm not in (None, "none", False):
        raise ConfigError(
            f"{file}: normalize_activations={norm!r}; fold the normalisation into the weights in "
            "SAELens and save the transcoder again"
        )
    sizes = {}
    for key in ("d_in", "d_sae", "d_out"):
        value = cfg.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{file}: cfg.json {key}={value!r} should be a positive integer")
        sizes[key] = value
    d_in, d_tc, d_out = sizes["d_in"], sizes["d_sae"], sizes["d_out"]
    if arch == "jumprelu_transcoder" and "threshold" not in tensors and "log_threshold" in tensors:
        tensors = {**tensors, "threshold": tensors["log_threshold"].exp()}
    want = {"W_enc": (d_in, d_tc), "b_enc": (d_tc,), "W_dec": (d_tc, d_out), "b_dec": (d_out,)}
    if arch == "skip_transcoder":
        want["W_skip"] = (d_out, d_in)
    if arch == "jumprelu_transcoder":
        want["threshold"] = (d_tc,)
    out = {}
    for name, shape in want.items():
        t = _need(tensors, name, file, layout)
        if tuple(t.shape) != shape:
            raise _shape_error(file, layout, name, t.shape, {f"cfg.json's {name}": shape})
        out[name] = t
    if "threshold" in out:
        # SAELens: relu(pre) * (pre > threshold), which is pre * (pre > max(threshold, 0))
        out["threshold"] = out["threshold"].clamp(min=0)
    return out | {"activation": SAELENS_ARCHITECTURES[arch]}


def _config_dims(config) -> tuple[int | None, int | None]:
    """(hidden size, number of blocks) of a HF config (a text config inside a multimodal one)."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    width = next((getattr(config, k) for k in ("hidden_size", "n_embd", "d_model")
                  if isinstance(getattr(config, k, None), int)), None)  # fmt: skip
    depth = next((getattr(config, k) for k in ("num_hidden_layers", "n_layer", "num_layers")
                  if isinstance(getattr(config, k, None), int)), None)  # fmt: skip
    return width, depth


def model_blocks(model) -> int | None:
    """The number of blocks of a HF model (or its config), if its config says."""
    return _config_dims(getattr(model, "config", model))[1]


def check_transcoders(tset: AnyTranscoders, model, every_block: bool = True) -> None:
    """ConfigError unless every transcoder reads and writes the model's hidden size and the set
    has one transcoder per block (a CLT: one layer per block); `every_block` False: a per-layer
    set may cover some blocks only, each a block of the model. `model`: a HF model (or its
    config)."""
    width, depth = _config_dims(getattr(model, "config", model))
    name = getattr(getattr(model, "config", model), "_name_or_path", "") or type(model).__name__
    trained = f" (trained on {tset.model_name})" if tset.model_name else ""
    if width is None:
        raise ConfigError(f"{name}: its config names no hidden size; give a HuggingFace model")
    if isinstance(tset, CrossLayerTranscoder):
        if tset.d_in != width or tset.d_out != width:
            raise ConfigError(
                f"the cross-layer transcoder {tset.source}{trained} reads d_in={tset.d_in} and "
                f"writes d_out={tset.d_out} (W_enc {tuple(tset.W_enc.shape)} (n_layers, d_in, "
                f"d_tc)), but {name} has hidden size {width}: give a CLT trained on this model"
            )
        if depth is not None and len(tset) != depth:
            raise ConfigError(
                f"the cross-layer transcoder {tset.source}{trained} has {len(tset)} layers but "
                f"{name} has {depth} blocks: give a CLT over every block of this model"
            )
        return
    if depth is not None and not every_block:
        beyond = sorted(layer for layer in tset.transcoders if not 0 <= layer < depth)
        if beyond:
            raise ConfigError(
                f"{tset.source or 'the set'}{trained} has a transcoder of layer {beyond[0]} but "
                f"{name} has {depth} blocks (layers 0..{depth - 1}): give a set of this model's "
                "blocks"
            )
    for layer, t in tset.transcoders.items():
        if t.d_in != width or t.d_out != width:
            raise ConfigError(
                f"the transcoder of layer {layer} in {tset.source or 'the set'}{trained} reads "
                f"d_in={t.d_in} and writes d_out={t.d_out} (W_enc {tuple(t.W_enc.shape)} (d_in, "
                f"d_tc), W_dec {tuple(t.W_dec.shape)} (d_tc, d_out)), but {name} has hidden size "
                f"{width}: give transcoders trained on this model, or, if the file is transposed, "
                f"{RESAVE}"
            )
    if every_block and depth is not None and len(tset) != depth:
        raise ConfigError(
            f"{tset.source or 'the set'}{trained} has {len(tset)} transcoders (layers 0.."
            f"{len(tset) - 1}) but {name} has {depth} blocks: give one transcoder per block"
        )


def save_transcoders(tset: TranscoderSet, folder: str | Path, layout: str = "relu_skip") -> Path:
    """Write `tset` into `folder`: config.yaml (circuit-tracer's transcoder-set YAML, relative
    filepaths) and layer_<i>.safetensors (`relu_skip`: circuit-tracer 0.5's layout, JumpReLU
    thresholds as `activation_function.threshold`) or layer_<i>.npz (`gemma_scope`: JumpReLU or
    ReLU (threshold 0), no skip). Returns the YAML's path."""
    if layout not in SAVE_LAYOUTS:
        raise ConfigError(f"layout={layout!r}; choose from {', '.join(SAVE_LAYOUTS)}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for layer, t in sorted(tset.transcoders.items()):
        write_transcoder(t, folder / _file_name(layer, layout), layout)
    return write_set_config(
        folder, tset.transcoders, tset.reads, tset.model_name, tset.ids, layout, tset.writes
    )


def _file_name(layer: int, layout: str) -> str:
    return f"layer_{layer}." + ("npz" if layout == "gemma_scope" else "safetensors")


def write_set_config(folder: Path, transcoders: dict[int, Transcoder], reads: str,
                     model_name: str | None = None, ids: dict[int, str] | None = None,
                     layout: str = "relu_skip", writes: str = "mlp_out") -> Path:  # fmt: skip
    """config.yaml in `folder` naming layer_<i> files of `transcoders` (written beside it)."""
    import yaml

    entries = []
    for layer, t in sorted(transcoders.items()):
        entry = {"id": (ids or {}).get(layer, f"layer_{layer}"), "layer": layer,
                 "filepath": _file_name(layer, layout)}  # fmt: skip
        if t.activation == "topk":  # (probe's own keys: circuit-tracer has no topk transcoder)
            entry |= {"activation": "topk", "k": t.k}
        entries.append(entry)
    config = {
        "model_name": model_name or "",
        "model_kind": "transcoder_set",
        "feature_input_hook": HOOK_OF_READS[reads],
        "feature_output_hook": HOOK_OF_WRITES[writes],
        "transcoders": entries,
    }
    path = Path(folder) / CONFIG_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(config, sort_keys=False))
    tmp.replace(path)
    return path


def write_transcoder(t: Transcoder, file: Path, layout: str = "relu_skip") -> None:
    """One transcoder's file in `layout` (see save_transcoders)."""
    with torch.no_grad():
        if layout == "gemma_scope":
            if t.W_skip is not None or t.activation == "topk":
                raise ConfigError(
                    f"the gemma_scope layout holds JumpReLU (and ReLU) transcoders without a skip "
                    f"matrix; layer {t.layer} is {t.activation}"
                    f"{' with W_skip' if t.W_skip is not None else ''}: save with layout=relu_skip"
                )
            threshold = t.threshold if t.threshold is not None else torch.zeros_like(t.b_enc)
            arrays: dict[str, torch.Tensor] = {
                "W_enc": t.W_enc,
                "W_dec": t.W_dec,
                "b_enc": t.b_enc,
                "b_dec": t.b_dec,
            }
            arrays["threshold"] = threshold
            # numpy's stub takes **arrays for its keyword allow_pickle (bool) too
            np.savez(file, **{k: v.detach().cpu().numpy() for k, v in arrays.items()})  # type: ignore[arg-type]
            return
        from safetensors.torch import save_file

        tensors = {"W_enc": t.W_enc.T, "W_dec": t.W_dec, "b_enc": t.b_enc, "b_dec": t.b_dec}
        if t.activation == "jumprelu":
            assert t.threshold is not None  # Transcoder refuses a jumprelu without one
            tensors["activation_function.threshold"] = t.threshold
        if t.W_skip is not None:
            tensors["W_skip"] = t.W_skip
        meta = {"activation": t.activation, **({"k": str(t.k)} if t.activation == "topk" else {})}
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, file, meta)
