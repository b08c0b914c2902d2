"""The component graph: its names and counts against hannamw/EAP-IG's formulas and an enumeration
written here, grouped-query and parallel blocks, the graphs of tiny HuggingFace models from their
anatomy, and bad input named."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from probe.circuits.component_graph import ComponentGraph
from probe.circuits.parts import parts_of
from probe.circuits.scores import attribute
from probe.circuits.task import Ablation
from probe.errors import ConfigError
from probe.testing.toy_circuits import Toy, ToyBlock, overrides, pairs
from tests.circuits.test_hand import build


def enumerate_edges(layers, heads, kv, parallel):
    """Every (sender, receiver) name pair by the rule: a receiver reads every node of earlier
    layers; an MLP its own layer's heads too unless parallel; the logits everything."""
    out = []
    for layer in range(layers):
        before = ["input"] + [
            n for j in range(layer) for n in [f"a{j}.h{h}" for h in range(heads)] + [f"m{j}"]
        ]
        receivers = [f"a{layer}.h{h}<q>" for h in range(heads)]
        receivers += [f"a{layer}.h{j}<{c}>" for c in "kv" for j in range(kv)]
        out += [f"{s}->{r}" for r in receivers for s in before]
        own = [] if parallel else [f"a{layer}.h{h}" for h in range(heads)]
        out += [f"{s}->m{layer}" for s in before + own]
    senders = ["input"] + [
        n for j in range(layers) for n in [f"a{j}.h{h}" for h in range(heads)] + [f"m{j}"]
    ]
    return out + [f"{s}->logits" for s in senders]


@pytest.mark.parametrize(
    "shape", [(12, 12, 12, False), (2, 4, 2, False), (3, 2, 2, True), (1, 1, 1, False)]
)
def test_names_and_counts(shape):
    layers, heads, kv, parallel = shape
    graph = ComponentGraph(layers, heads, kv, parallel)
    want = enumerate_edges(*shape)
    assert sorted(graph.edges) == sorted(want) and len(set(graph.edges)) == len(want)
    for i in np.random.default_rng(0).choice(graph.n_edges, 50):
        assert graph.edge_index(graph.edges[i]) == i
        s, r = graph.edges[i].split("->")
        assert graph.senders[graph.edge_sender[i]] == s
        assert graph.receivers[graph.edge_receiver[i]] == r
    m = graph.matrix(np.arange(graph.n_edges, dtype=float))
    assert np.isnan(m).sum() == m.size - graph.n_edges
    if shape == (12, 12, 12, False):  # GPT-2 small, as hannamw/EAP-IG counts it
        assert graph.counts() == {"nodes": 158, "senders": 1 + 12 * 13,
                                  "receivers": 12 * (3 * 12 + 1) + 1, "edges": 32491}  # fmt: skip
    if shape == (2, 4, 2, False):  # a key/value head serves two query heads
        assert graph.query_heads(graph.receiver_index("a1.h1<k>")) == [2, 3]
        assert graph.query_heads(graph.receiver_index("a1.h3<q>")) == [3]


def test_graphs_of_tiny_models_from_their_anatomy():
    got = {f: parts_of(build(f)).graph for f in ("gpt2", "llama", "gpt_neox")}
    assert got["gpt2"] == ComponentGraph(2, 2, 2, False)
    assert got["llama"] == ComponentGraph(2, 4, 2, False)
    assert got["gpt_neox"] == ComponentGraph(2, 4, 4, True)


def test_bad_edge_names_are_named():
    graph = ComponentGraph(2, 2, 2)
    with pytest.raises(ConfigError, match="not an edge name"):
        graph.edge_index("a0.h1 to m1")
    with pytest.raises(ConfigError, match="'a5.h0' is not a sender"):
        graph.edge_index("a5.h0->logits")
    with pytest.raises(ConfigError, match="does not read a1.h0"):
        graph.edge_index("a1.h0->a0.h1<q>")
    with pytest.raises(ConfigError, match="share 3 key/value heads"):
        ComponentGraph(2, 4, 3)


class Stack(nn.Module):
    """A family probe knows nothing of: a stack of blocks and a head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(12, 16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.head = nn.Linear(16, 12)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


class PostNormBlock(ToyBlock):
    def forward(self, x):
        x = self.ln_1(x + self.attn(x))
        return self.ln_2(x + self.mlp(x))


def test_bad_input_is_named():
    with pytest.raises(ConfigError, match=r"does not know its attn_norm.*model.anatomy.attn_norm"):
        parts_of(Stack())
    from transformers import BertConfig, BertForMaskedLM

    bert = BertForMaskedLM(BertConfig(vocab_size=20, hidden_size=16, num_hidden_layers=1,
                                      num_attention_heads=2, intermediate_size=32))  # fmt: skip
    with pytest.raises(ConfigError, match="post-norm"):
        parts_of(bert)
    post = Toy(norms=True)
    post.blocks = nn.ModuleList(PostNormBlock(16, 2, False, True) for _ in range(3))
    with pytest.raises(ConfigError, match="post-norm"):
        attribute(parts_of(post, overrides(2)), [pairs(12)], ["eap"])
    parts = parts_of(Toy(frozen=True), overrides(2))
    with pytest.raises(ConfigError, match="circuit.ablation=mean needs"):
        attribute(parts, [pairs(12)], ["eap"], ablation=Ablation("mean"))
    with pytest.raises(ConfigError, match=rf"patches {parts.graph.n_edges} edges.*max_exact=10"):
        attribute(parts, [pairs(12)], ["exact"], max_exact=10)
    with pytest.raises(ConfigError, match="needs circuit.ablation=counterfactual"):
        attribute(parts, [pairs(12)], ["eap_ig_inputs"], ablation=Ablation("zero"))
    with pytest.raises(ConfigError, match="'acdc' is unknown"):
        attribute(parts, [pairs(12)], ["acdc"])
    with pytest.raises(ConfigError, match="circuit.steps=0"):
        attribute(parts, [pairs(12)], ["eap_ig_activations"], steps=0)
    batch = {k: v for k, v in pairs(12).items() if k != "wrong"}
    with pytest.raises(ConfigError, match="reads the wrong tokens"):
        attribute(parts, [batch], ["eap"])
    assert torch.is_grad_enabled()  # nothing left switched off
