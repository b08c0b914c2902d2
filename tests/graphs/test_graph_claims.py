"""The graph's claim in the live model (probe.graphs.graph_claims): zeroing the top features by
their contribution to the answer. The live change equals a plain forward edited by hand with
`register_forward_hook`; in the graph's frozen linear model the change equals the total
prediction (the model is linear: only the adjacency's float32 rounding separates them); the
direct prediction is minus the sum of the adjacency's entries read from the edge table, the
total contributions a dense linear solve; bad arguments are refused by name."""

from __future__ import annotations

import pytest
import torch
import transformers

from probe.errors import ConfigError
from probe.graphs.attribution import GraphOptions, attribute
from probe.graphs.feature_zeroing import frozen_logits
from probe.graphs.graph_claims import answer_contributions, graph_claims, total_change
from probe.testing.random_transcoders import random_cross_layer, random_transcoders
from probe.testing.tiny_lms import TASK_CLASSES, make_tiny

PROMPT = torch.tensor([3, 7, 12, 9, 20, 5, 14])
CASES = {  # kind: (reads, activation, skip)
    "gpt2": ("mlp_in", "relu", False),
    "llama": ("resid_mid", "jumprelu", True),
}


@pytest.fixture(scope="module")
def setups(tmp_path_factory):
    out = {}
    for kind, (reads, activation, skip) in CASES.items():
        folder = make_tiny(kind, tmp_path_factory.mktemp(kind))
        model = getattr(transformers, TASK_CLASSES[kind]).from_pretrained(folder).eval().double()
        tset = random_transcoders(reads=reads, activation=activation, skip=skip, expansion=1,
                                  dtype=torch.float64)  # fmt: skip
        graph = attribute(model, PROMPT, tset, GraphOptions(batch_size=128, floor=0.0))
        out[kind] = model, tset, graph, graph_claims(model, graph, tset, top=(1, 5, 10))
    return out


def hand_answer(model, kind, tset, graph, places) -> float:
    """The answer (logit minus mean logit) of a plain forward whose block MLP outputs lose
    activation x decoder row of each feature at `places`, the activation read from what the
    transcoder reads in this forward (the MLP's input, or the input of the norm before it)."""
    blocks = model.transformer.h if kind == "gpt2" else model.model.layers
    handles, seen = [], {}
    for layer, pos, feature in places:
        block, t = blocks[layer], tset[layer]
        reader = block.mlp if tset.reads == "mlp_in" else block.post_attention_layernorm

        def keep(m, args, layer=layer):
            seen[layer] = args[0]

        def edit(m, args, out, layer=layer, pos=pos, feature=feature, t=t):
            act = t.encode(seen[layer][0, pos])[feature]
            out = out.clone()
            out[0, pos] -= act * t.W_dec[feature]
            return out

        handles += [reader.register_forward_pre_hook(keep), block.mlp.register_forward_hook(edit)]
    try:
        with torch.no_grad():
            logits = model(PROMPT[None]).logits[0, -1]
    finally:
        for h in handles:
            h.remove()
    token = int(graph.logit_tokens[0])
    return float(logits[token] - logits.mean())


@pytest.mark.parametrize("kind", list(CASES))
def test_the_live_change_equals_a_hand_forward_hook_edit(setups, kind):
    model, tset, graph, table = setups[kind]
    clean = hand_answer(model, kind, tset, graph, [])
    for row in table.itertuples():
        places = [tuple(map(int, p.split("/"))) for p in row.features.split(";")]
        assert len(places) == row.zeroed == row.top
        want = hand_answer(model, kind, tset, graph, places) - clean
        assert abs(want) > 1e-3  # the zeroing moves the answer
        assert row.live == pytest.approx(want, abs=1e-6)


@pytest.mark.parametrize("kind", list(CASES))
def test_in_the_frozen_model_a_zeroing_moves_the_answer_by_the_total_prediction(setups, kind):
    model, tset, graph, table = setups[kind]
    contributions = answer_contributions(graph)
    places = [tuple(p) for p in graph.features.tolist()]
    token = int(graph.logit_tokens[0])

    def answer(logits):
        return float(logits[token] - logits.mean())

    strongest = contributions.total.abs().sort_values(ascending=False).index[:6].tolist()
    scale = float(contributions.total.abs().max())
    clean, *zeroed = frozen_logits(model, PROMPT, tset, places, [[places[n]] for n in strongest])
    for node, edited in zip(strongest, zeroed, strict=True):  # minus its total contribution
        moved = answer(edited) - answer(clean)
        predicted = total_change(graph, [node])
        assert predicted == pytest.approx(-contributions.total[node], rel=1e-9, abs=1e-12)
        # the frozen model is linear in the zeroing; the adjacency is float32
        assert moved == pytest.approx(predicted, rel=1e-5, abs=1e-6 * scale)
    # sets of features (a path through two of them counts once)
    assert table.frozen.to_numpy() == pytest.approx(table.total.to_numpy(), rel=1e-5, abs=1e-6 * scale)  # fmt: skip


@pytest.mark.parametrize("kind", list(CASES))
def test_with_the_mlps_live_a_last_layer_feature_moves_the_answer_by_its_edge(setups, kind):
    """Attention and norms frozen, MLPs live: nothing frozen changes the clean forward, and a
    last-layer feature, whose only path to the answer is direct, moves it by minus its edge."""
    model, tset, graph, _ = setups[kind]
    contributions = answer_contributions(graph)
    last = contributions[contributions.layer == graph.n_layers - 1]
    strongest = last.direct.abs().sort_values(ascending=False).index[:4].tolist()
    places = [tuple(p) for p in graph.features.tolist()]
    zeroings = [[places[n]] for n in strongest]
    clean, *zeroed = frozen_logits(model, PROMPT, tset, places, zeroings, mlps="live")
    with torch.no_grad():
        plain = model(PROMPT[None]).logits[0, -1]
    # (Llama's eager pattern, which the replay applies, takes its softmax in float32)
    torch.testing.assert_close(clean, plain, rtol=1e-5, atol=1e-7)
    token = int(graph.logit_tokens[0])
    for node, edited in zip(strongest, zeroed, strict=True):
        moved = float(edited[token] - edited.mean() - clean[token] + clean.mean())
        assert moved == pytest.approx(-contributions.direct[node], rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("kind", list(CASES))
def test_the_predictions_equal_the_adjacency_read_another_way(setups, kind):
    model, tset, graph, table = setups[kind]
    nodes, edges = graph.nodes(), graph.edges(kept_only=False)
    answer = int(nodes[nodes.kind == "logit"].node.iloc[0])
    contributions = answer_contributions(graph)
    for row in table.itertuples():
        places = [tuple(map(int, p.split("/"))) for p in row.features.split(";")]
        chosen = [
            int(nodes[(nodes.kind == "feature") & (nodes.layer == a) & (nodes.pos == b)
                      & (nodes.feature == c)].node.iloc[0])
            for a, b, c in places
        ]  # fmt: skip
        into = edges[(edges.target == answer) & edges.source.isin(chosen)]
        assert row.direct == pytest.approx(-into.weight.sum(), rel=1e-12, abs=1e-12)
        ranked = contributions[row.ranking].sort_values(ascending=False).index[: row.top]
        assert sorted(chosen) == sorted(ranked.tolist())
    # the total contributions: activation x the answer's derivative through the linear model,
    # a dense solve u = a (I - M)^-1 with M[t, s] = A[t, s] / activation[t] over the features
    dense = graph.adjacency.to_dense().double()
    n_f = graph.n_features
    m = dense[:n_f, :n_f] / graph.activations.double()[:, None]
    a = dense[answer, :n_f]
    u = torch.linalg.solve((torch.eye(n_f, dtype=torch.float64) - m).T, a)
    assert contributions.total.to_numpy() == pytest.approx(u.numpy(), rel=1e-9, abs=1e-9)
    assert contributions.direct.to_numpy() == pytest.approx(a.numpy(), abs=0)


def test_bad_arguments_are_refused_by_name(setups):
    model, tset, graph, _ = setups["gpt2"]
    with pytest.raises(ConfigError, match=r"top=0; give the numbers of features"):
        graph_claims(model, graph, tset, top=0)
    with pytest.raises(ConfigError, match=r"top=\(5, -1\)"):
        graph_claims(model, graph, tset, top=(5, -1))
    with pytest.raises(ConfigError, match="ranking 'influence' is unknown; choose from direct"):
        graph_claims(model, graph, tset, rankings=("direct", "influence"))
    with pytest.raises(ConfigError, match=r"target=99; the graph has \d+ logit nodes"):
        graph_claims(model, graph, tset, target=99)
    with pytest.raises(ConfigError, match="per-layer TranscoderSet"):
        graph_claims(model, graph, random_cross_layer(dtype=torch.float64))
    # a graph whose logits are not the model's on its tokens (another prompt's, tokens swapped)
    other = attribute(model, PROMPT.flip(0), tset, GraphOptions(floor=0.0))
    other.tokens = PROMPT
    with pytest.raises(ConfigError, match="pass the model and transcoders the graph was"):
        graph_claims(model, other, tset)
