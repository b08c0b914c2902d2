"""Cross-layer transcoders (CLTs): one dictionary whose features read one block's MLP input and
write to that block's MLP output and every later block's, as circuit-tracer 0.5's
CrossLayerTranscoder does (Ameisen et al. 2025).

Per layer l: pre-activations `x_l @ W_enc[l] + b_enc[l]` of what layer l reads (`reads`, as for a
per-layer set: mlp_in, resid_mid or mlp_normalized), an activation (relu, jumprelu with a
per-feature threshold, topk with k per layer), and decoders `W_dec[l]` (d_tc, n_layers - l, d_out):
row f, slot j is what feature f of layer l writes into layer l + j's MLP output. Layer l''s
output is

    sum over l <= l' of acts_l @ W_dec[l][:, l' - l]  +  b_dec[l']  (+ x_l' @ W_skip[l'])

Orientation in memory: W_enc (n_layers, d_in, d_tc) (probe's per-layer orientation, stacked),
b_enc and threshold (n_layers, d_tc), W_dec a list of (d_tc, n_layers - l, d_out) (circuit-tracer's),
b_dec (n_layers, d_out), W_skip (n_layers, d_in, d_out) applied as `x @ W_skip[l]` (circuit-
tracer's CLT orientation, Gemma Scope 2's affine skip connection; the transpose of a per-layer
Transcoder's W_skip). probe.models.transcoder_files reads and writes circuit-tracer's CLT files.
"""

from __future__ import annotations

import torch
from torch import nn

from probe.errors import ConfigError
from probe.models.transcoder import ACTIVATIONS, INPUT_HOOKS, READS, TranscoderSet


class CrossLayerTranscoder(nn.Module):
    """A cross-layer transcoder over `n_layers` blocks (see the module docstring). `source` is
    the folder it was read from, `scan` its name in circuit-tracer's graphs (informational)."""

    def __init__(
        self,
        W_enc: torch.Tensor,
        b_enc: torch.Tensor,
        W_dec: list[torch.Tensor],
        b_dec: torch.Tensor,
        *,
        activation: str = "relu",
        threshold: torch.Tensor | None = None,
        k: int | None = None,
        W_skip: torch.Tensor | None = None,
        reads: str = "resid_mid",
        writes: str = "mlp_out",
        model_name: str | None = None,
        source: str = "",
        scan: str | None = None,
    ):
        super().__init__()
        where = f"cross-layer transcoder {source}".rstrip()
        if activation not in ACTIVATIONS:
            raise ConfigError(
                f"{where}: activation {activation!r}; choose from {', '.join(ACTIVATIONS)}"
            )
        if activation == "jumprelu" and threshold is None:
            raise ConfigError(f"{where}: a jumprelu CLT needs its thresholds (n_layers, d_tc)")
        if activation == "topk" and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ConfigError(f"{where}: a topk CLT needs k >= 1, got {k!r}")
        if reads not in READS:
            raise ConfigError(
                f"{where} reads {reads!r}; choose from {', '.join(READS)} (circuit-tracer's "
                f"feature_input_hook {', '.join(INPUT_HOOKS)})"
            )
        if W_enc.dim() != 3:
            raise ConfigError(
                f"{where}: W_enc has shape {tuple(W_enc.shape)}, want (n_layers, d_in, d_tc)"
            )
        n, d_in, d_tc = W_enc.shape
        d_out = b_dec.shape[-1]
        want: dict[str, tuple[torch.Tensor, tuple[int, ...]]] = {
            "b_enc": (b_enc, (n, d_tc)),
            "b_dec": (b_dec, (n, d_out)),
        }
        if threshold is not None:
            want["threshold"] = (threshold, (n, d_tc))
        if W_skip is not None:
            want["W_skip"] = (W_skip, (n, d_in, d_out))
        if len(W_dec) != n:
            raise ConfigError(f"{where}: {len(W_dec)} decoders for {n} layers; want one per layer")
        for layer, w in enumerate(W_dec):
            want[f"W_dec[{layer}]"] = (w, (d_tc, n - layer, d_out))
        for name, (t, shape) in want.items():
            if tuple(t.shape) != shape:
                raise ConfigError(
                    f"{where}: {name} has shape {tuple(t.shape)}, want {shape} (W_enc "
                    f"{tuple(W_enc.shape)} is (n_layers, d_in, d_tc); a decoder of layer l is "
                    "(d_tc, n_layers - l, d_out))"
                )
        self.activation, self.k = activation, k
        self.reads, self.writes, self.model_name = reads, writes, model_name
        self.source, self.scan = source, scan
        self.W_enc = nn.Parameter(W_enc)
        self.b_enc = nn.Parameter(b_enc)
        self.W_dec = nn.ParameterList([nn.Parameter(w) for w in W_dec])
        self.b_dec = nn.Parameter(b_dec)
        self.threshold = nn.Parameter(threshold) if threshold is not None else None
        self.W_skip = nn.Parameter(W_skip) if W_skip is not None else None

    def __len__(self) -> int:
        return self.n_layers

    @property
    def n_layers(self) -> int:
        return self.W_enc.shape[0]

    @property
    def d_in(self) -> int:
        return self.W_enc.shape[1]

    @property
    def d_tc(self) -> int:
        return self.W_enc.shape[2]

    @property
    def d_out(self) -> int:
        return self.b_dec.shape[1]

    @property
    def ids(self) -> dict[int, str]:
        """A per-layer set's transcoder ids; a CLT has one name, `scan`."""
        return {}

    def pre_activations(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """`x @ W_enc[layer] + b_enc[layer]`, (..., d_tc), in the weights' dtype."""
        return x.to(self.W_enc.dtype) @ self.W_enc[layer] + self.b_enc[layer]

    def activate(self, layer: int, pre: torch.Tensor) -> torch.Tensor:
        if self.activation == "relu":
            return torch.relu(pre)
        if self.activation == "jumprelu":
            assert self.threshold is not None  # __init__ refuses a jumprelu without one
            return pre * (pre > self.threshold[layer])
        assert self.k is not None  # __init__ refuses a topk without k
        top = torch.topk(pre, min(self.k, pre.shape[-1]), dim=-1)
        return torch.zeros_like(pre).scatter(-1, top.indices, torch.relu(top.values))

    def encode(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s feature activations (..., d_tc) of what it reads, `x` (..., d_in)."""
        return self.activate(layer, self.pre_activations(layer, x))

    def decode(self, acts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every layer's output (..., d_out) from every layer's activations `acts[l]` (...,
        d_tc): the writes of layers l <= l' plus b_dec[l'] (no skip path)."""
        n = self.n_layers
        outs = [self.b_dec[layer].expand(*acts[0].shape[:-1], self.d_out) for layer in range(n)]
        for source in range(n):
            writes = torch.einsum("...f,fjd->...jd", acts[source], self.W_dec[source])
            for j in range(n - source):
                outs[source + j] = outs[source + j] + writes[..., j, :]
        return outs

    def skip(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s skip path `x @ W_skip[layer]` (zeros without W_skip)."""
        if self.W_skip is None:
            return x.new_zeros(*x.shape[:-1], self.d_out)
        return x.to(self.W_skip.dtype) @ self.W_skip[layer]

    def forward(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every layer's prediction of its MLP's output from what every layer reads."""
        acts = [self.encode(layer, x) for layer, x in enumerate(inputs)]
        outs = self.decode(acts)
        return [
            out + self.skip(layer, x)
            for layer, (out, x) in enumerate(zip(outs, inputs, strict=True))
        ]


# what a graph, an edit or a check takes: a per-layer set or a cross-layer transcoder
AnyTranscoders = TranscoderSet | CrossLayerTranscoder
