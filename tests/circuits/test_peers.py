"""probe's EAP edge scores against TransformerLens on the same tiny GPT-2 and Llama weights:
hannamw/EAP-IG's EAP algorithm (its `get_scores_eap`: per-node activation differences added by
forward hooks on the corrupt run and subtracted on the clean one, then scored at every receiver
by backward hooks at TransformerLens's split q/k/v inputs, `hook_mlp_in` and the last
`hook_resid_post`) run through TransformerLens's own hook points, per edge.

TransformerLens 4 (the one that installs beside transformers 5) has no HookedTransformer; its
TransformerBridge wraps the HuggingFace model, and with grouped-query attention its split key and
value inputs are per key/value head, as probe's receivers are. (auto-circuit 1.0.1, the other
peer, imports `transformer_lens.past_key_value_caching`, which TransformerLens 4 no longer has,
so it cannot run here.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from probe.circuits.parts import parts_of
from probe.circuits.scores import attribute
from probe.testing.tokens import make_tokenizer
from tests.circuits.hand import logit_diff
from tests.circuits.test_hand import build
from tests.circuits.toy import pairs

pytest.importorskip("transformer_lens", reason="TransformerLens is not installed")


def bridge(model, tmp_path):
    """A TransformerBridge over a copy of `model` (eager attention), with EAP-IG's hooks on."""
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model.save_pretrained(tmp_path / "model")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "model", attn_implementation="eager")
    tok = AutoTokenizer.from_pretrained(make_tokenizer(tmp_path / "tok"))
    b = TransformerBridge.boot_transformers(
        str(tmp_path / "model"), hf_model=hf.eval(), tokenizer=tok, device="cpu"
    )
    b.enable_compatibility_mode(no_processing=True, disable_warnings=True)
    b.set_use_split_qkv_input(True)
    b.set_use_attn_result(True)
    b.set_use_hook_mlp_in(True)
    return b


def eap_ig_scores(b, batch) -> dict[str, float]:
    """EAP-IG's get_scores_eap on TransformerLens hooks; edge names as EAP-IG writes them."""
    cfg = b.cfg
    L, H = cfg.n_layers, cfg.n_heads
    K = getattr(cfg, "n_key_value_heads", None) or H
    ids, corrupt = batch["input_ids"], batch["corrupt_ids"]
    n_forward = 1 + L * (H + 1)
    diff = torch.zeros(*ids.shape, n_forward, cfg.d_model)
    scores = {}

    def act(index, sign):
        def hook(x, hook):
            diff[:, :, index] += sign * x.detach()

        return hook

    senders = ["input"] + [
        n for j in range(L) for n in [f"a{j}.h{h}" for h in range(H)] + [f"m{j}"]
    ]

    def fwd(sign):
        hooks = [("hook_embed", act(0, sign))]
        for j in range(L):
            first = 1 + j * (H + 1)
            hooks.append((f"blocks.{j}.attn.hook_result", act(slice(first, first + H), sign)))
            hooks.append((f"blocks.{j}.hook_mlp_out", act(first + H, sign)))
        return hooks

    def grad(names, prev):
        def hook(g, hook):
            g = g.detach()
            g = g if g.ndim == 4 else g[:, :, None]
            s = torch.einsum("ntfd,ntbd->fb", diff[:, :, :prev], g)
            for bi, r in enumerate(names):
                for fi in range(prev):
                    scores[f"{senders[fi]}->{r}"] = float(s[fi, bi]) / len(ids)

        return hook

    bwd = []
    for j in range(L):
        prev = 1 + j * (H + 1)
        for c, count in (("q", H), ("k", K), ("v", K)):
            names = [f"a{j}.h{h}<{c}>" for h in range(count)]
            bwd.append((f"blocks.{j}.hook_{c}_input", grad(names, prev)))
        bwd.append((f"blocks.{j}.hook_mlp_in", grad([f"m{j}"], prev + H)))
    bwd.append((f"blocks.{L - 1}.hook_resid_post", grad(["logits"], n_forward)))
    with torch.no_grad(), b.hooks(fwd_hooks=fwd(1)):
        b(corrupt)
    with b.hooks(fwd_hooks=fwd(-1), bwd_hooks=bwd):
        logits = b(ids)
        logit_diff(logits, batch).sum().backward()
    return scores


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_eap_equals_eap_ig_on_transformer_lens_per_edge(family, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # everything it loads is local
    model = build(family)
    batch = pairs(50)
    theirs = eap_ig_scores(bridge(model, tmp_path), batch)
    parts = parts_of(model)
    mine = dict(zip(parts.graph.edges, attribute(parts, [batch])["eap"].edges, strict=True))
    assert set(mine) == set(theirs)
    names = sorted(mine)
    a, b = np.array([mine[n] for n in names]), np.array([theirs[n] for n in names])
    assert np.abs(b).max() > 1e-2
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4 * np.abs(b).max())
