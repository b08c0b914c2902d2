"""Graphs on each family probe knows (Gemma-2 with its sandwich norms, softcaps and sliding
window; Gemma-3 with q/k norms and local and global layers; Qwen3; Mistral), tiny and random with
norm weights that are not 1: adding a node's write again in the frozen forward moves every target
by its edge weight. And no silently wrong norm: a norm computing another formula than its class
says, a subclass, a hand-given anatomy that misses Gemma's post-norms: the graph is exact (equal
to the plain model's) or refused by name, through the API and the CLI."""

from __future__ import annotations

import pytest
import torch
import transformers

import probe
from probe.errors import ConfigError
from probe.graphs.attribution import GraphOptions, attribute
from probe.graphs.replacement import LocalReplacement
from probe.hooks.hookset import HookSet
from probe.models import anatomy as anatomy_module
from probe.testing.random_transcoders import random_transcoders
from tests.graphs.test_graph_attribution import error_vectors

PROMPT = torch.tensor([2, 7, 12, 9, 20, 5, 14])
COMMON = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0,
              bos_token_id=2, eos_token_id=2)  # fmt: skip


def tiny(family: str, seed: int = 0) -> torch.nn.Module:
    """A tiny random model of `family` in float64, its norm weights random (not the identity)."""
    configs = {
        "gemma2": lambda: transformers.Gemma2Config(
            num_hidden_layers=2, sliding_window=4, attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0, query_pre_attn_scalar=8, **COMMON,
        ),
        "gemma3": lambda: transformers.Gemma3TextConfig(
            num_hidden_layers=2, sliding_window=3, query_pre_attn_scalar=8,
            layer_types=["sliding_attention", "full_attention"], **COMMON,
        ),
        "qwen3": lambda: transformers.Qwen3Config(num_hidden_layers=2, **COMMON),
        "mistral": lambda: transformers.MistralConfig(num_hidden_layers=2, **COMMON),
        "llama": lambda: transformers.LlamaConfig(num_hidden_layers=2, **COMMON),
    }  # fmt: skip
    config = configs[family]()
    config._attn_implementation = "eager"
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:  # Gemma's gain is 1 + weight, Llama's the weight
                    p.copy_(0.3 * torch.randn_like(p) + (0.0 if "gemma" in family else 1.0))
    return model.double()


def linear_targets(model, rep, ts, graph, add=None) -> torch.Tensor:
    """The graph's targets in the frozen forward (a replay), `add` = (module, pos, vector) added to
    that module's output: the features' pre-activations, then the logit nodes' unembedding rows
    minus the mean row times the final norm's output (before any final softcap)."""
    hooks = HookSet("intervention")
    with torch.no_grad(), rep, hooks:
        if add is not None:
            module, pos, vec = add

            def plus(m, args, out):
                out = out.clone()
                out[0, pos] += vec.to(out.dtype)
                return out

            hooks.forward(module, plus)
        model(graph.tokens[None])
        final = rep.captured.final[0, -1]
        w = rep.parts.unembed
        logits = (w[graph.logit_tokens] - w.mean(0)) @ final
        feats = [
            ts[a].pre_activations(rep.captured.inputs[a][0])[p, k]
            for a, p, k in graph.features.tolist()
        ]
        return torch.cat([torch.stack(feats), logits])


def assert_edges_are_direct_effects(model, ts, graph, stride: int = 20) -> None:
    """Every error and token node, and every `stride`-th feature: its write added again in the
    frozen forward moves the targets by its edge weights."""
    rep = LocalReplacement(model, ts, mode="record")
    with torch.no_grad(), rep:
        model(graph.tokens[None])
    rep.mode = "replay"
    errors = error_vectors(rep, ts)
    clean = linear_targets(model, rep, ts, graph)
    dense = graph.adjacency.to_dense().double()
    n = graph.n_nodes
    targets = torch.cat([torch.arange(graph.n_features), torch.arange(n - graph.n_logits, n)])
    writes = rep.mlp_writes
    sources = [("feature", i) for i in range(0, graph.n_features, stride)]
    sources += [("error", i) for i in range(graph.n_errors)]
    sources += [("token", p) for p in range(graph.n_pos)]
    scale = float(dense.abs().max())
    for kind, i in sources:
        if kind == "feature":
            layer, pos, f = graph.features[i].tolist()
            add = (writes[layer], pos, graph.activations[i].double() * ts[layer].W_dec[f])
        elif kind == "error":
            layer, pos = divmod(i, graph.n_pos)
            add = (writes[layer], pos, errors[layer][pos])
        else:
            add = (rep.parts.embed, i, rep.captured.embed[0, i])
        moved = linear_targets(model, rep, ts, graph, add) - clean
        column = dense[targets, graph.offsets[kind] + i]
        torch.testing.assert_close(moved, column, rtol=1e-5, atol=1e-6 * scale)


CASES = [  # family, reads, activation, skip, writes
    ("gemma2", "mlp_normalized", "jumprelu", True),
    ("gemma2", "mlp_in", "relu", True, "mlp_module_out"),
    ("gemma3", "mlp_in", "relu", False),
    ("qwen3", "resid_mid", "relu", True),
    ("mistral", "mlp_normalized", "topk", False),
]


@pytest.mark.parametrize(
    "family,reads,activation,skip,writes", [(*c, "mlp_out")[:5] for c in CASES]
)
def test_each_familys_edges_are_direct_effects_in_its_frozen_forward(family, reads, activation, skip, writes):  # fmt: skip
    model = tiny(family)
    layers = model.config.num_hidden_layers
    ts = random_transcoders(32, layers, reads=reads, activation=activation, skip=skip,
                            expansion=2, dtype=torch.float64)  # fmt: skip
    ts.writes = writes
    graph = attribute(model, PROMPT, ts, GraphOptions(batch_size=64, floor=0.0))
    assert graph.n_features > 40 and graph.n_logits >= 1
    assert_edges_are_direct_effects(model, ts, graph)
    # the logit nodes' probabilities: the model's, after its final softcap (Gemma-2's 3.0)
    with torch.no_grad():
        logits = model(PROMPT[None]).logits[0, -1]
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:  # by hand: cap * tanh(unembedding . final norm output / cap)
        hidden = model.model(PROMPT[None]).last_hidden_state[0, -1]
        torch.testing.assert_close(logits, cap * torch.tanh(model.lm_head(hidden) / cap))
    torch.testing.assert_close(
        graph.logit_probs.double(), torch.softmax(logits, -1)[graph.logit_tokens]
    )


def test_gemma2_reads_the_pre_feedforward_norms_x_over_rms_and_writes_after_the_post_norm():
    """circuit-tracer's Gemma Scope places (ln2.hook_normalized, hook_mlp_out): the transcoder
    input is pre_feedforward_layernorm's input / rms (before its 1 + weight) and the MLP output
    the post_feedforward_layernorm's output, by hand from forward hooks."""
    model = tiny("gemma2")
    ts = random_transcoders(32, 2, reads="mlp_normalized", dtype=torch.float64)
    seen, hooks = {}, HookSet("places")
    layer0 = model.model.layers[0]
    hooks.forward(layer0.pre_feedforward_layernorm, lambda m, a, o: seen.update(x=a[0]))
    hooks.forward(layer0.post_feedforward_layernorm, lambda m, a, o: seen.update(out=o))
    rep = LocalReplacement(model, ts, mode="record")
    with torch.no_grad(), rep, hooks:
        model(PROMPT[None])
    x = seen["x"]
    eps = model.config.rms_norm_eps
    torch.testing.assert_close(rep.saved["inputs"][0], x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))  # fmt: skip
    torch.testing.assert_close(rep.saved["mlp"][0], seen["out"])
    ts.writes = "mlp_module_out"  # mlp.hook_out: the MLP module's own output, before the norm
    hooks.forward(layer0.mlp, lambda m, a, o: seen.update(mlp=o))
    rep = LocalReplacement(model, ts, mode="record")
    with torch.no_grad(), rep, hooks:
        model(PROMPT[None])
    torch.testing.assert_close(rep.saved["mlp"][0], seen["mlp"])
    assert not torch.allclose(seen["mlp"], seen["out"])


class GemmaStyleLlamaRMSNorm(transformers.models.llama.modeling_llama.LlamaRMSNorm):
    """A LlamaRMSNorm subclass computing Gemma's x / rms * (1 + weight)."""

    def forward(self, x):
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (out * (1.0 + self.weight.float())).to(x.dtype)


class TanhLlamaRMSNorm(transformers.models.llama.modeling_llama.LlamaRMSNorm):
    """A LlamaRMSNorm subclass computing none of the known formulas."""

    def forward(self, x):
        return torch.tanh(super().forward(x))


def with_norms(model, cls, shift: float = 0.0):
    """`model` with every LlamaRMSNorm replaced by `cls` holding its weight + shift."""
    for name, m in list(model.named_modules()):
        if type(m).__name__ == "LlamaRMSNorm":
            new = cls(m.weight.shape[0], eps=m.variance_epsilon).to(m.weight.dtype)
            with torch.no_grad():
                new.weight.copy_(m.weight + shift)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, new)
    return model


@pytest.fixture(scope="module")
def llama_graph():
    ts = random_transcoders(32, 2, reads="mlp_in", skip=True, expansion=2, dtype=torch.float64)
    model = tiny("llama")
    return ts, model, attribute(model, PROMPT, ts, GraphOptions(floor=0.0)).prune()


def same_graph(a, b) -> None:
    assert torch.equal(a.features, b.features) and torch.equal(a.logit_tokens, b.logit_tokens)
    scale = float(b.adjacency.to_dense().abs().max())
    torch.testing.assert_close(a.adjacency.to_dense(), b.adjacency.to_dense(), rtol=1e-6, atol=1e-7 * scale)  # fmt: skip
    assert torch.equal(a.node_kept, b.node_kept) and torch.equal(a.edge_kept, b.edge_kept)


def test_a_one_plus_weight_subclass_gives_the_exact_graph_through_the_api(llama_graph):
    """The same function as the Llama (weights w - 1, gain 1 + weight): the Llama's graph."""
    ts, _, want = llama_graph
    model = with_norms(tiny("llama"), GemmaStyleLlamaRMSNorm, shift=-1.0)
    got = probe.attribution_graph(model, PROMPT, ts, floor=0.0)
    same_graph(got, want)
    assert got.scores == pytest.approx(want.scores, rel=1e-6)


def test_a_norm_of_no_known_formula_is_refused_by_name():
    model = with_norms(tiny("llama"), TanhLlamaRMSNorm)
    ts = random_transcoders(32, 2, dtype=torch.float64)
    with pytest.raises(ConfigError) as e:
        probe.attribution_graph(model, PROMPT, ts)
    for words in ("model.layers.0.input_layernorm", "TanhLlamaRMSNorm", "x / sqrt(mean(x^2) + eps) * weight",
                  "off by", "register_norm"):  # fmt: skip
        assert words in str(e.value)


def test_a_known_class_computing_another_formula_is_refused(monkeypatch):
    """LlamaRMSNorm itself made to compute (1 + weight): its class's formula no longer holds."""
    cls = transformers.models.llama.modeling_llama.LlamaRMSNorm
    monkeypatch.setattr(cls, "forward", GemmaStyleLlamaRMSNorm.forward)
    ts = random_transcoders(32, 2, dtype=torch.float64)
    with pytest.raises(ConfigError, match=r"input_layernorm.*LlamaRMSNorm.*its class"):
        probe.attribution_graph(tiny("llama"), PROMPT, ts)


GEMMA_KEYS = {"attn": "self_attn", "attn_out": "self_attn.o_proj", "mlp_out": "mlp",
              "attn_norm": "input_layernorm", "mlp_norm": "pre_feedforward_layernorm",
              "final_norm": "model.norm", "unembed": "lm_head"}  # fmt: skip


def test_gemma2_given_anatomy_keys_by_hand_is_exact_or_refused(monkeypatch):
    """A Gemma-2 whose family probe did not know: keys that miss its post-norms are refused by
    name (before the forward); keys that claim them as pattern norms are refused by the residual
    check; keys that name them give the graph of the known family."""
    model = tiny("gemma2")
    ts = random_transcoders(
        32, 2, reads="mlp_normalized", skip=True, expansion=1, dtype=torch.float64
    )
    want = probe.attribution_graph(model, PROMPT, ts, floor=0.0)
    monkeypatch.delitem(anatomy_module.FAMILIES, "gemma2")
    with pytest.raises(ConfigError, match=r"cannot place: model.layers.0.post_attention_layernorm"):
        probe.attribution_graph(model, PROMPT, ts, overrides=GEMMA_KEYS)
    lying = GEMMA_KEYS | {"pattern_norms": ["post_attention_layernorm", "post_feedforward_layernorm"]}  # fmt: skip
    with pytest.raises(ConfigError, match=r"block 'model.layers.0'.*not the sum"):
        probe.attribution_graph(model, PROMPT, ts, overrides=lying)
    named = GEMMA_KEYS | {"post_attn_norm": "post_attention_layernorm",
                          "post_mlp_norm": "post_feedforward_layernorm"}  # fmt: skip
    same_graph(probe.attribution_graph(model, PROMPT, ts, overrides=named, floor=0.0), want)


def test_gemma_scope_sets_on_disk_give_the_graph_of_the_set_in_memory(tmp_path):
    """A Gemma Scope set (layer_<i>.npz) on a Gemma-2 and a Gemma Scope 2 set (lower-case
    safetensors, affine_skip_connection) on a Gemma-3, each named by a YAML with circuit-tracer's
    Gemma hooks (ln2.hook_normalized -> hook_mlp_out): loaded with those places, their graphs
    are the in-memory sets' graphs; mlp.hook_out loads as mlp_module_out and saves back as it."""
    import yaml
    from safetensors.torch import save_file

    from probe.models.transcoder_files import load_transcoders, save_transcoders

    hooks = {"feature_input_hook": "ln2.hook_normalized", "feature_output_hook": "hook_mlp_out"}
    ts = random_transcoders(32, 2, reads="mlp_normalized", activation="jumprelu", expansion=1,
                            dtype=torch.float64)  # fmt: skip
    save_transcoders(ts, tmp_path / "gs", layout="gemma_scope")
    gs = load_transcoders(tmp_path / "gs", dtype=torch.float64)
    assert (gs.reads, gs.writes) == ("mlp_normalized", "mlp_out")
    model = tiny("gemma2")
    same_graph(attribute(model, PROMPT, gs, GraphOptions(floor=0.0)).prune(),
               attribute(model, PROMPT, ts, GraphOptions(floor=0.0)).prune())  # fmt: skip
    skip = random_transcoders(32, 2, reads="mlp_normalized", activation="jumprelu", skip=True,
                              expansion=1, seed=1, dtype=torch.float64)  # fmt: skip
    (tmp_path / "gs2").mkdir()
    for layer, t in skip.transcoders.items():
        save_file({"w_enc": t.W_enc.detach(), "w_dec": t.W_dec.detach(), "b_enc": t.b_enc.detach(),
                   "b_dec": t.b_dec.detach(), "threshold": t.threshold.detach(),
                   "affine_skip_connection": t.W_skip.detach().T.contiguous()},
                  tmp_path / "gs2" / f"params_{layer}.safetensors")  # fmt: skip
    config = {"model_kind": "transcoder_set", **hooks,
              "transcoders": [f"params_{i}.safetensors" for i in range(2)]}  # fmt: skip
    (tmp_path / "gs2" / "config.yaml").write_text(yaml.safe_dump(config))
    gs2 = load_transcoders(tmp_path / "gs2")
    model = tiny("gemma3")
    same_graph(attribute(model, PROMPT, gs2, GraphOptions(floor=0.0)).prune(),
               attribute(model, PROMPT, skip, GraphOptions(floor=0.0)).prune())  # fmt: skip
    config["feature_output_hook"] = "mlp.hook_out"
    (tmp_path / "gs2" / "config.yaml").write_text(yaml.safe_dump(config))
    inner = load_transcoders(tmp_path / "gs2")
    assert inner.writes == "mlp_module_out"
    saved = save_transcoders(inner, tmp_path / "again")
    assert yaml.safe_load(saved.read_text())["feature_output_hook"] == "mlp.hook_out"


def multimodal_gemma3() -> tuple[torch.nn.Module, torch.nn.Module]:
    """(a tiny Gemma3ForConditionalGeneration: a SigLIP vision tower beside tiny("gemma3")'s
    language model, its norm weights random; a Gemma3ForCausalLM holding the same language-model
    weights), float64."""
    text = transformers.Gemma3TextConfig(
        num_hidden_layers=2, sliding_window=3, query_pre_attn_scalar=8,
        layer_types=["sliding_attention", "full_attention"], **COMMON,
    )  # fmt: skip
    vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=2, num_attention_heads=2,
                                             image_size=28, patch_size=14)  # fmt: skip
    config = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                       mm_tokens_per_image=4, image_token_index=99,
                                       boi_token_index=97, eoi_token_index=98)  # fmt: skip
    config._attn_implementation = "eager"
    with torch.random.fork_rng():
        torch.manual_seed(0)
        both = transformers.AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            for name, p in both.named_parameters():
                if "norm" in name:
                    p.copy_(0.3 * torch.randn_like(p))
        text_only = transformers.Gemma3ForCausalLM(text).eval()
    text_only.config._attn_implementation = "eager"
    prefix = "model.language_model."
    text_only.load_state_dict({k.replace(prefix, "model."): v for k, v in both.state_dict().items()
                               if k.startswith((prefix, "lm_head."))})  # fmt: skip
    return both.double(), text_only.double()


def test_a_multimodal_gemma3_gives_its_language_models_graph():
    """Gemma-3 4B and up are Gemma3ForConditionalGeneration (Gemma Scope 2's -it models among
    them): the graph of a token prompt is the graph of the same language model alone, and a
    forward that runs the vision tower is refused by name."""
    from probe.errors import ModelError

    both, text_only = multimodal_gemma3()
    assert type(both).__name__ == "Gemma3ForConditionalGeneration"
    ts = random_transcoders(32, 2, reads="mlp_in", activation="relu", expansion=2,
                            dtype=torch.float64)  # fmt: skip
    options = GraphOptions(batch_size=64, floor=0.0)
    graph, alone = attribute(both, PROMPT, ts, options), attribute(text_only, PROMPT, ts, options)
    assert graph.n_features == alone.n_features > 40
    torch.testing.assert_close(
        graph.adjacency.to_dense(), alone.adjacency.to_dense(), rtol=0, atol=0
    )
    torch.testing.assert_close(graph.logit_probs, alone.logit_probs, rtol=0, atol=0)
    ids = torch.tensor([[2, 97, 99, 99, 99, 99, 98, 7]])
    refused = pytest.raises(ModelError, match="ran its model.vision_tower .* token prompts only")
    with refused, torch.no_grad(), LocalReplacement(both, ts, mode="record"):
        both(ids, pixel_values=torch.randn(1, 3, 28, 28, dtype=torch.float64))


def test_an_instruction_tuned_gemma3_leaves_the_chat_templates_four_positions_out():
    """circuit-tracer's rule for a model named gemma-3...-it (Gemma Scope 2's -it sets): the
    features and errors of <bos><start_of_turn>user\\n are no nodes; every other node and edge
    is the graph's with position 0 alone left out; a prompt without the template is refused."""
    from probe.errors import ConfigError

    config = transformers.Gemma3TextConfig(
        num_hidden_layers=2, sliding_window=3, query_pre_attn_scalar=8,
        layer_types=["sliding_attention", "full_attention"], **{**COMMON, "vocab_size": 2400},
    )  # fmt: skip
    config._attn_implementation = "eager"
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).eval().double()
    ts = random_transcoders(32, 2, reads="mlp_in", activation="relu", expansion=2,
                            dtype=torch.float64)  # fmt: skip
    prompt = torch.tensor([2, 105, 2364, 107, 7, 12, 9, 20, 5, 14])
    options = GraphOptions(batch_size=64, floor=0.0)
    model.config._name_or_path = "google/gemma-3-1b-pt"
    plain = attribute(model, prompt, ts, options)
    model.config._name_or_path = "google/gemma-3-1b-it"
    it = attribute(model, prompt, ts, options)
    kept = plain.features[:, 1] >= 4
    assert (plain.features[:, 1] < 4).any() and not (it.features[:, 1] < 4).any()
    assert torch.equal(it.features, plain.features[kept])
    # it's nodes among plain's: the kept features, then errors, tokens and logits as they are
    rest = torch.arange(plain.n_features, plain.n_nodes)
    index = torch.cat([torch.nonzero(kept).squeeze(1), rest])
    a, b = it.adjacency.to_dense(), plain.adjacency.to_dense()[index][:, index]
    errors = it.offsets["error"] + torch.arange(it.n_errors)
    zeroed = errors[(torch.arange(it.n_errors) % it.n_pos) < 4]  # their errors' columns: 0 in it
    assert float(b[:, zeroed].abs().max()) > 0 and float(a[:, zeroed].abs().max()) == 0
    live = torch.ones(it.n_nodes, dtype=torch.bool)
    live[zeroed] = False
    torch.testing.assert_close(a[:, live], b[:, live], rtol=1e-6, atol=1e-9)
    with pytest.raises(ConfigError, match=r"instruction-tuned Gemma-3.*starts \[2, 7, 12, 9\]"):
        attribute(model, PROMPT, ts, options)
    kept_all = attribute(model, PROMPT, ts, GraphOptions(batch_size=64, floor=0.0, zero_bos=False))
    assert (kept_all.features[:, 1] == 0).any()  # zero_bos=false: every position's features
