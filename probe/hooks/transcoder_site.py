"""A transcoder set's features as a site of the modules it reads (a probe's `transcoders` key):
`transcoder.features`, each feature a unit, so the run's statistics and examples (`stats.topk`)
say what each feature responds to over a dataset, as an SAE's latents do (probe.hooks.sae_site).

The probe selects, in each block, the module whose input is what the set reads: the MLP for a
set reading `mlp_in` (its input), the norm before the MLP for `resid_mid` (its input) and
`mlp_normalized` (its input centred and scaled, before the norm's weight and bias). The block is
the number in the module's name (`transformer.h.3.mlp`: 3). The features are computed where the
input lives, in float32, observed only (the model goes on unchanged), and never stored as rows:
their statistics and examples are what the site is for.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import torch

from probe.errors import ConfigError
from probe.layout import unit_axis
from probe.models.anatomy import MLP_MODULES, MLP_NORM_MODULES
from probe.models.cross_layer_transcoder import AnyTranscoders, CrossLayerTranscoder
from probe.models.transcoder import Transcoder, norm_kind, normalized

SITE = "transcoder.features"
_BLOCK = re.compile(r"^(?:.*\.)?(\d+)\.(.+)$")
_sets: dict[str, AnyTranscoders] = {}  # (one load of a set per process, whatever its modules)


def transcoder_site(selection) -> TranscoderSite | None:
    """The TranscoderSite of a selection whose probe names a set (its errors name the module),
    or None."""
    if isinstance(selection.transcoders, TranscoderSite) or selection.transcoders is None:
        return selection.transcoders
    return TranscoderSite(selection.name, selection.module, str(selection.transcoders))


def load_set(path: str) -> AnyTranscoders:
    from probe.models.transcoder_files import load_transcoders

    key = str(Path(path).expanduser().resolve())
    if key not in _sets:
        _sets[key] = load_transcoders(path)
    return _sets[key]


class TranscoderSite:
    """One block's transcoder on the module it reads: `features(x)` of the module's input."""

    def __init__(self, name: str, module: torch.nn.Module, path: str):
        self.name, self.module, self.path = name, module, path
        tset = load_set(path)
        self.reads = tset.reads
        match = _BLOCK.match(name)
        role = None
        if match:
            suffix = match.group(2)
            role = (
                "mlp" if suffix in MLP_MODULES else "norm" if suffix in MLP_NORM_MODULES else None
            )
        want = "the MLP" if self.reads == "mlp_in" else "the norm before the MLP"
        if role is None or (role == "mlp") != (self.reads == "mlp_in"):
            raise ConfigError(
                f"probe transcoders={path!r} on {name!r}: the set reads {self.reads}, the input of "
                f"{want} in each block ({', '.join(MLP_MODULES if self.reads == 'mlp_in' else MLP_NORM_MODULES)}"
                f"); select those modules (e.g. layers: [@blocks.{'mlp' if self.reads == 'mlp_in' else 'ln_2'}])"
            )
        assert match is not None  # (role is None without a match)
        self.block = int(match.group(1))
        layers = (
            list(range(len(tset)))
            if isinstance(tset, CrossLayerTranscoder)
            else sorted(tset.transcoders)
        )
        if self.block not in layers:
            raise ConfigError(
                f"probe transcoders={path!r}: {name!r} is block {self.block}, and the set holds "
                f"layers {layers}; select the blocks it has"
            )
        if self.reads == "mlp_normalized":
            norm_kind(module)  # (a norm it cannot normalise by: refused before the run)
        self.transcoder: Transcoder = encoder_of(tset, self.block)
        self.placed: dict[torch.device, Transcoder] = {}

    def on(self, device: torch.device) -> Transcoder:
        if device not in self.placed:  # (a copy: the loaded set is shared)
            self.placed[device] = copy.deepcopy(self.transcoder).to(device, torch.float32)
        return self.placed[device]

    @torch.no_grad()
    def features(self, x: torch.Tensor, axis: int) -> torch.Tensor:
        """The features (d_tc units on `axis`) of the module's input `x`."""
        units = x.detach().movedim(axis, -1)
        t = self.on(x.device)
        if units.shape[-1] != t.d_in:
            raise ConfigError(
                f"probe transcoders={self.path!r}: layer {self.block}'s transcoder reads "
                f"{t.d_in} values, and {self.name!r}'s input has {units.shape[-1]}; give the set "
                "trained on this model"
            )
        u = units.float()
        if self.reads == "mlp_normalized":
            u = normalized(self.module, u)
        return t.encode(u).movedim(-1, axis)


def encoder_of(tset: AnyTranscoders, layer: int) -> Transcoder:
    """Layer `layer`'s encoder as a Transcoder: a per-layer set's own, or a cross-layer
    transcoder's encoder of that layer (its decoders, which write to every later layer, left out:
    a zero decoder of width 1)."""
    if not isinstance(tset, CrossLayerTranscoder):
        return tset.transcoders[layer]
    with torch.no_grad():
        d_tc = tset.d_tc
        return Transcoder(
            tset.W_enc[layer].clone(), tset.b_enc[layer].clone(), torch.zeros(d_tc, 1),
            torch.zeros(1), layer=layer, activation=tset.activation, k=tset.k,
            threshold=None if tset.threshold is None else tset.threshold[layer].clone(),
        )  # fmt: skip


def take_features(batch, site: TranscoderSite, x: torch.Tensor, sel) -> None:
    """The features of the module's input `x` taken as the site `transcoder.features` of the
    batch being recorded: statistics and examples, no rows."""
    if not batch.recording:
        return
    axis = unit_axis(
        sel.unit_axis, sel.class_axis, x.ndim, f"probe {sel.probe!r} layer {site.name!r}"
    )
    batch.take((site.name, SITE), site.features(x, axis), sel, store=False)
