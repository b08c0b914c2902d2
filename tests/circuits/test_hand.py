"""probe's edge scores and patched forwards on tiny GPT-2, Llama (grouped-query attention) and
GPT-NeoX (parallel attention and MLP) models against tests/circuits/hand.py: plain hooks,
autograd, and a copy of the residual stream per receiver."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from probe.circuits.context import BatchContext
from probe.circuits.exact import exact_edges, path_patch
from probe.circuits.parts import parts_of
from probe.circuits.scores import attribute
from probe.circuits.task import Ablation, AnswerMetric, pair_batch
from probe.testing.tiny_lms import tiny_config
from probe.testing.toy_circuits import pairs
from tests.circuits.hand import Hand


def build(family: str):
    """A 2-layer width-32 model of `family` with weights large enough to be far from linear."""
    import transformers

    if family == "gpt_neox":
        config = transformers.GPTNeoXConfig(
            vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, use_parallel_residual=True, rotary_pct=0.5,
        )  # fmt: skip
        cls = transformers.GPTNeoXForCausalLM
    else:
        config = tiny_config(family, 50)
        cls = {"gpt2": transformers.GPT2LMHeadModel, "llama": transformers.LlamaForCausalLM}[family]
    config.initializer_range = 0.3
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return cls(config).eval()


@pytest.fixture(scope="module", params=["gpt2", "llama", "gpt_neox"])
def family(request):
    model = build(request.param)
    return request.param, model, parts_of(model), Hand(model, request.param), pairs(50)


def probe_scores(parts, batch, method, steps=1):
    scores = attribute(parts, [batch], [method], steps=steps)[method]
    return dict(zip(parts.graph.edges, scores.edges, strict=True))


def close(got: dict, want: dict, rtol=1e-4):
    assert set(got) == set(want)
    names = sorted(want)
    a, b = np.array([got[n] for n in names]), np.array([want[n] for n in names])
    scale = np.abs(b).max()
    assert scale > 1e-3  # the scores are not all zero
    np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * scale)


def test_eap_equals_a_hand_computation_per_edge(family):
    name, model, parts, hand, batch = family
    close(probe_scores(parts, batch, "eap"), hand.eap(batch))
    graph = parts.graph
    assert graph.kv_heads == hand.K and graph.parallel == hand.parallel
    if name == "llama":  # two query heads share each key/value head
        assert graph.kv_heads == 2 and graph.heads == 4
        assert "a0.h1->a1.h1<k>" in graph.edges and "a0.h1->a1.h2<k>" not in graph.edges
    if name == "gpt_neox":  # a parallel MLP does not read its own layer's heads
        assert "a0.h0->m0" not in graph.edges and "a0.h0->m1" in graph.edges


def test_eap_ig_equals_eap_at_one_step_and_its_own_riemann_sum(family):
    name, model, parts, hand, batch = family
    eap = probe_scores(parts, batch, "eap")
    for method in ("eap_ig_inputs", "eap_ig_activations"):
        close(probe_scores(parts, batch, method, steps=1), eap, rtol=1e-5)
    if name != "gpt2":
        return
    close(probe_scores(parts, batch, "eap_ig_inputs", steps=4), hand.eap_ig_inputs(batch, 4))
    close(probe_scores(parts, batch, "eap_ig_activations", 3), hand.eap_ig_activations(batch, 3))
    # the Riemann sums converge as the steps grow: 2 and 8 steps against 32
    many = hand.eap_ig_inputs(batch, 32)
    far = [np.abs(np.array(list(probe_scores(parts, batch, "eap_ig_inputs", m).values()))
                  - np.array([many[k] for k in parts.graph.edges])).max() for m in (2, 8)]  # fmt: skip
    assert far[1] < far[0] / 2


def test_exact_edge_and_path_patching_equal_hand_patching(family):
    name, model, parts, hand, batch = family
    metric = AnswerMetric()
    ctx = BatchContext(parts, pair_batch(model, batch, metric), metric, Ablation())
    graph = parts.graph
    chosen = ["input->a0.h1<q>", "input->a1.h0<k>", "a0.h1->a1.h1<v>", "a0.h3->m1",
              "m0->a1.h1<q>", "a1.h1->logits", "input->m0"]  # fmt: skip
    chosen = [e for e in chosen if e in graph.edges]
    got = exact_edges(ctx, np.array([graph.edge_index(e) for e in chosen]), per_forward=3)
    want = [hand.patched(batch, *e.split("->")[0:1], [e.split("->")[1]]) for e in chosen]
    np.testing.assert_allclose(got.double().mean(0).cpu().numpy(), want, rtol=1e-4, atol=1e-6)
    assert np.abs(want).max() > 1e-3
    route = ["a1.h0<v>", "m1", "logits"]
    got = path_patch(ctx, "a0.h1", route).double().mean().item()
    want = hand.patched(batch, "a0.h1", route, frozen=True)
    assert got == pytest.approx(want, rel=1e-4, abs=1e-6) and abs(want) > 1e-4
    # frozen, not patched edge by edge: m1 does not see what a1.h0's patched value changed
    assert abs(hand.patched(batch, "a0.h1", route) - want) > 1e-6


def test_the_metric_reads_circuit_position_and_names_it_when_outside():
    """circuit.position: the logits at that position (negative: from the last real token), with
    or without transformers' logits_to_keep; one outside the tokens named as circuit.position."""
    from probe.errors import ConfigError
    from probe.layout import TokenBatch

    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    tokens = TokenBatch.of(torch.zeros(2, 5, dtype=torch.long), mask)
    for position, want in ((None, [4, 2]), (-2, [3, 1]), (1, [1, 1])):
        metric = AnswerMetric("kl", position)
        rows = logits[torch.arange(2), torch.tensor(want)].double()
        torch.testing.assert_close(metric.logits(logits, tokens), rows)
        kept = torch.tensor(sorted(set(want)))
        torch.testing.assert_close(metric.logits(logits[:, kept], tokens, kept), rows)
    for kept in (None, torch.tensor([4])):
        with pytest.raises(ConfigError, match=r"circuit.position=7 is outside the 5 tokens"):
            AnswerMetric("kl", 7).logits(logits if kept is None else logits[:, kept], tokens, kept)
