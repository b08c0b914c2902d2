"""Sparse autoencoders saved in the SAELens layout, read without SAELens.

An SAE is a folder holding cfg.json and sae_weights.safetensors (W_enc, b_enc, W_dec, b_dec, and
threshold for JumpReLU). Reading the two files with safetensors keeps SAELens and the stack it
pulls in (transformer_lens, training code) out of probe's dependencies. encode/decode follow
SAELens 6 (sae_lens/saes/standard_sae.py, topk_sae.py, jumprelu_sae.py) and the defaults of its
loader (sae_lens/loading/pretrained_sae_loaders.py: a missing architecture is "standard", a
missing apply_b_dec_to_input is True, SAELens < 6's activation_fn="topk" means architecture topk).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from probe.errors import ConfigError

ARCHITECTURES = ("standard", "topk", "jumprelu")
CFG_FILE = "cfg.json"
WEIGHTS_FILE = "sae_weights.safetensors"
# each tensor's shape, in cfg.json's sizes; threshold is jumprelu's only
SHAPES = {"W_enc": ("d_in", "d_sae"), "b_enc": ("d_sae",), "W_dec": ("d_sae", "d_in")}
SHAPES |= {"b_dec": ("d_in",), "threshold": ("d_sae",)}
RESAVE = "save the SAE again with SAELens (sae.save_model(folder))"


@dataclass(eq=False, repr=False)
class SAE:
    """An SAE's tensors and the cfg.json keys that change what it computes.

    encode/decode compute in the weights' dtype and device: cast the input to `sae.dtype` (or
    call `sae.to(device, dtype)`) and the result back; SAELens casts the input itself.
    """

    architecture: str
    W_enc: torch.Tensor  # (d_in, d_sae)
    b_enc: torch.Tensor  # (d_sae,)
    W_dec: torch.Tensor  # (d_sae, d_in)
    b_dec: torch.Tensor  # (d_in,)
    threshold: torch.Tensor | None = None  # (d_sae,), jumprelu only
    k: int | None = None  # topk only
    apply_b_dec_to_input: bool = True
    rescale_acts_by_decoder_norm: bool = False  # topk only
    path: str = ""  # informational, as hook_name and the cfg.json read
    hook_name: str | None = None
    cfg: dict = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"SAE({self.architecture}, d_in={self.d_in}, d_sae={self.d_sae}, path={self.path!r})"

    @property
    def d_in(self) -> int:
        return self.W_enc.shape[0]

    @property
    def d_sae(self) -> int:
        return self.W_enc.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.W_enc.dtype

    def to(self, device=None, dtype=None) -> SAE:
        """A new SAE with every tensor moved to `device` and cast to `dtype` (None: unchanged)."""
        tensors = {name: getattr(self, name) for name in SHAPES}
        moved = {n: t.to(device=device, dtype=dtype) for n, t in tensors.items() if t is not None}
        return dataclasses.replace(self, **moved)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Latents (..., d_sae) of activations x (..., d_in), as SAELens's encode."""
        if self.apply_b_dec_to_input:
            x = x - self.b_dec
        pre = x @ self.W_enc + self.b_enc
        if self.architecture == "topk":
            # TopK: the k largest pre-activations, then ReLU of those: at most k are nonzero,
            # fewer where some of the k are <= 0
            if self.rescale_acts_by_decoder_norm:
                pre = pre * self.W_dec.norm(dim=-1)
            assert self.k is not None, "a topk SAE needs k"
            values, indices = torch.topk(pre, k=self.k, dim=-1, sorted=False)
            return torch.zeros_like(pre).scatter_(-1, indices, values.relu())
        if self.architecture == "jumprelu":
            # relu(pre), zeroed wherever pre <= threshold
            assert self.threshold is not None, "a jumprelu SAE needs its threshold"
            return pre.relu() * (pre > self.threshold).to(pre.dtype)
        return pre.relu()

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Reconstruction (..., d_in) of latents z (..., d_sae): z @ W_dec + b_dec."""
        if self.rescale_acts_by_decoder_norm:
            z = z / self.W_dec.norm(dim=-1)
        return z @ self.W_dec + self.b_dec


def _read_cfg(folder: Path) -> dict:
    cfg_file = folder / CFG_FILE
    if not cfg_file.is_file():
        raise ConfigError(
            f"{folder} has no {CFG_FILE}: give a folder in the SAELens layout, {RESAVE}"
        )
    try:
        cfg = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{cfg_file} is not JSON ({e}): fix the file or {RESAVE}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{cfg_file} holds a {type(cfg).__name__}, not an object: {RESAVE}")
    return cfg


def _architecture(cfg: dict, cfg_file: Path) -> str:
    arch = cfg.get("architecture") or "standard"
    old_act = cfg.get("activation_fn", cfg.get("activation_fn_str"))  # SAELens < 6
    if arch == "standard" and old_act == "topk":
        arch = "topk"
    if arch not in ARCHITECTURES:
        raise ConfigError(
            f"{cfg_file}: architecture={arch!r} is not one probe reads; known: "
            f"{', '.join(ARCHITECTURES)}"
        )
    norm = cfg.get("normalize_activations")
    if norm not in (None, "none", False):
        raise ConfigError(
            f"{cfg_file}: normalize_activations={norm!r} is not supported; probe encodes the "
            "layer's activations as they are: fold the normalisation into the weights in SAELens "
            "(e.g. fold_activation_norm_scaling_factor) and save the SAE again"
        )
    return arch


def _size(cfg: dict, key: str, cfg_file: Path) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{cfg_file}: {key}={value!r} should be a positive integer: {RESAVE}")
    return value


def load_sae(path: str | Path) -> SAE:
    """The SAE saved in folder `path` (SAELens layout), with its tensors as stored (dtype, CPU)."""
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(
            f"no SAE folder at {folder}: give the folder holding {CFG_FILE} and {WEIGHTS_FILE}"
        )
    cfg = _read_cfg(folder)
    cfg_file = folder / CFG_FILE
    arch = _architecture(cfg, cfg_file)
    sizes = {key: _size(cfg, key, cfg_file) for key in ("d_in", "d_sae")}
    weights_file = folder / WEIGHTS_FILE
    if not weights_file.is_file():
        raise ConfigError(f"{folder} has no {WEIGHTS_FILE}: {RESAVE}")
    from safetensors.torch import load_file  # (only a run with an SAE needs it)

    try:
        tensors = load_file(weights_file)
    except Exception as e:
        raise ConfigError(f"{weights_file} is not a safetensors file ({e}): {RESAVE}") from None
    if arch == "jumprelu" and "threshold" not in tensors and "log_threshold" in tensors:
        # older files, converted as SAELens's JumpReLUTrainingSAE does
        tensors["threshold"] = tensors.pop("log_threshold").exp()
    for name, dims in SHAPES.items():
        if name == "threshold" and arch != "jumprelu":
            continue
        if name not in tensors:
            why = "jumprelu needs it" if name == "threshold" else "every SAE has it"
            raise ConfigError(
                f"{weights_file} has no {name} tensor ({why}); found: "
                f"{', '.join(sorted(tensors)) or 'none'}: {RESAVE}"
            )
        want = tuple(sizes[d] for d in dims)
        if tuple(tensors[name].shape) != want:
            said = ", ".join(f"{d}={sizes[d]}" for d in dict.fromkeys(dims))
            raise ConfigError(
                f"{name} is {tuple(tensors[name].shape)} but {cfg_file} says {said} "
                f"({name} should be ({', '.join(dims)}) = {want}): the weights and cfg.json "
                f"disagree; {RESAVE}"
            )
    k = None
    if arch == "topk":
        k = cfg.get("k", (cfg.get("activation_fn_kwargs") or {}).get("k"))
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= sizes["d_sae"]:
            raise ConfigError(
                f"{cfg_file}: a topk SAE needs k in 1..d_sae={sizes['d_sae']}, got k={k!r}: "
                f"set k in {CFG_FILE} to the k it was trained with"
            )
    return SAE(
        arch,
        **{name: tensors[name] for name in SHAPES if name != "threshold"},
        threshold=tensors["threshold"] if arch == "jumprelu" else None,
        k=k,
        apply_b_dec_to_input=bool(cfg.get("apply_b_dec_to_input", True)),
        rescale_acts_by_decoder_norm=bool(
            arch == "topk" and cfg.get("rescale_acts_by_decoder_norm")
        ),
        path=str(folder),
        hook_name=cfg.get(
            "hook_name", cfg.get("hook_point", (cfg.get("metadata") or {}).get("hook_name"))
        ),
        cfg=cfg,
    )


def check_width(sae: SAE, width: int, where: str) -> None:
    """ConfigError unless the layer's units (`width` of them) are what the SAE reads (d_in)."""
    if width != sae.d_in:
        raise ConfigError(
            f"{where}: the SAE at {sae.path} reads d_in={sae.d_in} but the layer's units are "
            f"{width} wide; give an SAE trained on this layer"
        )
