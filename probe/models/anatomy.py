"""Where a transformer keeps its residual stream, attention and MLP writes, final norm and
unembedding: known once per HuggingFace family, exposed as layer aliases beside `@blocks`.

`@attn` (each block's attention module: its queries and keys are grid sites), `@attn_out`
(each block's attention output projection, whose input is the heads side by side),
`@heads` (the same modules, for sites split per head), `@mlp_out` (each block's MLP, whose output
is its write), `@final_norm` and `@unembed`. A family it does not know is an error that names the
aliases it could not resolve and `model.anatomy.*`, which sets them by hand.

For the graph of a model's components (probe.circuits) it also knows where each block reads the
residual stream: the norm before the attention (`attn_norm`) and before the MLP (`mlp_norm`), the
projections that make the queries, keys and values from the normed residual (`qkv`: three
modules, or one fused module whose columns `qkv_layout` describes: `fused` is GPT-2's
[all queries | all keys | all values], `per_head` GPT-NeoX's [head 0: q k v | head 1: ...]),
the key/value heads of grouped-query attention (`kv_heads`), the head width (`head_dim`) and
whether attention and MLP read the same residual (`parallel`, GPT-NeoX's parallel residual).

Gemma-2 and Gemma-3 put a second norm after the attention and after the MLP ("sandwich" norms:
the residual gets post_norm(mlp(pre_norm(x)))): `post_attn_norm` and `post_mlp_norm` name them,
and the block's writes to the residual stream are their outputs (`attn_write`, `mlp_write`).
`pattern_norms` are norms inside the attention that only shape its pattern (Qwen3's and
Gemma-3's q/k norms). Another norm inside a block is one a graph cannot place (refused there).

A multimodal model (Gemma-3's Gemma3ForConditionalGeneration: a vision tower beside the
language model) names its language model's layers as `stack`: only blocks below it are the
anatomy's (the vision tower's layers are stacks of blocks too); sizes are read from its text
config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypedDict

from torch import nn

from probe.errors import ConfigError

ALIASES = ("@attn", "@attn_out", "@heads", "@mlp_out", "@final_norm", "@unembed")


class _Modules(TypedDict):
    """What every family names: suffixes below each block, then candidate top-level names."""

    attn: str
    attn_out: str
    mlp_out: str
    final_norm: list[str]
    unembed: list[str]
    embed: list[str]


class Family(_Modules, total=False):
    attn_norm: str
    mlp_norm: str
    qkv: str | list[str]  # one fused module, or (q, k, v)
    qkv_layout: str
    parallel: str  # the config attribute that says so
    post_norm: bool
    post_attn_norm: str  # sandwich norms (Gemma-2, Gemma-3): after the attention, the MLP
    post_mlp_norm: str
    pattern_norms: list[str]  # norms inside the attention that only shape its pattern
    stack: str  # the language model's layers, where the model has other stacks (multimodal)
    towers: list[str]  # the other input towers (a vision tower), which token prompts never run


LLAMA: Family = {
    "attn": "self_attn", "attn_out": "self_attn.o_proj", "mlp_out": "mlp", "final_norm": ["model.norm", "norm"],
    "unembed": ["lm_head"], "embed": ["model.embed_tokens", "embed_tokens"],
    "attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
    "qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], "qkv_layout": "split",
}  # fmt: skip
QWEN3: Family = {**LLAMA, "pattern_norms": ["self_attn.q_norm", "self_attn.k_norm"]}
GEMMA2: Family = {
    **LLAMA, "mlp_norm": "pre_feedforward_layernorm",
    "post_attn_norm": "post_attention_layernorm", "post_mlp_norm": "post_feedforward_layernorm",
}  # fmt: skip
GEMMA3: Family = {**GEMMA2, "pattern_norms": ["self_attn.q_norm", "self_attn.k_norm"]}
GEMMA3_MULTIMODAL: Family = {
    **GEMMA3, "final_norm": ["model.language_model.norm"],
    "embed": ["model.language_model.embed_tokens"], "stack": "model.language_model.layers",
    "towers": ["model.vision_tower", "model.multi_modal_projector"],
}  # fmt: skip
QKV_LAYOUTS = ("split", "fused", "per_head")
FAMILIES: dict[str, Family] = {  # per model_type: module suffixes below each block, and top-level candidates
    "gpt2": {
        "attn": "attn", "attn_out": "attn.c_proj", "mlp_out": "mlp", "final_norm": ["transformer.ln_f", "ln_f"],
        "unembed": ["lm_head"], "embed": ["transformer.wte", "transformer.wpe", "wte", "wpe"],
        "attn_norm": "ln_1", "mlp_norm": "ln_2", "qkv": "attn.c_attn", "qkv_layout": "fused",
    },
    "llama": LLAMA, "mistral": LLAMA, "qwen2": LLAMA, "qwen3": QWEN3, "gemma": LLAMA,
    "gemma2": GEMMA2, "gemma3_text": GEMMA3, "gemma3": GEMMA3_MULTIMODAL,
    "gpt_neox": {
        "attn": "attention", "attn_out": "attention.dense", "mlp_out": "mlp",
        "final_norm": ["gpt_neox.final_layer_norm", "final_layer_norm"],
        "unembed": ["embed_out", "lm_head"],
        "embed": ["gpt_neox.embed_in", "embed_in"],
        "attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
        "qkv": "attention.query_key_value", "qkv_layout": "per_head",
        "parallel": "use_parallel_residual",  # a config attribute: GPT-NeoX's parallel residual
    },
    "bert": {  # post-norm: each block normalises its residual; the MLM head is norm + decoder
        "attn": "attention.self", "attn_out": "attention.output.dense", "mlp_out": "output.dense",
        "final_norm": ["cls.predictions.transform"], "unembed": ["cls.predictions.decoder"],
        "embed": ["bert.embeddings", "embeddings"], "post_norm": True,
    },
}  # fmt: skip
HEADS = ("n_head", "num_attention_heads")
KV_HEADS = ("num_key_value_heads", "n_head_kv", "multi_query_group_num")


@dataclass
class Anatomy:
    family: str
    blocks: list[str]
    attn: list[str] = field(default_factory=list)  # the modules that call the attention
    attn_out: list[str] = field(default_factory=list)
    mlp_out: list[str] = field(default_factory=list)
    final_norm: str | None = None
    unembed: str | None = None
    embed: list[str] = field(default_factory=list)
    heads: int | None = None
    post_norm: bool = False  # the residual is normalised inside each block (BERT)
    attn_norm: list[str] = field(default_factory=list)  # each block's norm before the attention
    mlp_norm: list[str] = field(default_factory=list)  # each block's norm before the MLP
    qkv: list[tuple[str, ...]] = field(default_factory=list)  # per block: (q, k, v) or (fused,)
    qkv_layout: str | None = None  # split | fused | per_head (see the module's docstring)
    kv_heads: int | None = None  # key/value heads (grouped-query attention); None: heads
    head_dim: int | None = None
    parallel: bool = False  # attention and MLP read the same residual (GPT-NeoX)
    width: int | None = None  # the residual stream's (set by probe.attribute.readout's lens)
    post_attn_norm: list[str] = field(default_factory=list)  # sandwich norms (Gemma-2, -3)
    post_mlp_norm: list[str] = field(default_factory=list)
    pattern_norms: list[str] = field(default_factory=list)  # per block, e.g. q/k norms
    towers: list[str] = field(default_factory=list)  # other input towers (multimodal)

    @property
    def sandwich(self) -> bool:
        """Whether the attention's or the MLP's output is normed again before the residual."""
        return bool(self.post_attn_norm or self.post_mlp_norm)

    @property
    def mlp_write(self) -> list[str]:
        """Each block's module whose output the residual stream gets from the MLP: the MLP, or
        the norm after it (Gemma-2, Gemma-3)."""
        return self.post_mlp_norm or self.mlp_out

    @property
    def attn_write(self) -> list[str]:
        """Each block's module whose output the residual stream gets from the attention."""
        return self.post_attn_norm or self.attn

    def alias(self, name: str) -> list[str]:
        return {
            "@attn": self.attn,
            "@attn_out": self.attn_out,
            "@heads": self.attn_out,
            "@mlp_out": self.mlp_out,
            "@final_norm": [self.final_norm] if self.final_norm else [],
            "@unembed": [self.unembed] if self.unembed else [],
        }[name]


def _first(modules: dict, candidates) -> str | None:
    return next((c for c in candidates if c in modules), None)


def anatomy(model: nn.Module, blocks: list[str], overrides: dict | None = None) -> Anatomy:
    """The anatomy of `model` (its `@blocks` given), by its family, with `model.anatomy`
    overrides (suffixes below each block for attn_out and mlp_out, names for the rest; a model
    built from a config carries them as `_probe_anatomy`)."""
    overrides = overrides if overrides is not None else getattr(model, "_probe_anatomy", None)
    config = getattr(model, "config", None)
    family = str(getattr(config, "model_type", type(model).__name__))
    # a family's entries, then model.anatomy's overrides: the user's config values, any type
    known: dict[str, Any] = dict(FAMILIES.get(family, {}))
    known.update({k: v for k, v in (overrides or {}).items() if v is not None})
    modules = dict(model.named_modules())
    if known.get("stack"):
        blocks = [b for b in blocks if b.startswith(f"{known['stack']}.")]
    if config is not None and hasattr(config, "get_text_config"):  # multimodal: its LM's sizes
        config = config.get_text_config()
    out = Anatomy(family, list(blocks), post_norm=bool(known.get("post_norm", False)))
    for key in ("attn", "attn_out", "mlp_out"):
        suffix = known.get(key)
        if suffix:
            names = [f"{b}.{suffix}" for b in blocks]
            setattr(out, key, [n for n in names if n in modules])
    for key in ("final_norm", "unembed"):
        value = known.get(key)
        setattr(out, key, _first(modules, [value] if isinstance(value, str) else value or []))
    out.embed = [n for n in known.get("embed", []) if n in modules]
    out.towers = [n for n in known.get("towers", []) if n in modules]
    heads = known.get("heads") or _config_int(config, HEADS)
    out.heads = int(heads) if heads else None
    _reading(out, known, config, modules)
    return out


def _config_int(config, keys) -> int | None:
    return next(
        (getattr(config, k) for k in keys if isinstance(getattr(config, k, None), int)), None
    )


def _reading(out: Anatomy, known: dict, config, modules: dict) -> None:
    """Where each block reads the residual stream (norms, q/k/v projections), the key/value
    heads, the head width and the parallel residual; names that are absent are left out."""
    for key in ("attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm"):
        suffix = known.get(key)
        if suffix:
            setattr(out, key, [n for b in out.blocks if (n := f"{b}.{suffix}") in modules])
    pattern = known.get("pattern_norms") or []
    pattern = [pattern] if isinstance(pattern, str) else list(pattern)
    out.pattern_norms = [n for b in out.blocks for s in pattern if (n := f"{b}.{s}") in modules]
    qkv = known.get("qkv")
    if qkv:
        suffixes = (qkv,) if isinstance(qkv, str) else tuple(qkv)
        per_block = [tuple(f"{b}.{s}" for s in suffixes) for b in out.blocks]
        out.qkv = [names for names in per_block if all(n in modules for n in names)]
    out.qkv_layout = known.get("qkv_layout") or (
        "split" if qkv and not isinstance(qkv, str) and len(qkv) == 3 else None
    )
    kv = known.get("kv_heads") or _config_int(config, KV_HEADS)
    out.kv_heads = int(kv) if kv else out.heads
    dim = known.get("head_dim") or _config_int(config, ("head_dim",))
    out.head_dim = int(dim) if dim else None
    parallel = known.get("parallel", False)
    out.parallel = bool(getattr(config, parallel, False) if isinstance(parallel, str) else parallel)


def resolve(model: nn.Module, blocks: list[str], pattern: str, label: str, overrides=None):
    """The module names alias `pattern` (one of ALIASES) stands for, or a ConfigError naming the
    aliases that could not be resolved and the keys that set them."""
    body = anatomy(model, blocks, overrides)
    names = body.alias(pattern)
    if names and (pattern != "@heads" or body.heads):
        return names
    missing = [a for a in ALIASES if not body.alias(a) or (a == "@heads" and not body.heads)]
    raise ConfigError(
        f"{label}: {pattern} cannot be resolved for a {body.family!r} model: probe knows the "
        f"anatomy of {', '.join(sorted(FAMILIES))}; unresolved here: {', '.join(missing)}. Set "
        "them by hand: model.anatomy.attn=SUFFIX, model.anatomy.attn_out=SUFFIX and "
        "model.anatomy.mlp_out=SUFFIX (below each block, e.g. self_attn, self_attn.o_proj, mlp), model.anatomy.final_norm=NAME, "
        "model.anatomy.unembed=NAME, model.anatomy.heads=N"
    )


# each pre-norm family's MLP and the norm before it, as block suffixes (a transcoder's modules)
MLP_MODULES = tuple(
    dict.fromkeys(f["mlp_out"] for f in FAMILIES.values() if not f.get("post_norm"))
)
MLP_NORM_MODULES = tuple(dict.fromkeys(f["mlp_norm"] for f in FAMILIES.values() if "mlp_norm" in f))
