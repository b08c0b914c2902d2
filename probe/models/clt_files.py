"""Cross-layer transcoders on disk: circuit-tracer 0.5's CLT layout and Gemma Scope 2's, read
through the same `config.yaml` key as per-layer sets (probe.models.transcoder_files.
load_transcoders sends a config with `model_kind: cross_layer_transcoder` here).

circuit-tracer's layout (what its `load_clt` reads, and what `save_cross_layer` writes): a folder
holding

    config.yaml           model_kind: cross_layer_transcoder, feature_input_hook (hook_resid_mid,
                          ln2.hook_normalized or mlp.hook_in), feature_output_hook (hook_mlp_out)
    W_enc_<l>.safetensors W_enc_<l> (d_tc, d_in), b_enc_<l> (d_tc,), b_dec_<l> (d_out,) (the bias
                          of layer l's output), optional threshold_<l> (d_tc,) (JumpReLU)
    W_dec_<l>.safetensors W_dec_<l> (d_tc, n_layers - l, d_out)

for l = 0..n_layers-1. probe's own keys `activation: topk` and `k` in config.yaml mark a TopK CLT
(circuit-tracer has none: its loader would read it as ReLU).

Gemma Scope 2's layout: config.yaml with model_kind cross_layer_transcoder and `transcoders`, a
list of one file per layer (local paths, relative to the YAML's folder, or hf:// URIs), each with
w_enc (d_in, d_tc), w_dec (d_tc, n_layers, d_out) (slots before the layer unused), b_enc, b_dec
(d_out,), threshold, optional affine_skip_connection (d_in, d_out); circuit-tracer's
`load_gemma_scope_2_clt` reads the same keys.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from probe.errors import ConfigError
from probe.models.cross_layer_transcoder import CrossLayerTranscoder
from probe.models.set_files import local_file
from probe.models.transcoder import INPUT_HOOKS

CLT_KIND = "cross_layer_transcoder"
HOOK_OF_READS = {reads: hook for hook, reads in INPUT_HOOKS.items()}
RESAVE_CLT = (
    "save the CLT again in circuit-tracer's layout (probe.models.clt_files.save_cross_layer, or "
    "circuit-tracer's CrossLayerTranscoder.to_safetensors)"
)


def read_cross_layer(yaml_path: Path, config: dict, reads: str,
                     dtype: torch.dtype | None = None) -> CrossLayerTranscoder:  # fmt: skip
    """The CLT a `model_kind: cross_layer_transcoder` config names: Gemma Scope 2's per-layer
    files when it lists `transcoders`, else circuit-tracer's W_enc_<l> / W_dec_<l> files beside
    the YAML."""
    if config.get("transcoders") is not None:
        found = _gemma_scope_2(yaml_path, config)
    else:
        found = _circuit_tracer(yaml_path.parent)
    activation = config.get("activation") or found.pop("activation")
    found.pop("activation", None)
    k = config.get("k")
    if activation == "topk":
        found.pop("threshold", None)
    if dtype is not None:
        found = {n: [w.to(dtype) for w in t] if isinstance(t, list) else t.to(dtype)
                 for n, t in found.items()}  # fmt: skip
    return CrossLayerTranscoder(
        **found, activation=activation, k=int(k) if k is not None else None, reads=reads,
        model_name=config.get("model_name") or None, source=str(yaml_path),
        scan=str(config["scan"]) if config.get("scan") else None,
    )  # fmt: skip


def _tensors(file: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    if not file.is_file():
        raise ConfigError(f"no CLT file at {file}: {RESAVE_CLT}")
    try:
        with safe_open(str(file), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    except Exception as e:
        raise ConfigError(f"{file} is not a safetensors file ({e}): {RESAVE_CLT}") from None


def _need(tensors: dict, name: str, file: Path, shape: tuple) -> torch.Tensor:
    if name not in tensors:
        found = ", ".join(sorted(tensors)) or "none"
        raise ConfigError(f"{file} has no {name} (found: {found}): {RESAVE_CLT}")
    t = tensors[name]
    if tuple(t.shape) != shape:
        raise ConfigError(f"{file}: {name} has shape {tuple(t.shape)}, want {shape}: {RESAVE_CLT}")
    return t


def _circuit_tracer(folder: Path) -> dict:
    """circuit-tracer's W_enc_<l> / W_dec_<l> files in `folder` (every layer 0..n-1)."""
    layers = sorted(
        int(m.group(1))
        for p in folder.glob("W_enc_*.safetensors")
        if (m := re.fullmatch(r"W_enc_(\d+)\.safetensors", p.name))
    )
    if not layers:
        raise ConfigError(
            f"{folder} holds a cross_layer_transcoder config.yaml but no W_enc_<layer>.safetensors "
            f"files: {RESAVE_CLT}"
        )
    n = len(layers)
    if layers != list(range(n)):
        missing = sorted(set(range(max(layers) + 1)) - set(layers))
        raise ConfigError(
            f"{folder} has no W_enc file for layer(s) {missing}: a CLT needs one for every block "
            f"0..{max(layers)}"
        )
    first = _tensors(folder / "W_enc_0.safetensors")
    W0 = first.get("W_enc_0")
    if W0 is None or W0.dim() != 2:
        shape = None if W0 is None else tuple(W0.shape)
        raise ConfigError(
            f"{folder / 'W_enc_0.safetensors'}: W_enc_0 is {shape}, want (d_tc, d_in)"
        )
    d_tc, d_in = W0.shape
    d_out = first["b_dec_0"].shape[-1] if "b_dec_0" in first else d_in
    jump = "threshold_0" in first
    W_enc, b_enc, b_dec, thresholds, W_dec = [], [], [], [], []
    for layer in range(n):
        enc_file = folder / f"W_enc_{layer}.safetensors"
        enc = first if layer == 0 else _tensors(enc_file)
        W_enc.append(_need(enc, f"W_enc_{layer}", enc_file, (d_tc, d_in)).T)
        b_enc.append(_need(enc, f"b_enc_{layer}", enc_file, (d_tc,)))
        b_dec.append(_need(enc, f"b_dec_{layer}", enc_file, (d_out,)))
        if jump:
            thresholds.append(_need(enc, f"threshold_{layer}", enc_file, (d_tc,)))
        dec_file = folder / f"W_dec_{layer}.safetensors"
        dec = _tensors(dec_file)
        W_dec.append(_need(dec, f"W_dec_{layer}", dec_file, (d_tc, n - layer, d_out)))
    found = {
        "W_enc": torch.stack(W_enc).contiguous(), "b_enc": torch.stack(b_enc), "W_dec": W_dec,
        "b_dec": torch.stack(b_dec), "activation": "jumprelu" if jump else "relu",
    }  # fmt: skip
    if jump:
        found["threshold"] = torch.stack(thresholds)
    return found


def _gemma_scope_2(yaml_path: Path, config: dict) -> dict:
    """Gemma Scope 2's per-layer files (w_enc, w_dec (d_tc, n_layers, d_out), b_enc, b_dec,
    threshold, optional affine_skip_connection), layer = position in `transcoders`."""
    listed = config["transcoders"]
    if not isinstance(listed, list) or not listed:
        raise ConfigError(
            f"{yaml_path}: `transcoders` should list one file per layer, not {listed!r}"
        )
    n = len(listed)
    W_enc, b_enc, b_dec, thresholds, W_dec, skips = [], [], [], [], [], []
    for layer, entry in enumerate(listed):
        path = entry.get("filepath") if isinstance(entry, dict) else entry
        if not isinstance(path, str):
            raise ConfigError(f"{yaml_path}: transcoder {layer} is {entry!r}; give a file path")
        file = local_file(path, yaml_path.parent)
        t = _tensors(file)
        if "w_enc" not in t or t["w_enc"].dim() != 2:
            raise ConfigError(
                f"{file} has no 2-D w_enc (found: {', '.join(sorted(t)) or 'none'}): a Gemma Scope 2 "
                "CLT file holds w_enc (d_in, d_tc), w_dec (d_tc, n_layers, d_out), b_enc, b_dec, "
                "threshold"
            )
        d_in, d_tc = t["w_enc"].shape
        d_out = t["b_dec"].shape[-1] if "b_dec" in t else d_in
        W_enc.append(t["w_enc"])
        b_enc.append(_need(t, "b_enc", file, (d_tc,)))
        b_dec.append(_need(t, "b_dec", file, (d_out,)))
        thresholds.append(_need(t, "threshold", file, (d_tc,)))
        W_dec.append(_need(t, "w_dec", file, (d_tc, n, d_out))[:, layer:].contiguous())
        if "affine_skip_connection" in t:
            skips.append(_need(t, "affine_skip_connection", file, (d_in, d_out)))
    shapes = {tuple(w.shape) for w in W_enc}
    if len(shapes) != 1:
        raise ConfigError(f"{yaml_path}: the layers' w_enc shapes differ ({sorted(shapes)})")
    if skips and len(skips) != n:
        raise ConfigError(
            f"{yaml_path}: only {len(skips)} of {n} layers have affine_skip_connection"
        )
    found = {
        "W_enc": torch.stack(W_enc), "b_enc": torch.stack(b_enc), "W_dec": W_dec,
        "b_dec": torch.stack(b_dec), "threshold": torch.stack(thresholds), "activation": "jumprelu",
    }  # fmt: skip
    if skips:
        found["W_skip"] = torch.stack(skips)
    return found


def save_cross_layer(clt: CrossLayerTranscoder, folder: str | Path) -> Path:
    """Write `clt` in circuit-tracer 0.5's CLT layout (see the module docstring) into `folder`;
    returns config.yaml's path. A CLT with a skip path is refused: the layout has no place for
    it."""
    import yaml
    from safetensors.torch import save_file

    if clt.W_skip is not None:
        raise ConfigError(
            "circuit-tracer's CLT layout has no skip matrix (its to_safetensors drops W_skip): "
            "this CLT cannot be written there without changing what it computes"
        )
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        for layer in range(clt.n_layers):
            enc = {
                f"W_enc_{layer}": clt.W_enc[layer].T,
                f"b_enc_{layer}": clt.b_enc[layer],
                f"b_dec_{layer}": clt.b_dec[layer],
            }
            if clt.activation == "jumprelu":
                assert clt.threshold is not None  # the CLT refuses a jumprelu without one
                enc[f"threshold_{layer}"] = clt.threshold[layer]
            save_file({k: v.detach().cpu().contiguous() for k, v in enc.items()},
                      str(folder / f"W_enc_{layer}.safetensors"))  # fmt: skip
            dec = {f"W_dec_{layer}": clt.W_dec[layer].detach().cpu().contiguous()}
            save_file(dec, str(folder / f"W_dec_{layer}.safetensors"))
    config: dict = {
        "model_name": clt.model_name or "",
        "model_kind": CLT_KIND,
        "feature_input_hook": HOOK_OF_READS[clt.reads],
        "feature_output_hook": "hook_mlp_out",
    }
    if clt.scan:
        config["scan"] = clt.scan
    if clt.activation == "topk":  # (probe's own keys: circuit-tracer has no TopK CLT)
        config |= {"activation": "topk", "k": clt.k}
    path = folder / "config.yaml"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(config, sort_keys=False))
    tmp.replace(path)
    return path
