"""Transcoders: a sparse replacement for one block's MLP, reading the MLP's input and writing its
output, as circuit-tracer's per-layer transcoders do (Ameisen et al. 2025).

A transcoder computes `decode(encode(x)) + skip(x)`: pre-activations `x @ W_enc + b_enc`, an
activation (relu, jumprelu with a per-feature threshold, topk with k), `acts @ W_dec + b_dec`, and
for a skip transcoder `x @ W_skip.T`. Orientation is circuit-tracer's in memory: W_enc (d_in,
d_tc), W_dec (d_tc, d_out), W_skip (d_out, d_in). Where it reads is the set's `reads`:
`mlp_normalized` (the norm before the MLP without its weight and bias: the norm's input centred,
for a LayerNorm, times 1/std or 1/rms; TransformerLens's `ln2.hook_normalized`), `mlp_in` (the
MLP's input, after the norm's weight and bias; TransformerLens's `mlp.hook_in`) or `resid_mid`
(the residual before that norm; `hook_resid_mid`). Where it writes is the set's `writes`:
`mlp_out` (what the residual stream gets from the MLP: the MLP's output, or for Gemma-2 and
Gemma-3 the output of the norm after it; TransformerLens's and circuit-tracer's `hook_mlp_out`)
or `mlp_module_out` (the MLP module's own output, `mlp.hook_out`: the same place but for a
family with a norm after the MLP, where that norm is then frozen like the others).

probe.models.transcoder_files loads a set from circuit-tracer's YAML and the file layouts it
reads; probe.analysis.fit trains one from a run's captures.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from probe.errors import ConfigError
from probe.models.norms import centred_and_scale, formula_of

ACTIVATIONS = ("relu", "jumprelu", "topk")
# where a transcoder reads: circuit-tracer's feature_input_hook
READS = ("mlp_in", "resid_mid", "mlp_normalized")
# circuit-tracer's (TransformerLens's) hook names for each place
INPUT_HOOKS = {
    "ln2.hook_normalized": "mlp_normalized",
    "mlp.hook_in": "mlp_in",
    "hook_resid_mid": "resid_mid",
}
# where it writes: circuit-tracer's feature_output_hook
OUTPUT_HOOKS = {"hook_mlp_out": "mlp_out", "mlp.hook_out": "mlp_module_out"}
WRITES = tuple(OUTPUT_HOOKS.values())


class Transcoder(nn.Module):
    """One layer's transcoder. `activation`: relu, jumprelu (needs `threshold`, (d_tc,)) or topk
    (needs `k`); `W_skip` None for a plain transcoder."""

    def __init__(
        self,
        W_enc: torch.Tensor,
        b_enc: torch.Tensor,
        W_dec: torch.Tensor,
        b_dec: torch.Tensor,
        *,
        layer: int,
        activation: str = "relu",
        threshold: torch.Tensor | None = None,
        k: int | None = None,
        W_skip: torch.Tensor | None = None,
    ):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ConfigError(
                f"transcoder activation {activation!r}; choose from {', '.join(ACTIVATIONS)}"
            )
        if activation == "jumprelu" and threshold is None:
            raise ConfigError("a jumprelu transcoder needs its threshold (d_tc,)")
        if activation == "topk" and (not isinstance(k, int) or k < 1):
            raise ConfigError(f"a topk transcoder needs k >= 1, got {k!r}")
        self.layer, self.activation, self.k = int(layer), activation, k
        self.W_enc = nn.Parameter(W_enc)
        self.b_enc = nn.Parameter(b_enc)
        self.W_dec = nn.Parameter(W_dec)
        self.b_dec = nn.Parameter(b_dec)
        self.threshold = nn.Parameter(threshold) if threshold is not None else None
        self.W_skip = nn.Parameter(W_skip) if W_skip is not None else None
        d_in, d_tc = W_enc.shape
        expected = {"b_enc": (d_tc,), "W_dec": (d_tc, None), "threshold": (d_tc,)}
        for name, shape in expected.items():
            t = getattr(self, name)
            if t is not None and (
                t.dim() != len(shape)
                or any(s is not None and s != n for s, n in zip(shape, t.shape, strict=True))
            ):
                raise ConfigError(
                    f"transcoder of layer {layer}: {name} has shape {tuple(t.shape)}, W_enc "
                    f"{tuple(W_enc.shape)} (d_in, d_tc) wants {shape}"
                )
        if b_dec.shape != (self.d_out,):
            raise ConfigError(
                f"transcoder of layer {layer}: b_dec has shape {tuple(b_dec.shape)}, W_dec "
                f"{tuple(W_dec.shape)} (d_tc, d_out) wants ({self.d_out},)"
            )
        if W_skip is not None and W_skip.shape != (self.d_out, d_in):
            raise ConfigError(
                f"transcoder of layer {layer}: W_skip has shape {tuple(W_skip.shape)}, "
                f"want (d_out, d_in) = ({self.d_out}, {d_in})"
            )

    @property
    def d_in(self) -> int:
        return self.W_enc.shape[0]

    @property
    def d_tc(self) -> int:
        return self.W_enc.shape[1]

    @property
    def d_out(self) -> int:
        return self.W_dec.shape[1]

    def pre_activations(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W_enc + b_enc`, (..., d_tc), in the weights' dtype."""
        return x.to(self.W_enc.dtype) @ self.W_enc + self.b_enc

    def activate(self, pre: torch.Tensor) -> torch.Tensor:
        """The activation of pre-activations `pre`."""
        if self.activation == "relu":
            return torch.relu(pre)
        if self.activation == "jumprelu":
            assert self.threshold is not None  # __init__ refuses a jumprelu without one
            return pre * (pre > self.threshold)
        assert self.k is not None  # __init__ refuses a topk without k
        top = torch.topk(pre, self.k, dim=-1)
        return torch.zeros_like(pre).scatter(-1, top.indices, torch.relu(top.values))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Feature activations (..., d_tc) of inputs `x` (..., d_in)."""
        return self.activate(self.pre_activations(x))

    def decode(self, acts: torch.Tensor) -> torch.Tensor:
        """The features' write (..., d_out): `acts @ W_dec + b_dec`."""
        return acts @ self.W_dec + self.b_dec

    def skip(self, x: torch.Tensor) -> torch.Tensor:
        """The skip path `x @ W_skip.T` (zeros without W_skip)."""
        if self.W_skip is None:
            return x.new_zeros(*x.shape[:-1], self.d_out)
        return x.to(self.W_skip.dtype) @ self.W_skip.T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The transcoder's prediction of the MLP's output."""
        return self.decode(self.encode(x)) + self.skip(x)


@dataclass
class TranscoderSet:
    """One transcoder per block, 0..n-1, and where they read and write. `ids` are the YAML's
    transcoder ids (circuit-tracer's scan names); `model_name` the model they were trained on.
    `every_block` False: transcoders of some blocks only (a fit of `--layers`), which the fit's
    measures (`python -m probe.fit --evaluate`) take; a graph needs every block."""

    transcoders: dict[int, Transcoder]
    reads: str = "mlp_in"
    writes: str = "mlp_out"
    model_name: str | None = None
    ids: dict[int, str] = field(default_factory=dict)
    source: str = ""  # the YAML or folder read (informational)
    every_block: bool = True

    def __post_init__(self) -> None:
        if self.reads not in READS:
            raise ConfigError(
                f"transcoders read {self.reads!r}; choose from {', '.join(READS)} "
                f"(circuit-tracer's feature_input_hook {', '.join(INPUT_HOOKS)})"
            )
        if self.writes not in WRITES:
            raise ConfigError(
                f"transcoders write {self.writes!r}; choose from {', '.join(WRITES)} "
                f"(circuit-tracer's feature_output_hook {', '.join(OUTPUT_HOOKS)})"
            )
        layers = sorted(self.transcoders)
        if self.every_block and layers != list(range(len(layers))):
            raise ConfigError(
                f"transcoder set {self.source or ''} has layers {layers}; a graph needs one "
                "transcoder for every block 0..n-1"
            )

    def __len__(self) -> int:
        return len(self.transcoders)

    def __getitem__(self, layer: int) -> Transcoder:
        return self.transcoders[layer]

    def parameters(self) -> list[torch.Tensor]:
        """Every transcoder's parameters."""
        return [p for t in self.transcoders.values() for p in t.parameters()]

    def to(self, device=None, dtype=None) -> TranscoderSet:
        """Every transcoder moved to `device` and cast to `dtype` (in place); self."""
        for t in self.transcoders.values():
            t.to(device=device, dtype=dtype)
        return self


def norm_kind(module: nn.Module) -> tuple[bool, float]:
    """(centres, eps) of a norm (probe.models.norms.formula_of): LayerNorm centres, an RMSNorm
    does not; another kind is refused."""
    formula, eps = formula_of(module)
    return formula.centres, eps


def normalized(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What `module` (a LayerNorm or RMSNorm) makes of `x` before its weight and bias: x centred
    (LayerNorm) times 1/sqrt(mean square + eps), in float32 or wider, in x's dtype
    (TransformerLens's `hook_normalized`; reads=mlp_normalized)."""
    formula, eps = formula_of(module)
    xc, scale = centred_and_scale(formula, eps, x)
    return (xc * scale).to(x.dtype)
