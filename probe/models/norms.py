"""What a norm computes, known or proven: the formulas a local replacement model can freeze
(probe.graphs.replacement) and the norms' classes that compute them.

A norm is frozen as `centre(x) * scale * gain + bias`, with `scale` (1/std or 1/rms) held at its
value on the prompt. Three formulas are known:

- `layernorm`: (x - mean(x)) / sqrt(var(x) + eps) * weight + bias (torch's LayerNorm: GPT-2,
  GPT-NeoX);
- `rms`: x / sqrt(mean(x^2) + eps) * weight (Llama, Mistral, Qwen2, Qwen3, torch's RMSNorm);
- `rms_1p`: x / sqrt(mean(x^2) + eps) * (1 + weight) (Gemma, Gemma-2, Gemma-3: their weights
  are stored as the gain minus 1).

A module of one of KNOWN_CLASSES (its exact class: a subclass may compute something else) is
taken for its formula; any other module (a subclass, another library's norm) is tried against
each formula on the prompt and taken for the one its output equals. Either way the formula is
checked against the module's output on the prompt (`prove`): a norm that computes none of them
is refused by name, with the largest difference found; `register_norm(cls, formula)` declares the
formula of a class probe does not know.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from probe.errors import ConfigError


@dataclass(frozen=True)
class Formula:
    """One norm formula: whether it centres x, the offset added to the weight (the gain is
    offset + weight), and how it reads."""

    name: str
    centres: bool
    offset: float
    text: str


FORMULAS = {
    "layernorm": Formula(
        "layernorm", True, 0.0, "(x - mean(x)) / sqrt(var(x) + eps) * weight + bias"
    ),
    "rms": Formula("rms", False, 0.0, "x / sqrt(mean(x^2) + eps) * weight"),
    "rms_1p": Formula("rms_1p", False, 1.0, "x / sqrt(mean(x^2) + eps) * (1 + weight)"),
}
# exact classes (module.qualname) and the formula each computes (read in its source)
KNOWN_CLASSES: dict[str, str] = {
    "torch.nn.modules.normalization.LayerNorm": "layernorm",
    "torch.nn.modules.normalization.RMSNorm": "rms",
    "transformers.models.llama.modeling_llama.LlamaRMSNorm": "rms",
    "transformers.models.mistral.modeling_mistral.MistralRMSNorm": "rms",
    "transformers.models.qwen2.modeling_qwen2.Qwen2RMSNorm": "rms",
    "transformers.models.qwen3.modeling_qwen3.Qwen3RMSNorm": "rms",
    "transformers.models.gemma.modeling_gemma.GemmaRMSNorm": "rms_1p",
    "transformers.models.gemma2.modeling_gemma2.Gemma2RMSNorm": "rms_1p",
    "transformers.models.gemma3.modeling_gemma3.Gemma3RMSNorm": "rms_1p",
}
EPS_ATTRIBUTES = ("eps", "variance_epsilon", "epsilon")


def class_name(module: nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def register_norm(cls: type, formula: str) -> None:
    """Declare that modules of exactly `cls` compute `formula` (one of FORMULAS); a graph still
    checks it on the prompt."""
    if formula not in FORMULAS:
        raise ConfigError(f"norm formula {formula!r}; choose from {', '.join(FORMULAS)}")
    KNOWN_CLASSES[f"{cls.__module__}.{cls.__qualname__}"] = formula


def norm_eps(module: nn.Module) -> float | None:
    """The module's epsilon (eps, variance_epsilon or epsilon), None where it has none; torch's
    RMSNorm's eps=None (the dtype's machine epsilon) is left to the caller."""
    for attr in EPS_ATTRIBUTES:
        value = getattr(module, attr, None)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    return None


def candidates(module: nn.Module) -> list[Formula]:
    """The formulas `module` may compute: its class's where the class is known, else every
    formula, the one its class name suggests first."""
    known = KNOWN_CLASSES.get(class_name(module))
    if known is not None:
        return [FORMULAS[known]]
    name = type(module).__name__.lower()
    order = ["layernorm", "rms", "rms_1p"] if "layer" in name else ["rms", "rms_1p", "layernorm"]
    return [FORMULAS[f] for f in order]


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype


def centred_and_scale(formula: Formula, eps: float, x: torch.Tensor, scale=None):
    """(x centred or not, 1/std or 1/rms detached) in the compute dtype; `scale` kept if given."""
    xf = x.to(compute_dtype(x))
    xc = xf - xf.mean(-1, keepdim=True) if formula.centres else xf
    if scale is None:
        with torch.no_grad():  # (and detached: no_grad leaves forward-mode tangents on)
            scale = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps).detach()
    return xc, scale


def apply_gain(formula: Formula, module: nn.Module, normed: torch.Tensor) -> torch.Tensor:
    """`normed` (x centred times its scale) times the gain (offset + weight), plus the bias."""
    weight = getattr(module, "weight", None)
    out = normed
    if isinstance(weight, torch.Tensor):
        out = out * (weight.to(out.dtype) + formula.offset)
    bias = getattr(module, "bias", None)
    if isinstance(bias, torch.Tensor):
        out = out + bias.to(out.dtype)
    return out


def evaluate(formula: Formula, module: nn.Module, eps: float, x: torch.Tensor) -> torch.Tensor:
    """The formula's value on x (its scale live), in the compute dtype."""
    xc, scale = centred_and_scale(formula, eps, x)
    return apply_gain(formula, module, xc * scale)


def mismatch(out: torch.Tensor, want: torch.Tensor) -> tuple[float, bool]:
    """(largest |out - want|, whether every entry is within tolerance): 8 machine epsilons of
    out's dtype (at least 1e-5) relative to each entry, plus the same share of mean |want|."""
    o, w = out.detach().to(want.dtype), want.detach()
    diff = (o - w).abs()
    rtol = max(8 * torch.finfo(out.dtype).eps, 1e-5)
    bound = rtol * (w.abs() + w.abs().mean())
    return float(diff.max()) if diff.numel() else 0.0, bool((diff <= bound).all())


def prove(
    module: nn.Module, name: str, x: torch.Tensor, out: torch.Tensor
) -> tuple[Formula, float]:
    """(formula, eps) of `module` (`name` in the model), the first of its candidates whose value
    on x equals the module's output `out`; otherwise a ConfigError naming the module, its class,
    each formula tried and its largest difference, and the way out."""
    eps = norm_eps(module)
    if eps is None and class_name(module) == "torch.nn.modules.normalization.RMSNorm":
        eps = float(torch.finfo(compute_dtype(x)).eps)
    kind = class_name(module)
    if eps is None:
        raise ConfigError(
            f"graphs: the norm {name!r} ({kind}) has no eps, variance_epsilon or epsilon, so "
            "its scale cannot be frozen; probe knows " + ", ".join(sorted(KNOWN_CLASSES))
        )
    tried = []
    with torch.no_grad():
        for formula in candidates(module):
            largest, ok = mismatch(out, evaluate(formula, module, eps, x))
            if ok:
                return formula, eps
            tried.append(f"{formula.text}: off by {largest:.3g}")
    known = kind in KNOWN_CLASSES
    raise ConfigError(
        f"graphs: the norm {name!r} ({kind}) does not compute the formula it is taken for "
        f"({'its class' if known else 'its class is not one probe knows, so each formula was tried'}"
        f"; on this prompt, largest difference from its output: {'; '.join(tried)}), so no "
        "graph can freeze it exactly. The way out: a model whose norms are LayerNorm or the "
        "RMSNorm of Llama, Mistral, Qwen or Gemma; or, if the class computes one of these "
        "formulas, probe.models.norms.register_norm(ItsClass, 'layernorm' | 'rms' | 'rms_1p')"
    )


def formula_of(module: nn.Module, gain: bool = False) -> tuple[Formula, float]:
    """(formula, eps) of a norm taken without its output to check: its known class's; where only
    the normalised input is wanted (`gain` False: a transcoder's reads=mlp_normalized, whose
    x / rms does not depend on the gain's convention), also a LayerNorm's or another RMSNorm's.
    Another kind is refused by name."""
    known = KNOWN_CLASSES.get(class_name(module))
    eps = norm_eps(module)
    if known is None and not gain and isinstance(module, nn.LayerNorm):
        known = "layernorm"
    elif known is None and not gain and "RMSNorm" in type(module).__name__:
        known = "rms"
    if known is None or eps is None:
        raise ConfigError(
            f"cannot take the {'formula' if gain else 'normalised input'} of a "
            f"{class_name(module)}: probe knows the exact classes "
            f"{', '.join(sorted(c.rsplit('.', 1)[1] for c in KNOWN_CLASSES))} (a subclass may "
            "compute something else); probe.models.norms.register_norm(ItsClass, formula) "
            "declares another"
        )
    return FORMULAS[known], eps
