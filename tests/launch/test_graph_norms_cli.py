"""No silently wrong norm through the CLI: `python -m probe ... graph.transcoders=...` on a
saved tiny Llama whose norms are a LlamaRMSNorm subclass computing x / rms * (1 + weight), its
weights w - 1 (the same function), writes the plain Llama's graph (probe.attribution_graph);
with a subclass computing none of the known formulas it exits 2 naming the norm."""

from __future__ import annotations

import torch
import transformers

import probe
from probe.graphs.graph_files import load_graph
from probe.models.transcoder_files import save_transcoders
from probe.testing.random_transcoders import random_transcoders
from tests.graphs.test_graph_families import (
    GEMMA_KEYS,
    PROMPT,
    GemmaStyleLlamaRMSNorm,
    TanhLlamaRMSNorm,
    tiny,
)


def test_the_cli_gives_the_exact_graph_or_exits_2(cli_here, tmp_path, monkeypatch):
    ts = random_transcoders(32, 2, reads="mlp_in", skip=True, expansion=1)
    ts.ids.update({0: "a", 1: "b"})
    save_transcoders(ts, tmp_path / "set")
    plain = tiny("llama").float()
    want = probe.attribution_graph(plain, PROMPT, ts, prepend_bos=False, floor=0.0)
    shifted = {k: v - 1 if "norm" in k else v for k, v in plain.state_dict().items()}
    plain.load_state_dict(shifted)  # the weights GemmaStyleLlamaRMSNorm's 1 + weight makes w again
    plain.save_pretrained(tmp_path / "model")
    torch.save({"input_ids": PROMPT[None]}, tmp_path / "ids.pt")
    args = ["model=hf", f"model.name={tmp_path / 'model'}", "model.task=causal_lm", "probes=none",
            "dataset=tokens", f"dataset.path={tmp_path / 'ids.pt'}",
            f"graph.transcoders={tmp_path / 'set'}", "graph.prepend_bos=false", "graph.floor=0"]  # fmt: skip
    modeling = transformers.models.llama.modeling_llama
    monkeypatch.setattr(
        modeling, "LlamaRMSNorm", GemmaStyleLlamaRMSNorm
    )  # the model is built with it
    code, text = cli_here(*args)
    assert code == 0, text
    got = load_graph(tmp_path / "run", 0)
    assert torch.equal(got.features, want.features) and torch.equal(got.node_kept, want.node_kept)
    scale = float(want.adjacency.to_dense().abs().max())
    torch.testing.assert_close(got.adjacency.to_dense(), want.adjacency.to_dense(), rtol=1e-4, atol=1e-5 * scale)  # fmt: skip
    monkeypatch.setattr(modeling, "LlamaRMSNorm", TanhLlamaRMSNorm)
    code, text = cli_here(*args, run_dir=tmp_path / "refused")
    assert code == 2 and "TanhLlamaRMSNorm" in text and "input_layernorm" in text, text


def test_a_gemma2_given_anatomy_keys_by_hand_through_the_cli(cli_here, tmp_path, monkeypatch):
    """A saved tiny Gemma-2 whose family probe did not know, given `model.anatomy.*` keys: without
    its post-norms, exit 2 naming them; with `post_attn_norm` and `post_mlp_norm`, the graph of
    probe.attribution_graph on the known family."""
    from probe.models import anatomy

    ts = random_transcoders(32, 2, reads="mlp_normalized", skip=True, expansion=1)
    ts.ids.update({0: "a", 1: "b"})
    save_transcoders(ts, tmp_path / "set")
    model = tiny("gemma2").float()
    want = probe.attribution_graph(model, PROMPT, ts, prepend_bos=False, floor=0.0)
    model.save_pretrained(tmp_path / "model")
    torch.save({"input_ids": PROMPT[None]}, tmp_path / "ids.pt")
    keys = [f"+model.anatomy.{k}={v}" for k, v in GEMMA_KEYS.items()]
    args = ["model=hf", f"model.name={tmp_path / 'model'}", "model.task=causal_lm", "probes=none",
            "dataset=tokens", f"dataset.path={tmp_path / 'ids.pt'}", *keys,
            f"graph.transcoders={tmp_path / 'set'}", "graph.prepend_bos=false", "graph.floor=0"]  # fmt: skip
    monkeypatch.delitem(anatomy.FAMILIES, "gemma2")
    code, text = cli_here(*args, run_dir=tmp_path / "refused")
    assert code == 2 and "post_attention_layernorm" in text and "post_attn_norm" in text, text
    named = ["+model.anatomy.post_attn_norm=post_attention_layernorm",
             "+model.anatomy.post_mlp_norm=post_feedforward_layernorm"]  # fmt: skip
    code, text = cli_here(*args, *named)
    assert code == 0, text
    got = load_graph(tmp_path / "run", 0)
    assert torch.equal(got.features, want.features) and torch.equal(got.node_kept, want.node_kept)
    scale = float(want.adjacency.to_dense().abs().max())
    torch.testing.assert_close(got.adjacency.to_dense(), want.adjacency.to_dense(), rtol=1e-4, atol=1e-5 * scale)  # fmt: skip
