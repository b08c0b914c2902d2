"""Edits of one transcoder feature (`site: feature`): zero it, scale it or clamp it to a value at
chosen positions, as an attribution graph's claim about the feature is checked by patching.

The transcoder of block `layer` reads that block's MLP input (`mlp_in`), the residual before
the MLP's norm (`resid_mid`) or that norm's output before its weight and bias (`mlp_normalized`,
computed from the norm's input) and writes the MLP's output. The edit keeps the MLP's real output
and adds `(new - act) x W_dec[feature]` at the chosen positions: the transcoder's reconstruction
with the feature changed, the transcoder's error kept. `act` is the feature's activation on the
input the transcoder reads in this forward; `new` is 0 (op=zero), `factor x act` (op=scale) or
`value` (op=clamp, as in Anthropic's "clamped to" interventions: set, active or not).

Two hooks of the run's Capture do it: an identity edit of the reading module's input that keeps
that input for the forward in flight, then the edit of the MLP's output.
"""

from __future__ import annotations

from collections import deque

import torch
from torch import nn

from probe.config import FEATURE_OPS as FEATURE_OPS
from probe.config import FEATURE_SITE as FEATURE_SITE
from probe.errors import ConfigError, ModelError
from probe.hooks.module_select import block_names
from probe.intervene.patch_steer import Region
from probe.models.anatomy import anatomy
from probe.models.transcoder import normalized
from probe.site_keys import SiteKey


class FeatureRead:
    """The reading module's input, kept (unchanged) for the FeatureWrite of the same forward;
    a batch repeated (a grid's stacked cells) is kept chunk by chunk, in order. With `norm` (the
    norm before the MLP, reads=mlp_normalized) what is kept is that norm's normalised input."""

    def __init__(self, norm: nn.Module | None = None) -> None:
        self.kept: deque[torch.Tensor] = deque()
        self.norm = norm

    def __call__(self, x: torch.Tensor, start: int, key: str, ch) -> torch.Tensor:
        site = SiteKey.parse(key)
        if site.path in ("", ".0") and site.call == 0:
            if self.norm is None:
                self.kept.append(x)
            else:
                with torch.no_grad():
                    self.kept.append(normalized(self.norm, x))
        return x


class FeatureWrite:
    """The MLP's output with `(new - act) x W_dec[feature]` added where `region` says."""

    def __init__(self, label: str, transcoder, feature: int, op: str, value: float,
                 factor: float, region: Region, read: FeatureRead):  # fmt: skip
        self.label, self.transcoder, self.feature = label, transcoder, int(feature)
        self.op, self.value, self.factor = op, float(value), float(factor)
        self.region, self.read = region, read

    def __call__(self, x: torch.Tensor, start: int, key: str, ch, tokens=None) -> torch.Tensor:
        if SiteKey.parse(key).call != 0 or not self.read.kept:
            return x
        inputs = self.read.kept.popleft()
        tc = self.transcoder
        if x.shape[-1] != tc.d_out or inputs.shape[-1] != tc.d_in:
            raise ModelError(
                f"{self.label}: the transcoder reads width {tc.d_in} and writes {tc.d_out}, but "
                f"the model's values have widths {inputs.shape[-1]} and {x.shape[-1]}; give the "
                "transcoder set of this model"
            )
        w = tc.W_dec[self.feature]
        with torch.no_grad():
            act = tc.encode(inputs.to(device=w.device))[..., self.feature]
        new = {"zero": torch.zeros_like(act), "scale": act * self.factor}.get(
            self.op, torch.full_like(act, self.value)
        )
        delta = (new - act).to(device=x.device, dtype=x.dtype)
        mask = self.region.mask(x, tokens)
        if mask is not None:
            delta = delta * mask[..., 0].to(delta.dtype)
        return x + delta[..., None] * w.detach().to(device=x.device, dtype=x.dtype)


def feature_modules(model: nn.Module, layer: int, reads: str, label: str):
    """((reading module's name, module), (writing module's name, module)) of block `layer`: the
    MLP's input (reads=mlp_in) or the norm before it (reads=resid_mid, mlp_normalized), and the
    module whose output is the MLP's write (the anatomy's mlp_write: the MLP, or Gemma's norm
    after it)."""
    body = anatomy(model, block_names(model))
    modules = dict(model.named_modules())
    if not body.mlp_out:
        raise ConfigError(
            f"{label}: a feature edit needs each block's MLP, which probe does not know for a "
            f"{body.family!r} model; set model.anatomy.mlp_out=SUFFIX (and mlp_norm)"
        )
    if not 0 <= layer < len(body.mlp_out):
        raise ConfigError(
            f"{label}: layer={layer} but the model has {len(body.mlp_out)} blocks with an MLP; "
            f"give a layer in [0, {len(body.mlp_out)})"
        )
    mlp = body.mlp_out[layer]
    write = body.mlp_write[layer]  # the MLP, or the norm after it (Gemma's post_mlp_norm)
    if reads == "mlp_in":
        return (mlp, modules[mlp]), (write, modules[write])
    if len(body.mlp_norm) != len(body.mlp_out):
        raise ConfigError(
            f"{label}: the transcoders read {reads}, from the input of each block's norm before "
            f"its MLP, which probe does not know for a {body.family!r} model; set "
            "model.anatomy.mlp_norm=SUFFIX"
        )
    norm = body.mlp_norm[layer]
    return (norm, modules[norm]), (write, modules[write])


def check_feature(label: str, transcoders, layer: int, feature: int) -> None:
    """The set has a transcoder of `layer` with a feature `feature`."""
    if layer not in transcoders.transcoders:
        raise ConfigError(
            f"{label}: the transcoder set {transcoders.source or ''} has no layer {layer}; it has "
            f"layers 0..{len(transcoders.transcoders) - 1}"
        )
    d_tc = transcoders.transcoders[layer].d_tc
    if not 0 <= feature < d_tc:
        raise ConfigError(
            f"{label}: feature={feature} but layer {layer}'s transcoder has {d_tc} features; give "
            f"an index in [0, {d_tc})"
        )


def load_set(path: str, label: str, cache: dict):
    """The transcoder set at `path` (probe.models.transcoder_files), read once per build."""
    if path not in cache:
        from probe.models.transcoder_files import load_transcoders

        loaded = load_transcoders(path)
        if not hasattr(loaded, "transcoders"):  # a cross-layer transcoder
            raise ConfigError(
                f"{label}: {path} is a cross-layer transcoder; feature edits write one layer's "
                "feature into that layer's MLP output, so they take a per-layer transcoder set"
            )
        cache[path] = loaded
    return cache[path]
