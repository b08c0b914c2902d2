"""Transcoders spliced into a model: while a `Splice` is entered, the MLP output of each chosen
block is replaced at every position by what its transcoder computes from what the set reads, or
by zeros; the rest of the model runs untouched, so later blocks see the spliced residual.

Where a transcoder reads is the set's `reads`, as in the graphs' local replacement model
(probe.graphs.replacement): `mlp_in` the MLP's input, `resid_mid` the input of the norm before
the MLP, `mlp_normalized` that input normalised without the norm's weight and bias
(probe.models.transcoder.normalized). `splice_points` names those modules: from a run's sites
(the modules a fit read its rows from) or from the model's anatomy.

A cross-layer transcoder (probe.models.cross_layer_transcoder) splices the same way: a replaced
block's MLP output becomes everything the CLT writes into it, the features of that block and of
every earlier block, each encoded from what its own block read in this forward (so, with only
block l replaced, the earlier blocks' features read the model's own residual stream).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from probe.analysis.fit.fit_sites import LayerSites
from probe.errors import ConfigError
from probe.hooks.hookset import HookSet
from probe.hooks.module_select import block_names
from probe.models.anatomy import anatomy
from probe.models.cross_layer_transcoder import CrossLayerTranscoder
from probe.models.transcoder import Transcoder, normalized

MODES = ("transcoder", "zero", "with_error")


@dataclass(frozen=True)
class SplicePoint:
    """Block `layer`'s MLP (whose output is replaced) and the module whose input the
    transcoder reads (the MLP itself for mlp_in, the norm before it otherwise)."""

    layer: int
    mlp: str
    source: str
    reads: str


def splice_points(model: nn.Module, layers: list[int], reads: str,
                  sites: dict[int, LayerSites] | None = None) -> dict[int, SplicePoint]:  # fmt: skip
    """Where each of `layers` splices: the modules of `sites` (a fit's: what it read its rows
    from; for mlp_normalized, resid_mid sites) where given, else the model's anatomy (each
    block's `mlp_out` and `mlp_norm`). A ConfigError names a module the model lacks."""
    modules = dict(model.named_modules())
    points = {}
    if sites is not None:
        for layer in layers:
            s = sites[layer]
            points[layer] = SplicePoint(layer, s.outputs[0], s.inputs[0], reads)
    else:
        body = anatomy(model, block_names(model))
        want = len(body.blocks)
        lacking = [key for key, got in (("mlp_out", body.mlp_out), ("mlp_norm", body.mlp_norm))
                   if len(got) != want and (key == "mlp_out" or reads != "mlp_in")]  # fmt: skip
        too_deep = [layer for layer in layers if layer >= want]
        if too_deep or lacking:
            raise ConfigError(
                f"the transcoders of layers {layers} cannot be spliced into the "
                f"{body.family!r} model ({want} blocks"
                f"{'; probe does not know its ' + ', '.join(lacking) if lacking else ''}): set "
                "model.anatomy.mlp_out=SUFFIX and model.anatomy.mlp_norm=SUFFIX (each block's MLP "
                "and the norm before it) in the run's config, or give --mlp/--norm with a run "
                "that captured them"
            )
        for layer in layers:
            source = body.mlp_out[layer] if reads == "mlp_in" else body.mlp_norm[layer]
            points[layer] = SplicePoint(layer, body.mlp_out[layer], source, reads)
    missing = sorted({n for p in points.values() for n in (p.mlp, p.source)} - set(modules))
    if missing:
        raise ConfigError(
            f"the model built from the run's config has no module {', '.join(missing)} (the "
            "run's captures name it): was the run made with another model?"
        )
    return points


class Splice:
    """A context manager: while entered, the MLP output of every block in `layers` (default:
    every block of `points`) is replaced (see the module docstring). `transcoders`: a
    transcoder per layer, or a cross-layer transcoder (whose `points` then name every block it
    reads, so earlier blocks' features can be read). `mode`: `transcoder` (its output of what it
    reads), `zero` (zeros) or `with_error` (the transcoder's output plus its error, the MLP's
    output minus it: the model's own output again, through the same hooks; a check of the
    splice). A transcoder whose widths do not fit what it reads or writes is refused by name."""

    def __init__(self, model: nn.Module, points: dict[int, SplicePoint],
                 transcoders: dict[int, Transcoder] | CrossLayerTranscoder | None = None,
                 mode: str = "transcoder", layers: list[int] | None = None):  # fmt: skip
        if mode not in MODES:
            raise ConfigError(f"splice mode {mode!r}; choose from {', '.join(MODES)}")
        self.layers = sorted(points) if layers is None else sorted(layers)
        self.cross_layer = isinstance(transcoders, CrossLayerTranscoder)
        # the blocks whose reads a replacement needs: its own, and for a CLT every earlier one
        needs = range(self.layers[-1] + 1) if self.cross_layer and self.layers else self.layers
        if mode != "zero" and (
            transcoders is None or set(needs) - set(points)
            or (not self.cross_layer and set(self.layers) - set(transcoders))  # type: ignore[arg-type]
        ):  # fmt: skip
            raise ConfigError(f"splicing layers {self.layers} needs a transcoder for each")
        self.model, self.points, self.mode = model, points, mode
        self.transcoders = transcoders if transcoders is not None else {}
        self._reads = [] if mode == "zero" else list(needs)
        self._modules = dict(model.named_modules())
        self._hooks = HookSet("transcoder splice")
        self._read: dict[int, torch.Tensor] = {}
        self._acts: dict[int, torch.Tensor] = {}

    def __enter__(self) -> Splice:
        self._hooks.enter(self._register)
        return self

    def __exit__(self, *exc) -> None:
        self._read, self._acts = {}, {}
        self._hooks.__exit__(*exc)

    def _register(self) -> None:
        for layer in self._reads:
            p = self.points[layer]
            if p.source != p.mlp or self.cross_layer:
                self._hooks.forward_pre(self._modules[p.source], self._keep(p), name=p.source)
        for layer in self.layers:
            p = self.points[layer]
            self._hooks.forward(self._modules[p.mlp], self._replace(p), name=p.mlp)

    def _keep(self, p: SplicePoint):
        def hook(module, args):
            x = args[0]
            self._read[p.layer] = normalized(module, x) if p.reads == "mlp_normalized" else x
            self._acts.pop(p.layer, None)  # a CLT's features of this block: read anew

        return hook

    def _replace(self, p: SplicePoint):
        def hook(module, args, out):
            value = out[0] if isinstance(out, tuple) else out
            if self.mode == "zero":
                new = torch.zeros_like(value)
            else:
                if self.cross_layer:
                    new = self._cross_layer(p.layer, value)
                else:
                    x = args[0] if p.source == p.mlp else self._read.pop(p.layer)
                    new = self._transcode(p.layer, x, value)
                if self.mode == "with_error":
                    new = new + (value - new)
            return (new, *out[1:]) if isinstance(out, tuple) else new

        return hook

    def _check(self, layer: int, d_in: int, d_out: int, shapes: str, x: torch.Tensor,
               out: torch.Tensor) -> None:  # fmt: skip
        if x.shape[-1] != d_in or out.shape[-1] != d_out:
            raise ConfigError(
                f"the transcoder of layer {layer} reads d_in={d_in} and writes d_out={d_out} "
                f"({shapes}), but the model's {self.points[layer].reads} there is "
                f"{x.shape[-1]} wide and its MLP writes {out.shape[-1]}: give transcoders "
                "trained on this model and read place"
            )

    def _transcode(self, layer: int, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        assert isinstance(self.transcoders, dict)
        t = self.transcoders[layer]
        shapes = f"W_enc {tuple(t.W_enc.shape)}, W_dec {tuple(t.W_dec.shape)}"
        self._check(layer, t.d_in, t.d_out, shapes, x, out)
        return t(x.to(t.W_enc.dtype)).to(out.dtype)

    def _cross_layer(self, layer: int, out: torch.Tensor) -> torch.Tensor:
        """What the CLT writes into block `layer`'s MLP output: b_dec, the writes of the
        features of blocks 0..layer (each encoded from its block's read of this forward) and
        the skip path of this block's read."""
        clt = self.transcoders
        assert isinstance(clt, CrossLayerTranscoder)
        shapes = f"W_enc {tuple(clt.W_enc.shape)}, b_dec {tuple(clt.b_dec.shape)}"
        reads = [self._read[source] for source in range(layer + 1)]
        for source, x in enumerate(reads):
            self._check(source, clt.d_in, clt.d_out, shapes, x, out)
        new = clt.b_dec[layer] + clt.skip(layer, reads[layer])
        for source, x in enumerate(reads):
            if source not in self._acts:
                self._acts[source] = clt.encode(source, x)
            new = new + self._acts[source] @ clt.W_dec[source][:, layer - source]
        return new.to(out.dtype)
