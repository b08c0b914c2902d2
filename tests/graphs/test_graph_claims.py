"""The graph's claim in the live model (probe.graphs.graph_claims): zeroing the top features by
their contribution to the answer. The live change equals a plain forward edited by hand with
`register_forward_hook`; in the graph's frozen linear model the change equals the total
prediction (the model is linear: only the adjacency's float32 rounding separates them); the
direct prediction is minus the sum of the adjacency's entries read from the edge table, the
total contributions a dense linear solve; bad arguments are refused by name. Through a
cross-layer transcoder, a zeroed feature loses its writes into its own layer and every later
one (a hand edit of each), and the frozen and direct predictions hold as for per-layer sets.
With the MLPs live, freezing attention patterns and norm scales together, the patterns alone or
the norm scales alone equals a plain forward whose queries and keys, or norm scales, are the
clean forward's (forward hooks), on models whose patterns move."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from probe.errors import ConfigError
from probe.graphs.attribution import GraphOptions, attribute
from probe.graphs.feature_zeroing import frozen_logits, live_logits
from probe.graphs.graph_claims import ORDERS, answer_contributions, graph_claims, total_change
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


def answer_with(model, handles, graph) -> float:
    """The answer (logit minus mean logit of the graph's first logit token) of a plain forward
    of PROMPT with the forward hooks `handles` registered; they are removed after it."""
    try:
        with torch.no_grad():
            logits = model(PROMPT[None]).logits[0, -1]
    finally:
        for h in handles:
            h.remove()
    token = int(graph.logit_tokens[0])
    return float(logits[token] - logits.mean())


def hand_answer(model, kind, tset, graph, places, extra=()) -> float:
    """The answer (logit minus mean logit) of a plain forward whose block MLP outputs lose
    activation x decoder row of each feature at `places`, the activation read from what the
    transcoder reads in this forward (the MLP's input, or the input of the norm before it);
    `extra` hooks (already registered) are removed with these."""
    blocks = model.transformer.h if kind == "gpt2" else model.model.layers
    handles, seen = list(extra), {}
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
    return answer_with(model, handles, graph)


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
    # a graph whose logits are not the model's on its tokens (another prompt's, tokens swapped)
    other = attribute(model, PROMPT.flip(0), tset, GraphOptions(floor=0.0))
    other.tokens = PROMPT
    with pytest.raises(ConfigError, match="pass the model and transcoders the graph was"):
        graph_claims(model, other, tset)


@pytest.fixture(scope="module")
def clt_setup(setups):
    """The tiny Llama of `setups` with a random JumpReLU cross-layer transcoder (a skip matrix):
    its graph and its claims."""
    model = setups["llama"][0]
    clt = random_cross_layer(activation="jumprelu", skip=True, expansion=1, dtype=torch.float64)
    graph = attribute(model, PROMPT, clt, GraphOptions(batch_size=128, floor=0.0))
    return model, clt, graph, graph_claims(model, graph, clt, top=(1, 5, 10))


def hand_clt_answer(model, clt, graph, places, every_layer: bool = True) -> float:
    """The answer of a plain forward whose block MLP outputs lose, for each feature at `places`
    (layer l, pos, feature), activation x its decoder row into layer l' at every l' >= l (with
    `every_layer` False: at l alone), the activation jumprelu(x @ W_enc[l] + b_enc[l]) of the
    input of layer l's norm before the MLP in this forward."""
    blocks = model.model.layers
    seen, handles = {}, []
    for layer, block in enumerate(blocks):

        def keep(m, args, layer=layer):
            seen[layer] = args[0][0]

        def edit(m, args, out, target=layer):
            out = out.clone()
            for layer, pos, feature in places:
                if layer > target or (not every_layer and layer != target):
                    continue
                pre = seen[layer][pos] @ clt.W_enc[layer][:, feature] + clt.b_enc[layer, feature]
                act = pre * (pre > clt.threshold[layer, feature])
                out[0, pos] -= act * clt.W_dec[layer][feature, target - layer]
            return out

        handles += [block.post_attention_layernorm.register_forward_pre_hook(keep),
                    block.mlp.register_forward_hook(edit)]  # fmt: skip
    return answer_with(model, handles, graph)


def test_a_cross_layer_transcoders_zeroed_features_lose_their_writes_at_every_later_layer(
    clt_setup,
):
    """The live change equals a hand forward-hook edit removing each zeroed feature's decoder
    writes at its layer and every later one (not at its layer alone); a single feature's direct
    prediction is minus its edge to the answer; the frozen linear model's change is the total
    prediction, paths through later layers' writes included."""
    model, clt, graph, table = clt_setup
    clean = hand_clt_answer(model, clt, graph, [])
    nodes, edges = graph.nodes(), graph.edges(kept_only=False)
    answer = int(nodes[nodes.kind == "logit"].node.iloc[0])
    earlier = 0  # rows zeroing a feature that writes to a later layer too
    for row in table.itertuples():
        places = [tuple(map(int, p.split("/"))) for p in row.features.split(";")]
        want = hand_clt_answer(model, clt, graph, places) - clean
        assert abs(want) > 1e-3
        assert row.live == pytest.approx(want, abs=1e-6)
        if any(layer < graph.n_layers - 1 for layer, _, _ in places):
            own_layer_only = hand_clt_answer(model, clt, graph, places, every_layer=False) - clean
            assert abs(row.live - own_layer_only) > 1e-3
            earlier += 1
        if row.top == 1:
            ((layer, pos, feature),) = places
            node = int(nodes[(nodes.kind == "feature") & (nodes.layer == layer)
                             & (nodes.pos == pos) & (nodes.feature == feature)].node.iloc[0])  # fmt: skip
            edge = edges[(edges.target == answer) & (edges.source == node)].weight
            assert len(edge) == 1 and row.direct == pytest.approx(-float(edge.iloc[0]), abs=1e-12)
    assert earlier > 0
    scale = float(answer_contributions(graph).total.abs().max())
    assert table.frozen.to_numpy() == pytest.approx(table.total.to_numpy(), rel=1e-5, abs=1e-6 * scale)  # fmt: skip


def hand_contributions(graph) -> dict[str, torch.Tensor]:
    """The direct and total contributions of each feature node, read from the dense adjacency:
    the answer's row, and the solve u = a (I - M)^-1 with M[t, s] = A[t, s] / activation[t]."""
    dense = graph.adjacency.to_dense().double()
    n_f = graph.n_features
    answer = graph.offsets["logit"]
    m = dense[:n_f, :n_f] / graph.activations.double()[:, None]
    a = dense[answer, :n_f]
    total = torch.linalg.solve((torch.eye(n_f, dtype=torch.float64) - m).T, a)
    return {"direct": a, "total": total}


def hand_ranked(values: torch.Tensor, order: str) -> list[int]:
    """The nodes of the order's sign, sorted by hand: positive above 0 largest first, negative
    below 0 most negative first, absolute not 0 largest magnitude first."""
    keep = {"positive": values > 0, "negative": values < 0, "absolute": values != 0}[order]
    key = {"positive": -values, "negative": values, "absolute": -values.abs()}[order]
    nodes = [n for n in range(len(values)) if keep[n]]
    return sorted(nodes, key=lambda n: (float(key[n]), n))


@pytest.fixture(scope="module")
def ordered(setups):
    """Each setup's claims with the features taken most negative first and by magnitude."""
    return {
        kind: graph_claims(model, graph, tset, top=(1, 5, 10), orders=("negative", "absolute"))
        for kind, (model, tset, graph, _) in setups.items()
    }


@pytest.mark.parametrize("kind", list(CASES))
def test_the_negative_and_absolute_orders_zero_the_features_a_hand_ranking_picks(
    setups, ordered, kind
):
    """Each row's features are the first N of a hand ranking of the dense adjacency's
    contributions; the most negative ones are predicted to raise the answer, and do so in the
    frozen linear model by the total prediction."""
    model, tset, graph, _ = setups[kind]
    table = ordered[kind]
    assert sorted(set(table.order)) == ["absolute", "negative"] and len(table) == 12
    hand = hand_contributions(graph)
    node_of = {tuple(p): n for n, p in enumerate(graph.features.tolist())}
    for row in table.itertuples():
        chosen = [node_of[tuple(map(int, p.split("/")))] for p in row.features.split(";")]
        assert chosen == hand_ranked(hand[row.ranking], row.order)[: row.top]
        if row.order == "negative":
            assert (hand[row.ranking][chosen] < 0).all()
            if row.ranking == "direct" or row.top == 1:
                assert row.direct > 0 if row.ranking == "direct" else row.total > 0
    scale = float(hand["total"].abs().max())
    assert table.frozen.to_numpy() == pytest.approx(table.total.to_numpy(), rel=1e-5, abs=1e-6 * scale)  # fmt: skip


@pytest.mark.parametrize("kind", list(CASES))
def test_in_the_negative_and_absolute_orders_the_live_change_is_a_hand_edits(setups, ordered, kind):
    model, tset, graph, _ = setups[kind]
    clean = hand_answer(model, kind, tset, graph, [])
    for row in ordered[kind].itertuples():
        places = [tuple(map(int, p.split("/"))) for p in row.features.split(";")]
        want = hand_answer(model, kind, tset, graph, places) - clean
        assert abs(want) > 1e-4
        assert row.live == pytest.approx(want, abs=1e-6)


def test_a_cross_layer_transcoders_most_negative_features_lose_every_write(clt_setup):
    """Through a CLT, the most negative features by direct edge: the live change a hand edit of
    every layer from each one's own, the frozen change the total prediction."""
    model, clt, graph, _ = clt_setup
    table = graph_claims(model, graph, clt, top=(1, 5), rankings="direct", orders="negative")
    hand = hand_contributions(graph)["direct"]
    node_of = {tuple(p): n for n, p in enumerate(graph.features.tolist())}
    clean = hand_clt_answer(model, clt, graph, [])
    for row in table.itertuples():
        places = [tuple(map(int, p.split("/"))) for p in row.features.split(";")]
        assert [node_of[p] for p in places] == hand_ranked(hand, "negative")[: row.top]
        assert row.direct == pytest.approx(-float(hand[[node_of[p] for p in places]].sum()))
        assert row.live == pytest.approx(
            hand_clt_answer(model, clt, graph, places) - clean, abs=1e-6
        )
    scale = float(answer_contributions(graph).total.abs().max())
    assert table.frozen.to_numpy() == pytest.approx(table.total.to_numpy(), rel=1e-5, abs=1e-6 * scale)  # fmt: skip


def test_an_unknown_order_is_refused_by_name(setups):
    model, tset, graph, _ = setups["gpt2"]
    with pytest.raises(ConfigError, match="order 'smallest' is unknown; choose from positive"):
        graph_claims(model, graph, tset, orders=("negative", "smallest"))
    with pytest.raises(ConfigError, match="no order given; choose from positive"):
        graph_claims(model, graph, tset, orders=())


def test_an_order_past_its_signs_count_zeroes_every_feature_of_that_sign(setups):
    """N beyond the graph's features: each order zeroes exactly those of its sign in the dense
    adjacency's answer row, all of them, the live change still a hand edit's."""
    model, tset, graph, _ = setups["gpt2"]
    many = graph.n_features + 5
    table = graph_claims(model, graph, tset, top=many, rankings="direct",
                         orders=("positive", "negative"), frozen=False)  # fmt: skip
    direct = hand_contributions(graph)["direct"]
    node_of = {tuple(p): n for n, p in enumerate(graph.features.tolist())}
    clean = hand_answer(model, "gpt2", tset, graph, [])
    for row, sign in zip(table.itertuples(), (1, -1), strict=True):
        places = [tuple(map(int, p.split("/"))) for p in row.features.split(";")]
        assert (
            sorted(node_of[p] for p in places)
            == torch.nonzero(sign * direct > 0).flatten().tolist()
        )
        assert row.zeroed == len(places) < graph.n_features and row.top == many
        assert row.direct == pytest.approx(-float(direct[sign * direct > 0].sum()), rel=1e-9)
        assert row.live == pytest.approx(
            hand_answer(model, "gpt2", tset, graph, places) - clean, abs=1e-6
        )


def norms_of(model, kind) -> list:
    """Every norm whose scale the graph freezes: each block's two and the final one."""
    if kind == "gpt2":
        blocks = model.transformer.h
        return [m for b in blocks for m in (b.ln_1, b.ln_2)] + [model.transformer.ln_f]
    blocks = model.model.layers
    return [m for b in blocks for m in (b.input_layernorm, b.post_attention_layernorm)] + [
        model.model.norm
    ]


def query_key_modules(model, kind) -> list:
    """The modules whose outputs hold each block's queries and keys: GPT-2's c_attn (queries,
    keys and values side by side), Llama's q_proj and k_proj."""
    if kind == "gpt2":
        return [b.attn.c_attn for b in model.transformer.h]
    return [m for b in model.model.layers for m in (b.self_attn.q_proj, b.self_attn.k_proj)]


def clean_pieces(model, kind) -> dict:
    """The clean forward's queries and keys (each module of query_key_modules' output) and each
    norm's scale, 1 / sqrt(var(x) + eps) (LayerNorm) or 1 / sqrt(mean(x^2) + eps) (RMSNorm) of
    its input, computed here in float64 from the input."""
    seen, handles = {}, []
    for m in query_key_modules(model, kind):
        handles.append(m.register_forward_hook(lambda m, a, out: seen.update({m: out.clone()})))
    for m in norms_of(model, kind):

        def scale(m, args):
            x = args[0]
            if kind == "gpt2":
                var = (x - x.mean(-1, keepdim=True)).pow(2).mean(-1, keepdim=True)
                seen[m] = 1 / torch.sqrt(var + m.eps)
            else:
                seen[m] = 1 / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + m.variance_epsilon)

        handles.append(m.register_forward_pre_hook(scale))
    try:
        with torch.no_grad():
            model(PROMPT[None])
    finally:
        for h in handles:
            h.remove()
    return seen


def freezing_hooks(model, kind, clean, freeze) -> list:
    """Forward hooks holding `freeze` ("patterns", "norms") at the clean forward's: the queries
    and keys replaced by the clean ones (so every pattern is the clean one; GPT-2's values, the
    last third of c_attn, stay live), each norm's output recomputed from its input with the
    clean scale."""
    handles = []
    if "patterns" in freeze:
        for m in query_key_modules(model, kind):

            def qk(m, args, out):
                out = out.clone()
                width = out.shape[-1] * 2 // 3 if kind == "gpt2" else out.shape[-1]
                out[..., :width] = clean[m][..., :width]
                return out

            handles.append(m.register_forward_hook(qk))
    if "norms" in freeze:
        for m in norms_of(model, kind):

            def norm(m, args, out):
                x = args[0]
                if kind == "gpt2":
                    return (x - x.mean(-1, keepdim=True)) * clean[m] * m.weight + m.bias
                return x * clean[m] * m.weight

            handles.append(m.register_forward_hook(norm))
    return handles


FREEZES = {"frozen_attention": ("patterns", "norms"), "frozen_patterns": ("patterns",),
           "frozen_norms": ("norms",)}  # fmt: skip
SHARPEN = 15.0  # the queries' and keys' scale in `sharp` (the scores' 225)


@pytest.fixture(scope="module")
def sharp(setups):
    """Each setup's model with its queries and keys scaled by SHARPEN (random weights make
    near-uniform patterns that a zeroing hardly moves), its graph and its claims in every order."""
    out = {}
    for kind, (model, tset, _, _) in setups.items():
        model = copy.deepcopy(model)
        with torch.no_grad():
            if kind == "gpt2":
                for block in model.transformer.h:
                    width = block.attn.c_attn.weight.shape[0]
                    block.attn.c_attn.weight[:, : 2 * width] *= SHARPEN
                    block.attn.c_attn.bias[: 2 * width] *= SHARPEN
            else:
                for block in model.model.layers:
                    block.self_attn.q_proj.weight *= SHARPEN
                    block.self_attn.k_proj.weight *= SHARPEN
        graph = attribute(model, PROMPT, tset, GraphOptions(batch_size=128, floor=0.0))
        table = graph_claims(model, graph, tset, top=(1, 5, 10), orders=ORDERS)
        out[kind] = model, tset, graph, table
    return out


@pytest.mark.parametrize("kind", list(CASES))
def test_freezing_patterns_or_norms_alone_equals_a_hand_forward_hook_edit(sharp, kind):
    """Each of the three columns with the MLPs live (patterns and norms frozen, the patterns
    alone, the norms' scales alone) is the change of a plain forward whose queries and keys (so
    its patterns), or its norms' scales, are the clean forward's, the features zeroed by hand:
    positive, negative and absolute orders. The split is not empty: each freeze alone moves the
    answer by other than the live model and the model with both frozen (by over 1000 times the
    tolerance); the graph's linear model still moves by the total prediction."""
    model, tset, graph, rows = sharp[kind]
    clean = clean_pieces(model, kind)
    for column, freeze in FREEZES.items():
        base = hand_answer(model, kind, tset, graph, [], freezing_hooks(model, kind, clean, freeze))
        for row in rows.itertuples():
            places = [tuple(map(int, p.split("/"))) for p in row.features.split(";")]
            hooks = freezing_hooks(model, kind, clean, freeze)
            want = hand_answer(model, kind, tset, graph, places, hooks) - base
            assert getattr(row, column) == pytest.approx(want, abs=1e-6), (column, row.Index)
    # the graph's own linear model (both frozen, the MLPs linear) still moves by the prediction
    scale = float(answer_contributions(graph).total.abs().max())
    assert rows.frozen.to_numpy() == pytest.approx(rows.total.to_numpy(), rel=1e-5, abs=1e-6 * scale)  # fmt: skip
    for column in ("frozen_patterns", "frozen_norms"):
        assert (rows[column] - rows.live).abs().max() > 1e-3
        assert (rows[column] - rows.frozen_attention).abs().max() > 1e-3
        assert rows[f"{column}_over_total"].to_numpy() == pytest.approx(
            (rows[column] / rows.total).to_numpy()
        )


def test_a_replay_with_nothing_frozen_is_the_live_model(setups):
    """frozen_logits with the MLPs live and neither patterns nor norms frozen replays nothing:
    the live zeroing's logits; an unknown piece to freeze is refused by name."""
    model, tset, graph, table = setups["llama"]
    places = [tuple(p) for p in graph.features.tolist()]
    zeroings = [[tuple(map(int, p.split("/"))) for p in f.split(";")] for f in table.features]
    got = frozen_logits(model, PROMPT, tset, places, zeroings, mlps="live", freeze=())
    for zeroed, logits in zip([[], *zeroings], got, strict=True):
        torch.testing.assert_close(
            logits, live_logits(model, PROMPT, tset, zeroed), rtol=0, atol=1e-10
        )
    with pytest.raises(ConfigError, match=r"frozen=\('pattern',\); give a sequence of patterns"):
        frozen_logits(model, PROMPT, tset, places, zeroings, mlps="live", freeze=("pattern",))
