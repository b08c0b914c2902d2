"""The local replacement model on a HuggingFace model as it is: the model linear in its residual
stream for the attribution's backward passes, its forward value unchanged.

While a `LocalReplacement` is entered, three things are frozen at their values on the prompt
(Ameisen et al. 2025; circuit-tracer's ReplacementModel does the same on TransformerLens):

- every attention pattern: the attention runs through an attention function registered with
  transformers' attention interface whose value is the model's own implementation's and whose
  gradient is that of `pattern.detach() @ V` (the pattern from the family's eager function);
- every norm's scale (LayerNorm's 1/std, RMSNorm's 1/rms), the sandwich norms after the
  attention included (Gemma-2, Gemma-3): the norm's output keeps its value and its gradient is
  that of `centre(x) * scale.detach() * gain` (centring stays linear; the gain is the weight, or
  1 + weight for Gemma's RMSNorm: probe.models.norms);
- every MLP: its output keeps its value and its gradient is that of its transcoder's skip path
  alone (`x @ W_skip.T`; a cross-layer transcoder's `x @ W_skip[l]`; nothing without a skip
  matrix), where x is what the transcoder reads
  (`mlp_in`: the MLP's input; `resid_mid`: the MLP norm's input; `mlp_normalized`: the MLP
  norm's input centred (LayerNorm) times its frozen scale, the norm's weight and bias left out,
  so its gradient is linear too). Where a norm follows the MLP (Gemma's post_mlp_norm), the
  MLP's write is that norm's output, as circuit-tracer's `hook_mlp_out`; a set that writes
  `mlp_module_out` (`mlp.hook_out`) writes the MLP module's output, the norm after it frozen
  like the others. The MLP's output is, by
  definition, the transcoder's active features' writes plus an error (the real output minus the
  transcoder's), so the paths through other features are cut: what flows back is direct.

Each trick is `value.detach() + (linear - linear.detach())`: the forward is bitwise the model's.
`mode="replay"` instead recomputes every frozen piece from what a `mode="record"` pass saw
(patterns, scales, MLP outputs), so a perturbed input moves the output by the frozen linear map:
the forward-mode twin of the backward, used to check edge weights by intervention. A replay
can hold only the patterns or only the norms' scales (`frozen`), the other running live: what
each freeze does to a perturbation's effect (probe.graphs.graph_claims splits the graph's error
so).

`tangents=True` (attribute mode) carries the same linear map forward instead, as forward-mode
tangents (torch.autograd.forward_ad): a caller that makes the embeddings' output (or any write)
a dual tensor reads, at any later point, the tangent the frozen model maps it to. The
patterns and norm scales hold no tangent, each MLP's passes through its skip path alone, and
the copies of the prompt may carry different tangents (probe.graphs.qk_sources pushes one node's
write per copy); the attention and the MLP themselves run on the first copy only (the copies'
values are the same).

Token nodes are the token embeddings (the input embeddings module's output); GPT-2's position
embedding is not a node, as in circuit-tracer. Post-norm models (BERT) and families whose anatomy
is unknown are refused by name; so is an attention that does not go through transformers'
attention interface (its pattern could not be frozen).

Nothing is taken on trust, with `model.anatomy` keys or without: every forward that is not a
replay checks, on the prompt, that each norm's output is the formula it is frozen as (an
unknown class is tried against each known formula: probe.models.norms), that each attention's
output is its frozen pattern times its values, and that each block's residual output is its
input plus the attention's and the MLP's writes; a norm inside a block that is none of the
anatomy's is refused before the forward. A mismatch is a ConfigError naming the module, its
class and the largest difference: a graph is exact or refused, never silently different.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from probe.errors import ConfigError, ModelError
from probe.hooks.hookset import HookSet
from probe.hooks.module_select import block_names
from probe.models.anatomy import anatomy
from probe.models.cross_layer_transcoder import AnyTranscoders, CrossLayerTranscoder
from probe.models.norms import Formula, apply_gain, centred_and_scale, class_name, mismatch, prove
from probe.models.placement import onloaded

MODES = ("attribute", "record", "replay")
# what a replay can hold at the recorded values (LocalReplacement's `frozen`): the attention
# patterns and the norms' scales
FREEZABLE = ("patterns", "norms")
KEYS = (
    "+model.anatomy.mlp_out=SUFFIX (each block's MLP), mlp_norm=SUFFIX and attn_norm=SUFFIX (the "
    "norms before the MLP and the attention), final_norm=NAME, unembed=NAME (and, for norms "
    "after the attention and the MLP, post_attn_norm=SUFFIX and post_mlp_norm=SUFFIX)"
)
ATTENTION_NAME = "probe_frozen_patterns"


class _AttentionConfig(Protocol):
    """What the replacement reads of a transformers config: the attention implementation."""

    _attn_implementation: str | None


@dataclass
class Parts:
    """The modules the replacement model hooks: per block its attention norm, MLP norm and MLP,
    its attention and, for sandwich norms (Gemma-2, Gemma-3), the norms after the attention and
    the MLP; the final norm, the input embeddings, the unembedding weight (vocab, width), whether
    attention and MLP read the same residual, and every module's name."""

    family: str
    attn_norms: list[nn.Module]
    mlp_norms: list[nn.Module]
    mlps: list[nn.Module]
    final_norm: nn.Module
    embed: nn.Module
    unembed: torch.Tensor
    attns: list[nn.Module] = field(default_factory=list)
    post_attn_norms: list[nn.Module] = field(default_factory=list)
    post_mlp_norms: list[nn.Module] = field(default_factory=list)
    parallel: bool = False
    names: dict[int, str] = field(default_factory=dict)
    towers: list[nn.Module] = field(default_factory=list)  # must not run (a vision tower)
    blocks: list[nn.Module] = field(default_factory=list)  # the blocks, in order

    @property
    def mlp_writes(self) -> list[nn.Module]:
        """Each block's module whose output is the MLP's write to the residual stream."""
        return self.post_mlp_norms or self.mlps

    def name(self, module: nn.Module) -> str:
        return self.names.get(id(module), type(module).__name__)

    @property
    def n_layers(self) -> int:
        return len(self.mlps)


def replacement_parts(model: nn.Module, overrides: dict | None = None) -> Parts:
    """The parts of `model` (its anatomy with `model.anatomy` overrides), or a ConfigError naming
    a post-norm model, or what the anatomy lacks and the keys that set it."""
    body = anatomy(model, block_names(model), overrides)
    if body.post_norm:
        raise ConfigError(
            f"graphs: {body.family!r} is a post-norm model (each block normalises its residual "
            "stream), so no local replacement model is linear in the residual stream and no "
            "attribution graph can be built; use a pre-norm model (GPT-2, Llama, Mistral, Qwen, "
            "GPT-NeoX)"
        )
    n = len(body.blocks)
    missing = [
        key
        for key, got in (
            ("mlp_out", len(body.mlp_out) == n),
            ("mlp_norm", len(body.mlp_norm) == n),
            ("attn_norm", len(body.attn_norm) == n),
            ("final_norm", body.final_norm is not None),
            ("unembed", body.unembed is not None),
            ("attn", len(body.attn) == n),
            ("post_attn_norm", len(body.post_attn_norm) in (0, n)),
            ("post_mlp_norm", len(body.post_mlp_norm) in (0, n)),
        )
        if not got
    ]
    if n == 0:
        missing.insert(0, "blocks (no stack of layers found)")
    if missing == ["unembed"] and not _has_head(model):
        raise ConfigError(
            f"graphs: the {body.family!r} model has no LM head ({type(model).__name__} makes no "
            "logits), and a graph attributes the next-token logits; load the model with its head "
            "(AutoModelForCausalLM; model.task=causal_lm in a run)"
        )
    if missing:
        raise ConfigError(
            f"graphs: the local replacement model of a {body.family!r} model cannot be built: "
            f"probe does not know its {', '.join(missing)}. Set them by hand: {KEYS} (in a "
            "run; probe.attribution_graph(..., overrides={'mlp_out': ...}) in the API)"
        )
    modules = dict(model.named_modules())
    _refuse_unplaced_norms(body, modules)
    # (transformers' method: Module.__getattr__'s type knows submodules and tensors only)
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None  # type: ignore[operator]
    if embed is None:
        raise ConfigError(
            f"graphs: the {body.family!r} model has no input embeddings "
            "(get_input_embeddings()); token nodes need them"
        )
    unembed = getattr(modules[body.unembed], "weight", None)
    if not isinstance(unembed, torch.Tensor) or unembed.dim() != 2:
        raise ConfigError(
            f"graphs: the unembedding {body.unembed!r} has no (vocab, width) weight; set "
            "model.anatomy.unembed=NAME to the module that makes the logits"
        )
    if unembed.is_meta:
        raise ConfigError(
            f"graphs: the unembedding {body.unembed!r} is offloaded by the model's device map "
            "(its weight is on the meta device outside its forward), and a graph reads it for "
            f"the logit nodes; keep it on a device: model.device_map with {body.unembed!r} "
            "on a GPU or 'cpu' (not offloaded)"
        )
    return Parts(
        body.family,
        [modules[m] for m in body.attn_norm],
        [modules[m] for m in body.mlp_norm],
        [modules[m] for m in body.mlp_out],
        modules[body.final_norm],
        embed,
        unembed,
        attns=[modules[m] for m in body.attn],
        post_attn_norms=[modules[m] for m in body.post_attn_norm],
        post_mlp_norms=[modules[m] for m in body.post_mlp_norm],
        blocks=[modules[b] for b in body.blocks],
        parallel=body.parallel,
        names={id(m): name for name, m in modules.items()},
        towers=[modules[m] for m in body.towers],
    )


def _refuse_unplaced_norms(body, modules: dict[str, nn.Module]) -> None:
    """Refuse a norm (a module whose class name says Norm) that the anatomy does not place: not
    before or after a block's attention or MLP, not inside an MLP (replaced whole), not one that
    only shapes an attention pattern (pattern_norms), not the final norm, not in another input
    tower (a vision tower: the replacement refuses a forward that runs it). Its scale would stay
    live in the backward: the graph would be silently different."""
    placed = {*body.attn_norm, *body.mlp_norm, *body.post_attn_norm, *body.post_mlp_norm,
              *body.pattern_norms, body.final_norm}  # fmt: skip
    inside = tuple(f"{m}." for m in [*body.mlp_out, *body.towers])
    unplaced = [
        f"{name} ({type(m).__name__})"
        for name, m in modules.items()
        if "norm" in type(m).__name__.lower()
        and not any(True for _ in m.children())
        and name not in placed
        and not name.startswith(inside)
    ]
    if unplaced:
        raise ConfigError(
            f"graphs: the {body.family!r} model has norms the local replacement model cannot "
            f"place: {', '.join(unplaced[:6])}{' ...' if len(unplaced) > 6 else ''}; their scales "
            "would stay live and the graph would be wrong. Name them: a norm after the attention "
            "or the MLP is +model.anatomy.post_attn_norm=SUFFIX / post_mlp_norm=SUFFIX (Gemma's "
            "sandwich norms), a norm that only shapes attention patterns (q/k norms) "
            "+model.anatomy.pattern_norms=[SUFFIX,...] (overrides={...} in the API)"
        )


def _has_head(model: nn.Module) -> bool:
    """Whether a transformers model has an output embedding (its LM head); a model of another
    library is given the benefit of the doubt (its unembedding may be set by hand)."""
    get = getattr(model, "get_output_embeddings", None)
    return not callable(get) or get() is not None


@dataclass
class Captured:
    """What one forward under the replacement model saw: per layer the transcoder's input and
    the MLP's (replaced) output tensors, the embeddings' output and the final norm's output."""

    inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    mlp_values: dict[int, torch.Tensor] = field(default_factory=dict)  # the MLPs' real outputs
    embed: torch.Tensor | None = None
    final: torch.Tensor | None = None
    attention_calls: int = 0
    # the first prompt copy's residual stream and writes, for the residual check
    residual: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    blocks_checked: int = 0


class LocalReplacement:
    """A context manager making `model` the local replacement model of `transcoders` (see the
    module docstring). `mode`: attribute (value-preserving freezes for the backward), record
    (a plain forward that saves patterns, scales and MLP outputs) or replay (the frozen forward
    of what record saved). `frozen` (a subset of FREEZABLE, both by default): what a replay holds
    at the recorded values; a piece left out runs live in the replay (`patterns`: each attention
    the model's own function on this forward's queries, keys and values; `norms`: each norm its
    own output, its scale this forward's). `captured` holds the latest forward's tensors."""

    _active: LocalReplacement | None = None  # the one the registered attention function serves

    def __init__(
        self,
        model: nn.Module,
        transcoders: AnyTranscoders,
        overrides: dict | None = None,
        mode: str = "attribute",
        frozen: Sequence[str] = FREEZABLE,
    ):
        if mode not in MODES:
            raise ConfigError(f"replacement mode {mode!r}; choose from {', '.join(MODES)}")
        unknown = sorted(set(frozen) - set(FREEZABLE))
        if isinstance(frozen, str) or unknown:
            raise ConfigError(
                f"graphs: frozen={frozen!r}; give a sequence of {', '.join(FREEZABLE)} (what "
                "a replay holds at the recorded values; the others run live)"
            )
        self.model, self.transcoders, self.mode = model, transcoders, mode
        self.frozen = frozenset(frozen)
        self.parts = replacement_parts(model, overrides)
        check_widths(self.parts, transcoders)
        config = getattr(model, "config", None)
        if config is None or not hasattr(config, "_attn_implementation"):
            raise ConfigError(
                "graphs: the model has no transformers config (_attn_implementation), so its "
                "attention patterns cannot be frozen; pass a transformers model"
            )
        if getattr(config, "reorder_and_upcast_attn", False):
            raise ConfigError(
                "graphs: GPT-2's reorder_and_upcast_attn bypasses the attention interface, so "
                "its patterns cannot be frozen; load the model with reorder_and_upcast_attn=False"
            )
        self.config: _AttentionConfig = config  # (model.config)
        self.captured = Captured()
        self.saved: dict = {"patterns": [], "scales": {}, "mlp": {}, "inputs": {}}
        self._hooks = HookSet("local replacement")
        self._where: dict[int, tuple[str, int]] = {}
        for i, m in enumerate(self.parts.attn_norms):
            self._where[id(m)] = ("attn_norm", i)
        for i, m in enumerate(self.parts.mlp_norms):
            self._where[id(m)] = ("mlp_norm", i)
        for i, m in enumerate(self.parts.post_attn_norms):
            self._where[id(m)] = ("post_attn_norm", i)
        # the MLP's write: the residual's (mlp_out: after a post-norm, as hook_mlp_out), or the
        # MLP module's own output (mlp_module_out: mlp.hook_out, a post-norm then frozen)
        before_post = getattr(transcoders, "writes", "mlp_out") == "mlp_module_out"
        self.frozen_post_mlp = self.parts.post_mlp_norms if before_post else []
        self.mlp_writes = self.parts.mlps if before_post else self.parts.mlp_writes
        for i, m in enumerate(self.frozen_post_mlp):
            self._where[id(m)] = ("post_mlp_norm", i)
        self._where[id(self.parts.final_norm)] = ("final_norm", self.parts.n_layers)
        self._formulas: dict[int, tuple[Formula, float]] = {}  # proven on the prompt
        self._mlp_in: dict[int, torch.Tensor | None] = {}
        self._resid_mid: dict[int, torch.Tensor] = {}
        self._normalized: dict[int, torch.Tensor] = {}
        self._grad_flags: list[tuple[torch.Tensor, bool]] = []
        self.tangents = False  # the linear map carried forward as tangents (module docstring)

    # -- entering ------------------------------------------------------------------------------
    def __enter__(self) -> LocalReplacement:
        if LocalReplacement._active is not None:
            raise ModelError("graphs: a local replacement model is already active")
        self._hooks.enter(self._register)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._hooks.__exit__(*exc)
        finally:
            self.config._attn_implementation = self._original
            torch.set_grad_enabled(self._grad_mode)
            for p, flag in self._grad_flags:
                p.requires_grad_(flag)
            self._grad_flags = []
            LocalReplacement._active = None

    def _register(self) -> None:
        self._grad_mode = torch.is_grad_enabled()
        params = [*self.model.parameters(), *self.transcoders_parameters()]
        self._grad_flags = [(p, p.requires_grad) for p in params]
        for p in params:
            p.requires_grad_(False)
        self._original = self.config._attn_implementation or "eager"
        _register_attention(self._original)
        self.config._attn_implementation = f"{ATTENTION_NAME}_{self._original}"
        LocalReplacement._active = self
        norms = [*self.parts.attn_norms, *self.parts.mlp_norms, *self.parts.post_attn_norms,
                 *self.frozen_post_mlp]  # fmt: skip
        for m in [*norms, self.parts.final_norm]:
            self._hooks.forward(m, self._norm_hook, name="norm")
        for layer, m in enumerate(self.parts.mlps):
            self._hooks.forward_pre(m, self._mlp_begins(layer), name=f"mlp {layer}")
        for layer, m in enumerate(self.mlp_writes):
            self._hooks.forward(m, self._mlp_hook(layer), name=f"mlp write {layer}")
        if not self.parts.post_attn_norms:
            for layer, m in enumerate(self.parts.attns):
                self._hooks.forward(m, self._attn_write(layer), name=f"attention {layer}")
        self._hooks.forward(self.parts.embed, self._embed_hook, name="embed")
        for m in self.parts.towers:
            self._hooks.forward_pre(m, self._tower_runs, name="tower")
        self._hooks.forward_pre(self.model, self._begin, name="model")

    def transcoders_parameters(self) -> list[torch.Tensor]:
        return list(self.transcoders.parameters())

    # -- hooks ---------------------------------------------------------------------------------
    def _begin(self, module, args):
        self.captured = Captured()
        self._resid_mid = {}
        self._mlp_in = {}
        self._normalized = {}
        self._pattern_index = 0
        if self.mode == "record":
            self.saved = {"patterns": [], "scales": {}, "mlp": {}, "inputs": {}}

    def _tower_runs(self, module, args):
        raise ModelError(
            f"graphs: the {self.parts.family!r} model ran its {self.parts.name(module)} (an "
            "input tower beside the language model, e.g. for images): a graph attributes token "
            "prompts only; give token ids (no pixel values)"
        )

    def _embed_hook(self, module, args, out):
        if self.mode == "attribute":
            out = out.detach().requires_grad_(True)
        self.captured.embed = out
        return out

    def _keep(self, kind: str, layer: int, value: torch.Tensor) -> None:
        """The first prompt copy's `value` for the residual check (not in a replay); at the next
        block's input (or the final norm's) a block's sums are checked and its values dropped,
        so at most two blocks' are held."""
        if self.mode == "replay":
            return
        r = self.captured.residual
        r[kind, layer] = value[:1].detach().clone()
        if kind in ("attn_norm input", "final_norm input") and layer >= 1:
            check_block(self.parts, r, layer - 1)
            for key in [k for k in r if k[1] == layer - 1]:
                del r[key]
            self.captured.blocks_checked += 1

    def _formula(self, module, x, out) -> tuple[Formula, float]:
        """The norm's formula, proven on this forward's input and output (a replay reuses the
        record's; a forward carrying tangents, its first forward's: the copies are the same)."""
        reuse = self.mode == "replay" or self.tangents
        if not reuse or id(module) not in self._formulas:
            if self.mode == "attribute":  # (every copy of the prompt is the same)
                x, out = x[:1], out[:1]
            self._formulas[id(module)] = prove(module, self.parts.name(module), x, out)
        return self._formulas[id(module)]

    def _norm_hook(self, module, args, out):
        with onloaded(module):  # (a device map's offloaded norm: its weights back for the hook)
            return self._frozen_norm(module, args, out)

    def _frozen_norm(self, module, args, out):
        kind, layer = self._where[id(module)]
        x = args[0]
        key = (kind, layer)
        formula, eps = self._formula(module, x, out)
        if kind == "mlp_norm":
            self._resid_mid[layer] = x
        self._keep(f"{kind} input", layer, x)
        if self.mode == "replay" and "norms" not in self.frozen:
            xc, scale = centred_and_scale(formula, eps, x)  # this forward's scale, out its own
        elif self.mode == "replay":
            xc, scale = centred_and_scale(formula, eps, x, self.saved["scales"][key])
            out = apply_gain(formula, module, xc * scale).to(out.dtype)
        else:
            xc, scale = centred_and_scale(formula, eps, x)
            if self.mode == "record":
                self.saved["scales"][key] = scale
            else:
                lin = apply_gain(formula, module, xc * scale)
                out = out.detach() + (lin - lin.detach()).to(out.dtype)
        if kind == "post_attn_norm":
            self._keep("attn write", layer, out)
        if kind == "post_mlp_norm":
            self._keep("mlp write", layer, out)
        if kind == "mlp_norm" and self.transcoders.reads == "mlp_normalized":
            # the norm's output before its weight and bias, the scale frozen: linear in x
            self._normalized[layer] = (xc * scale).to(x.dtype)
        if kind == "final_norm":
            self.captured.final = out
        return out

    def _attn_write(self, layer: int):
        def hook(module, args, out):
            self._keep("attn write", layer, out[0] if isinstance(out, tuple) else out)

        return hook

    def _mlp_begins(self, layer: int):
        """The MLP's own computation (and a norm after it) needs no backward (only the skip path
        flows back): it runs without autograd, the grad mode restored by the MLP write's hook."""

        def hook(module, args):
            self._mlp_in[layer] = args[0] if args else None
            self._mlp_grad = torch.is_grad_enabled()
            torch.set_grad_enabled(False)
            if self.tangents and args:  # (its value only: the first copy's, without tangent)
                return (args[0][:1].detach(), *args[1:])
            return None

        return hook

    def _mlp_hook(self, layer: int):
        skip_path = _skip_path(self.transcoders, layer)

        def hook(module, args, out):
            torch.set_grad_enabled(self._mlp_grad)
            reads = self.transcoders.reads
            x = {"mlp_in": self._mlp_in.get(layer), "resid_mid": self._resid_mid.get(layer),
                 "mlp_normalized": self._normalized.get(layer)}[reads]  # fmt: skip
            assert x is not None  # the MLP's input, or what the norm hooks kept before it
            if not self.frozen_post_mlp:  # (else the norm after it writes to the residual)
                self._keep("mlp write", layer, out)
            self.captured.inputs[layer] = x
            # (the attribution reads the first copy's alone: the other copies' are not kept)
            first = out[:1].detach().clone() if self.mode == "attribute" else out.detach()
            self.captured.mlp_values[layer] = first
            if self.mode == "record":
                self.saved["mlp"][layer] = out.detach()
                self.saved["inputs"][layer] = x.detach()
                return out
            skip = skip_path(x)
            if self.mode == "replay":
                before = skip_path(self.saved["inputs"][layer])
                new = self.saved["mlp"][layer] + (skip - before).to(out.dtype)
            else:
                new = out.detach() + (skip - skip.detach()).to(out.dtype)
            self.captured.outputs[layer] = new
            return new

        return hook

    # -- attention (called by the registered attention function) ------------------------------
    def attend(self, module, query, key, value, attention_mask, **kwargs):
        self.captured.attention_calls += 1
        eager = _eager_of(module)
        if self.mode == "replay" and "patterns" in self.frozen:
            pattern = self.saved["patterns"][self._pattern_index]
            self._pattern_index += 1
            return _apply(pattern, value), pattern
        own = _attention_function(self._original, eager)
        if self.mode == "replay":  # (the pattern of this forward's queries and keys)
            return own(module, query, key, value, attention_mask, **kwargs)
        if self.tangents:
            return self._attend_tangents(module, query, key, value, attention_mask, **kwargs)
        with torch.no_grad():
            out, weights = own(module, query, key, value, attention_mask, **kwargs)
            rows = 1 if self.mode == "attribute" else query.shape[0]
            mask = _additive(attention_mask, query, key, rows)
            _, pattern = eager(
                module, query[:rows], key[:rows], value[:rows], mask,
                **{k: v for k, v in kwargs.items() if k != "dropout"},
            )  # fmt: skip
            lin = _apply(pattern, value)
        largest, ok = mismatch(out, lin.to(out.dtype))
        if not ok:
            raise ConfigError(
                f"graphs: the attention {self.parts.name(module)!r} ({class_name(module)}) does "
                "not compute its frozen pattern times its values (the pattern from its family's "
                f"eager_attention_forward): they differ by up to {largest:.3g} on this prompt, "
                "so no graph can freeze it exactly; load the model with "
                "attn_implementation='eager'"
            )
        if self.mode == "record":
            self.saved["patterns"].append(pattern)
            return out, weights
        # the backward passes multiply by the pattern again, made anew from this block's
        # queries and keys each time: no block's n_pos x n_pos pattern is held between passes
        q, k, v = query[:rows].detach(), key[:rows].detach(), value[:rows].detach()
        options = {name: given for name, given in kwargs.items() if name != "dropout"}

        def remade() -> torch.Tensor:
            with torch.no_grad():
                mask = _additive(attention_mask, q, k, rows)
                return eager(module, q, k, v, mask, **options)[1]

        lin = _FrozenPattern.apply(value, pattern, remade)
        return out.detach() + (lin - lin.detach()).to(out.dtype), weights

    def _attend_tangents(self, module, query, key, value, attention_mask, **kwargs):
        """attend with `tangents`: the model's implementation and the pattern on the first
        copy's query and key (no tangent), checked as attend checks them; the output that value
        for every copy, its tangent the frozen pattern times the values' tangent."""
        eager = _eager_of(module)
        q, k, v = query[:1].detach(), key[:1].detach(), value[:1].detach()
        mask = attention_mask
        if isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[0] > 1:
            mask = mask[:1]
        options = {name: given for name, given in kwargs.items() if name != "dropout"}
        with torch.no_grad():
            own = _attention_function(self._original, eager)
            out, weights = own(module, q, k, v, mask, **kwargs)
            _, pattern = eager(module, q, k, v, _additive(mask, q, k, 1), **options)
            pattern = pattern.detach()
        lin = _apply(pattern, value)
        largest, ok = mismatch(out, lin[:1].detach().to(out.dtype))
        if not ok:
            raise ConfigError(
                f"graphs: the attention {self.parts.name(module)!r} ({class_name(module)}) does "
                "not compute its frozen pattern times its values (they differ by up to "
                f"{largest:.3g} on this prompt); load the model with attn_implementation='eager'"
            )
        out = out.detach().expand(lin.shape)
        return out + (lin - lin.detach()).to(out.dtype), weights


def _skip_path(transcoders: AnyTranscoders, layer: int):
    """Layer `layer`'s skip path as a function of what it reads; without a skip matrix a zero
    that still depends on x (so the transcoder's input stays on the backward's path, as
    circuit-tracer's `x * 0`)."""
    if isinstance(transcoders, CrossLayerTranscoder):
        clt = transcoders
        if clt.W_skip is None:
            return lambda x: x[..., :1] * 0
        # (the block may run on another device of a device_map than the transcoders)
        return lambda x: clt.skip(layer, x.to(clt.W_skip.device)).to(x.device)
    transcoder = transcoders[layer]
    if transcoder.W_skip is None:
        return lambda x: x[..., :1] * 0
    return lambda x: transcoder.skip(x.to(transcoder.W_skip.device)).to(x.device)


class _FrozenPattern(torch.autograd.Function):
    """`pattern @ V` (_apply) whose backward makes the pattern again with `remade()` (the
    family's eager function on the block's saved queries and keys: the same pattern) rather
    than keeping it: a graph's many backward passes then hold each block's queries and keys,
    not its heads x n_pos^2 pattern."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, pattern: torch.Tensor, remade) -> torch.Tensor:
        ctx.remade = remade
        ctx.shape, ctx.dtype, ctx.device = value.shape, value.dtype, value.device
        return _apply(pattern, value)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        pattern = ctx.remade()
        with torch.enable_grad():  # (_apply is linear in the values: its adjoint at any values)
            values = torch.zeros(ctx.shape, dtype=ctx.dtype, device=ctx.device,
                                 requires_grad=True)  # fmt: skip
            (back,) = torch.autograd.grad(_apply(pattern, values), values, grad)
        return back, None, None


def _apply(pattern: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`pattern @ V` as the attention interface returns it: (batch, pos, heads, head_dim); keys
    and values repeated for grouped-query attention."""
    heads, kv = pattern.shape[1], value.shape[1]
    if heads != kv:
        value = value.repeat_interleave(heads // kv, dim=1)
    pattern = pattern.to(value.dtype)
    if pattern.shape[0] == value.shape[0]:
        return torch.matmul(pattern, value).transpose(1, 2)
    # one pattern for every copy of the prompt: the copies side by side in the last dimension,
    # so neither the forward nor the backward expands the pattern batch-fold
    b, h, n, d = value.shape
    side = value.permute(1, 2, 0, 3).reshape(h, n, b * d)
    out = torch.matmul(pattern[0], side).reshape(h, pattern.shape[2], b, d)
    return out.permute(2, 1, 0, 3)


def _additive(mask, query: torch.Tensor, key: torch.Tensor, rows: int):
    """The mask in the eager function's additive form: sdpa's boolean masks converted, a skipped
    causal mask (None) made causal."""
    dtype = query.dtype
    small = torch.finfo(dtype).min
    if mask is None:
        q, k = query.shape[-2], key.shape[-2]
        allowed = torch.ones(q, k, dtype=torch.bool, device=query.device).tril(k - q)
        return torch.zeros(1, 1, q, k, dtype=dtype, device=query.device).masked_fill(
            ~allowed, small
        )
    if mask.dim() != 4:
        raise ModelError(
            f"graphs: the attention got a {mask.dim()}-d mask; freezing patterns needs the eager "
            "or sdpa attention (load the model with attn_implementation='sdpa' or 'eager')"
        )
    mask = mask[:rows] if mask.shape[0] > 1 else mask
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, small)
    return mask


def _attention_function(original: str, eager):
    """The model's own attention function: the family's `eager` one, or the one registered under
    `original` (sdpa, flash...) with transformers' attention interface."""
    if original == "eager":
        return eager
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS.get_interface(original, eager)


def _eager_of(module: nn.Module):
    """The family's own eager attention function (its modeling module's)."""
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise ModelError(
            f"graphs: {type(module).__name__}'s module has no eager_attention_forward, so its "
            "attention patterns cannot be frozen"
        )
    return eager


def _frozen_attention(module, query, key, value, attention_mask, **kwargs):
    """The attention function registered under ATTENTION_NAME: the active replacement's."""
    active = LocalReplacement._active
    if active is None:
        raise ModelError(
            f"graphs: attention implementation {ATTENTION_NAME!r} called outside a local "
            "replacement model"
        )
    return active.attend(module, query, key, value, attention_mask, **kwargs)


def _register_attention(original: str) -> None:
    """Register the frozen attention (and, for its masks, the original's mask function) under
    `ATTENTION_NAME_original` with transformers' interfaces."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    name = f"{ATTENTION_NAME}_{original}"
    AttentionInterface.register(name, _frozen_attention)
    if original not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        raise ModelError(
            f"graphs: attention implementation {original!r} has no mask function; load the "
            "model with attn_implementation='sdpa' or 'eager'"
        )
    # (transformers' mapping is inferred as dict[str, function], which Callable does not take)
    mask_function = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[original]
    AttentionMaskInterface.register(name, mask_function)  # type: ignore[arg-type]


def check_widths(parts: Parts, transcoders: AnyTranscoders) -> None:
    """Refuse, by name, a set whose layers or widths do not fit the model."""
    width = parts.unembed.shape[1]
    if isinstance(transcoders, CrossLayerTranscoder):
        if len(transcoders) != parts.n_layers:
            raise ConfigError(
                f"graphs: the cross-layer transcoder {transcoders.source} has {len(transcoders)} "
                f"layers, the model {parts.n_layers} blocks; a graph needs a CLT over every block"
            )
        if transcoders.d_in != width or transcoders.d_out != width:
            raise ConfigError(
                f"graphs: the cross-layer transcoder {transcoders.source} reads "
                f"{transcoders.d_in} and writes {transcoders.d_out}, the model's residual stream "
                f"is {width} wide"
            )
        return
    if len(transcoders) != parts.n_layers:
        raise ConfigError(
            f"graphs: the transcoder set {transcoders.source or ''} has {len(transcoders)} "
            f"layers, the model {parts.n_layers}; a graph needs one transcoder per block"
        )
    for layer, t in transcoders.transcoders.items():
        if t.d_in != width or t.d_out != width:
            raise ConfigError(
                f"graphs: the transcoder of layer {layer} reads {t.d_in} and writes {t.d_out}, "
                f"the model's residual stream is {width} wide"
            )


def check_interface(replacement: LocalReplacement) -> None:
    """After a forward: every block's attention went through the frozen attention function,
    or the family's attention bypasses transformers' attention interface (refused)."""
    calls, n = replacement.captured.attention_calls, replacement.parts.n_layers
    if calls != n:
        raise ModelError(
            f"graphs: {calls} of the {replacement.parts.family!r} model's {n} attention layers "
            "called transformers' attention interface, so their patterns could not be frozen"
        )
    check_residual(replacement)


def check_residual(replacement: LocalReplacement) -> None:
    """After a forward (not a replay): every block's residual was checked (check_block, as the
    forward went), or a ConfigError saying which of its values never came."""
    if replacement.mode == "replay":
        return
    n, done = replacement.parts.n_layers, replacement.captured.blocks_checked
    if done != n:
        raise ConfigError(
            f"graphs: the residual of only {done} of the {replacement.parts.family!r} model's "
            f"{n} blocks could be checked (held: {sorted(replacement.captured.residual)}): the "
            "anatomy's norms, attention and MLP are not the ones the forward runs; set "
            f"them with {KEYS}"
        )


def check_block(parts: Parts, r: dict, layer: int) -> None:
    """Block `layer`'s residual output (the next norm's input) is its input plus its attention's
    write plus its MLP's write (the middle, the MLP norm's input, its input plus the attention's
    write), or a ConfigError naming the block: something between a write and the residual
    stream that the anatomy does not know (a norm after the attention or the MLP, a scale)
    would make the graph silently different."""
    n = parts.n_layers
    need = [("attn_norm input", layer), ("mlp_norm input", layer), ("attn write", layer),
            ("mlp write", layer), ("attn_norm input", layer + 1) if layer + 1 < n
            else ("final_norm input", n)]  # fmt: skip
    block = parts.name(parts.attn_norms[layer]).rsplit(".", 1)[0]
    missing = [f"{kind} {i}" for kind, i in need if (kind, i) not in r]
    if missing:
        raise ConfigError(
            f"graphs: block {block!r} of the {parts.family!r} model: its residual cannot be "
            f"checked ({', '.join(missing)} never came in the forward); the anatomy's modules "
            f"are not the ones the forward runs; set them with {KEYS}"
        )
    into, mid, attn, mlp, out = (r[key] for key in need)
    sums = [("output", out, into + attn + mlp)] if parts.parallel else [
        ("middle (the MLP norm's input)", mid, into + attn), ("output", out, mid + mlp)]  # fmt: skip
    for what, got, want in sums:
        largest, ok = mismatch(got, want)
        if not ok:
            raise ConfigError(
                f"graphs: block {block!r} of the {parts.family!r} model: its residual "
                f"{what} is not the sum of its input and the writes of its attention "
                f"({parts.name((parts.post_attn_norms or parts.attns)[layer])}) and MLP "
                f"({parts.name(parts.mlp_writes[layer])}) (off by up to {largest:.3g}), so "
                "a norm or another computation between a write and the residual stream is "
                "not known and the graph would be wrong; name norms after the attention or "
                "the MLP with +model.anatomy.post_attn_norm=SUFFIX and post_mlp_norm=SUFFIX"
            )
