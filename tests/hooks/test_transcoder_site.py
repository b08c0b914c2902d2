"""A transcoder set's features as a run site (a probe's `transcoders`): each feature's top-k
examples over the dataset equal a hand maximum of the features computed with plain forward hooks
and plain torch, for a set reading the MLP's input (on the MLPs) and one reading the norm's
normalised input (on the norms), and for a cross-layer transcoder; a probe on modules the set does
not read is refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import probe
from probe.errors import ConfigError
from probe.models.clt_files import save_cross_layer
from probe.models.cross_layer_transcoder import CrossLayerTranscoder
from probe.models.transcoder_files import save_transcoders
from probe.testing.random_transcoders import random_cross_layer, random_transcoders
from probe.testing.tiny_lms import make_tiny, make_tokenizer
from tests.helpers import run_probe

K = 3


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    root = tmp_path_factory.mktemp("tc_site")
    model = make_tokenizer(make_tiny("gpt2", root / "gpt2", vocab_size=50))
    ids = torch.randint(4, 50, (24, 12), generator=torch.Generator().manual_seed(0))
    torch.save({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, root / "ids.pt")
    return root, model, ids


def block_inputs(model_dir, ids, module: str) -> dict[int, torch.Tensor]:
    """{block: the input of its `module` (mlp, ln_2) over `ids`, float64}, by plain forward
    pre-hooks on the tiny GPT-2."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    inputs = {}
    hooks = [
        getattr(block, module).register_forward_pre_hook(
            lambda m, args, i=i: inputs.__setitem__(i, args[0].detach().double())
        )
        for i, block in enumerate(model.transformer.h)
    ]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return inputs


def hand_topk(model_dir, ids, tset, module: str) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """{layer: (values (units, K), (sample, position) keys (units, K))}: the features of each
    block's `module` input (the norm's normalised by hand for mlp_normalized), top K over every
    token, ties by the smaller (sample, position)."""
    inputs = block_inputs(model_dir, ids, module)
    out = {}
    for layer in range(len(tset)):
        x = inputs[layer]
        if tset.reads == "mlp_normalized":  # LayerNorm's x centred over 1/std, no weight or bias
            xc = x - x.mean(-1, keepdim=True)
            x = xc / (xc.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
        if isinstance(tset, CrossLayerTranscoder):  # layer l's encoder: W_enc[l], b_enc[l]
            W, b = tset.W_enc[layer], tset.b_enc[layer]
        else:
            W, b = tset[layer].W_enc, tset[layer].b_enc
        acts = torch.relu(x @ W.detach().double() + b.detach().double())
        acts = acts.reshape(-1, acts.shape[-1]).T.numpy()  # (units, sample-major tokens)
        order = np.lexsort((np.arange(acts.shape[1])[None].repeat(len(acts), 0), -acts), axis=1)
        top = order[:, :K]
        out[layer] = (np.take_along_axis(acts, top, 1), top)
    return out


@pytest.mark.parametrize(
    ("reads", "module", "kind"),
    [("mlp_in", "mlp", "plt"), ("mlp_normalized", "ln_2", "plt"), ("resid_mid", "ln_2", "clt")],
)
def test_feature_examples_are_the_hand_maximum(lm, tmp_path, reads, module, kind):
    """Per-layer sets reading the MLP's input and the norm's normalised input, and a cross-layer
    transcoder reading the norm's input (each layer's encoder)."""
    root, model, ids = lm
    if kind == "clt":
        tset = random_cross_layer(reads=reads, seed=3)
        save_cross_layer(tset, tmp_path / "tc")
    else:
        tset = random_transcoders(reads=reads, seed=3)
        save_transcoders(tset, tmp_path / "tc")
    _, f = run_probe(tmp_path / "run", "model=hf", f"model.name={model}", "model.task=causal_lm",
                     "dataset=tokens", f"dataset.path={root / 'ids.pt'}", "dataset.batch_size=8",
                     "probes=none", f"+probes.tc.layers=[@blocks.{module}]",
                     "+probes.tc.capture=[]", "+probes.tc.rows=tokens",
                     f"+probes.tc.transcoders={tmp_path / 'tc'}", f"stats.topk={K}")  # fmt: skip
    f.close()
    want = hand_topk(model, ids, tset, module)
    with probe.open_run(tmp_path / "run") as run:
        assert not any(site == "output" for _, site in run.keys)  # features alone: no rows
        for layer, (values, keys) in want.items():
            got = run.topk(f"transformer.h.{layer}.{module}", "transcoder.features")
            got = got.sort_values(["unit", "rank"])
            units = tset.d_tc if kind == "clt" else tset[layer].d_tc
            np.testing.assert_allclose(
                got["value"].to_numpy().reshape(units, K), values, rtol=1e-5, atol=1e-6
            )
            where = (got["sample"] * ids.shape[1] + got["position"]).to_numpy().reshape(units, K)
            np.testing.assert_array_equal(where, keys)


def test_a_set_on_modules_it_does_not_read_is_refused(lm, tmp_path):
    root, model, _ = lm
    save_transcoders(random_transcoders(reads="mlp_in"), tmp_path / "tc")
    with pytest.raises(ConfigError, match=r"the set reads mlp_in, the input of the MLP.*select"):
        run_probe(tmp_path / "run", "model=hf", f"model.name={model}", "model.task=causal_lm",
                  "dataset=tokens", f"dataset.path={root / 'ids.pt'}", "probes=none",
                  "+probes.tc.layers=[@blocks.ln_2]", "+probes.tc.capture=[]",
                  "+probes.tc.rows=tokens", f"+probes.tc.transcoders={tmp_path / 'tc'}")  # fmt: skip
