"""Random transcoder sets and cross-layer transcoders for the graph tests and benchmarks: seeded,
about half the features active at each position of a tiny model."""

from __future__ import annotations

import torch

from probe.models.cross_layer_transcoder import CrossLayerTranscoder
from probe.models.transcoder import Transcoder, TranscoderSet


def random_transcoders(
    width: int = 32,
    layers: int = 2,
    *,
    reads: str = "mlp_in",
    activation: str = "relu",
    skip: bool = False,
    seed: int = 0,
    expansion: int = 4,
    dtype: torch.dtype = torch.float32,
) -> TranscoderSet:
    """One random transcoder of `expansion` x `width` features per layer (relu, jumprelu with
    random thresholds, or topk with k=12), with a skip matrix if `skip`."""
    g = torch.Generator().manual_seed(seed)
    d_tc = expansion * width
    sets = {}
    for layer in range(layers):
        sets[layer] = Transcoder(
            torch.randn(width, d_tc, generator=g) / width**0.5,
            torch.randn(d_tc, generator=g) * 0.2,
            torch.randn(d_tc, width, generator=g) / d_tc**0.5,
            torch.randn(width, generator=g) * 0.1,
            layer=layer, activation=activation,
            threshold=torch.rand(d_tc, generator=g) * 0.3 if activation == "jumprelu" else None,
            k=12 if activation == "topk" else None,
            W_skip=torch.randn(width, width, generator=g) / width**0.5 if skip else None,
        )  # fmt: skip
    return TranscoderSet(sets, reads=reads).to(dtype=dtype)


def random_cross_layer(
    width: int = 32,
    layers: int = 2,
    *,
    reads: str = "resid_mid",
    activation: str = "relu",
    skip: bool = False,
    seed: int = 0,
    expansion: int = 4,
    dtype: torch.dtype = torch.float32,
) -> CrossLayerTranscoder:
    """A random cross-layer transcoder of `expansion` x `width` features per layer (relu, jumprelu
    with random thresholds, or topk with k=12), each feature writing to its layer and every
    later one, with a skip matrix per layer if `skip`."""
    g = torch.Generator().manual_seed(seed)
    d_tc = expansion * width
    clt = CrossLayerTranscoder(
        torch.randn(layers, width, d_tc, generator=g) / width**0.5,
        torch.randn(layers, d_tc, generator=g) * 0.2,
        [torch.randn(d_tc, layers - i, width, generator=g) / d_tc**0.5 for i in range(layers)],
        torch.randn(layers, width, generator=g) * 0.1,
        activation=activation, reads=reads,
        threshold=torch.rand(layers, d_tc, generator=g) * 0.3 if activation == "jumprelu" else None,
        k=12 if activation == "topk" else None,
        W_skip=torch.randn(layers, width, width, generator=g) / width**0.5 if skip else None,
        scan="random-clt",
    )  # fmt: skip
    return clt.to(dtype=dtype)
