"""Where attention comes from (probe.graphs.qk_attribution): each decomposed pair's cells sum to
the pre-softmax score the model's eager attention turned into its pattern (GPT-2; Llama with
rotary and grouped-query attention, through per-layer transcoders and a cross-layer transcoder;
Qwen3 with q/k norms; Gemma-2 with its softcap and sandwich norms), every cell equals a decomposition written here in plain torch from the weights and the
residuals forward hooks captured, the viewer JSON carries them as Neuronpedia's
qk_tracing_results and still validates (from a graph saved and loaded back too: the table
kept exactly), and bad options are refused by name."""

from __future__ import annotations

import dataclasses
import json

import pandas as pd
import pytest
import torch
import transformers

import probe
from probe.errors import ConfigError
from probe.graphs.attribution import GraphOptions
from probe.graphs.graph_json import graph_model, node_id
from probe.graphs.qk_attribution import ALL, REST, qk_table
from probe.testing.peers import circuit_tracer_source
from probe.testing.random_transcoders import random_cross_layer, random_transcoders
from probe.testing.tiny_lms import make_tiny
from tests.graphs.test_graph_families import tiny
from tests.graphs.test_graph_json import NEURONPEDIA_GRAPH

PROMPT = torch.tensor([2, 7, 12, 9, 20, 5, 14])
KEYS = 3
PART_KINDS = ("token", "embed", "attn", "feature", "error", "mlp")  # (a part's name's first word)


def tiny_gpt2(tmp_path_factory) -> torch.nn.Module:
    """A tiny GPT-2 in float64, eager attention, every bias random (the bias part not zero)."""
    folder = make_tiny("gpt2", tmp_path_factory.mktemp("gpt2"))
    model = transformers.GPT2LMHeadModel.from_pretrained(folder, attn_implementation="eager")
    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(1)
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
    return model.eval().double()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    built = {}

    def get(family: str):
        if family not in built:
            built[family] = tiny_gpt2(tmp_path_factory) if family == "gpt2" else tiny(family)
        return built[family]

    return get


@pytest.fixture(scope="module")
def graphs(models):
    """family -> (its model, a pruned graph with its whole QK table: 16 of the active features
    attributed, so some feature parts are no nodes; the transcoders), made once."""
    built = {}

    def get(family: str):
        if family not in built:
            model = models(family.removesuffix("+clt"))
            ts = (
                random_cross_layer(32, 2, expansion=1, dtype=torch.float64)
                if family.endswith("+clt")
                else random_transcoders(32, 2, expansion=1, dtype=torch.float64)
            )
            graph = probe.attribution_graph(
                model, PROMPT, ts, qk=KEYS, qk_rows=None, max_feature_nodes=16
            )
            built[family] = model, graph, ts
        return built[family]

    return get


def graph_of(graphs, family, qk_rows=None):
    """(model, graph, transcoders) of `family`, the graph's QK table kept to `qk_rows` a pair."""
    model, graph, ts = graphs(family)
    if qk_rows is not None:
        graph = dataclasses.replace(graph, qk=qk_table(model, graph, ts, keys=KEYS, rows=qk_rows))
    return model, graph, ts


def cells_of(table):
    return table[(table["query_part"] != ALL) & (table["key_part"] != ALL)]


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen3", "gemma2", "llama+clt"])
def test_each_pairs_parts_sum_to_the_score_its_eager_pattern_came_from(graphs, family):
    model, graph, _ = graph_of(
        graphs, family, qk_rows=4
    )  # (4 rows kept a pair, the rest summed in one)
    table = graph.qk
    assert len(table) and set(table["query_pos"]) >= {graph.n_pos - 1}
    with torch.no_grad():
        patterns = model(PROMPT[None], output_attentions=True).attentions
    cap = getattr(model.config, "attn_logit_softcapping", None)
    pairs = cells_of(table).groupby(["layer", "head", "query_pos", "key_pos"])
    sums = pairs["contribution"].sum()
    scores = pairs["score"].first()
    assert (pairs.size() <= 4 + 1).all() and (pairs.size() == 4 + 1).any()  # 4 and the rest
    torch.testing.assert_close(torch.tensor(sums.values), torch.tensor(scores.values),
                               rtol=1e-5, atol=0)  # fmt: skip
    # the marginals on each side sum to the score too
    for side in ("query_part", "key_part"):
        marginal = table[table[side] == ALL].groupby(["layer", "head", "query_pos", "key_pos"])
        torch.testing.assert_close(torch.tensor(marginal["contribution"].sum().values),
                                   torch.tensor(scores.values), rtol=1e-5, atol=0)  # fmt: skip
    # the pattern the model produced: softmax over the keys of softcap(score) + mask, so two
    # keys' scores differ by the log of their probabilities' ratio (the families' eager
    # softmax runs in float32: 1e-6)
    by_query = scores.groupby(level=["layer", "head", "query_pos"])
    checked = 0
    for (layer, head, q), group in by_query:
        keys = group.index.get_level_values("key_pos").tolist()
        s = torch.tensor(group.values)
        if cap:
            s = cap * torch.tanh(s / cap)
        p = patterns[layer][0, head, q, keys]
        got = table[(table["layer"] == layer) & (table["head"] == head) & (table["query_pos"] == q)]
        assert got.groupby("key_pos")["pattern"].first()[keys].tolist() == pytest.approx(p.tolist(), rel=1e-9)  # fmt: skip
        torch.testing.assert_close(s - s[0], p.log() - p[0].log(), rtol=0, atol=1e-6)
        checked += len(keys) - 1
    assert checked > 0


def residual_parts(model, family, ts, layer):
    """The parts of the residual stream at `layer`'s attention input, per position, written
    here: captured by forward hooks (embeddings, each block's attention output, MLP input and
    output), the transcoders' features and errors in plain torch (ReLU, position 0 no node)."""
    blocks = model.transformer.h if family == "gpt2" else model.model.layers
    seen = {}

    def keep(name, arg=False):
        def hook(module, args, out):
            seen[name] = (args[0] if arg else out[0] if isinstance(out, tuple) else out)[0]

        return hook

    handles = [model.get_input_embeddings().register_forward_hook(keep("embed"))]
    for i, block in enumerate(blocks):
        attn = block.attn if family == "gpt2" else block.self_attn
        norm = block.ln_1 if family == "gpt2" else block.input_layernorm
        handles += [attn.register_forward_hook(keep(f"attn{i}")),
                    norm.register_forward_hook(keep(f"resid{i}", arg=True)),
                    block.mlp.register_forward_hook(keep(f"mlp{i}")),
                    block.mlp.register_forward_hook(keep(f"mlp_in{i}", arg=True))]  # fmt: skip
    try:
        with torch.no_grad():
            model(PROMPT[None])
    finally:
        for h in handles:
            h.remove()
    n = PROMPT.shape[0]
    parts = [{f"token@{p}": seen["embed"][p]} for p in range(n)]
    for p in range(n):
        if family == "gpt2":  # the position embedding
            parts[p][f"embed rest@{p}"] = seen["resid0"][p] - seen["embed"][p]
    for i in range(layer):
        t = ts[i]
        acts = torch.relu(seen[f"mlp_in{i}"] @ t.W_enc + t.b_enc)
        acts[0] = 0
        error = seen[f"mlp{i}"] - (acts @ t.W_dec + t.b_dec)
        error[0] = 0
        for p in range(n):
            parts[p][f"attn {i}@{p}"] = seen[f"attn{i}"][p]
            for f in acts[p].nonzero().flatten().tolist():
                parts[p][f"feature {i}:{f}@{p}"] = acts[p, f] * t.W_dec[f]
            if p:
                parts[p][f"error {i}@{p}"] = error[p]
            parts[p][f"mlp {i} rest@{p}"] = seen[f"mlp{i}"][p] - acts[p] @ t.W_dec - error[p]
    return parts, seen[f"resid{layer}"]


def hand_qk(model, family, parts, resid, layer):
    """(query-side vectors, key-side vectors, scaling) per position: {part name: (heads,
    d_head)}, each part through the frozen norm, the projections and the rotary embedding, the
    norm's and projections' biases as `bias`."""
    cfg = model.config
    if family == "gpt2":
        block = model.transformer.h[layer]
        ln, w, b = block.ln_1, block.attn.c_attn.weight, block.attn.c_attn.bias
        d, heads = cfg.n_embd, cfg.n_head
        hd = d // heads
        centre = resid - resid.mean(-1, keepdim=True)
        scale = (centre.pow(2).mean(-1, keepdim=True) + ln.eps).rsqrt()

        def project(v, p, which):
            y = ln.weight * (v - v.mean()) * scale[p]
            return (y @ w[:, which * d : (which + 1) * d]).view(heads, hd)

        def bias(which):
            return (ln.bias @ w[:, which * d : (which + 1) * d] + b[which * d : (which + 1) * d]).view(heads, hd)  # fmt: skip

        q = [{k: project(v, p, 0) for k, v in here.items()} | {"bias": bias(0)} for p, here in enumerate(parts)]  # fmt: skip
        k = [{k: project(v, p, 1) for k, v in here.items()} | {"bias": bias(1)} for p, here in enumerate(parts)]  # fmt: skip
        return q, k, hd**-0.5, 1
    attn = model.model.layers[layer].self_attn
    norm = model.model.layers[layer].input_layernorm
    hd, heads, kv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    scale = (resid.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon).rsqrt()
    theta = cfg.rope_parameters["rope_theta"]
    # the angles in float32, as transformers computes them for every dtype
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)

    def rotary(x, p):  # (h, hd) at position p
        angle = torch.cat([p * inv, p * inv])
        cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
        half = torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], -1)
        return x * cos + half * sin

    def project(v, p, weight, h):
        y = norm.weight * v * scale[p]
        return rotary((y @ weight.T).view(h, hd), p)

    q = [{k: project(v, p, attn.q_proj.weight, heads) for k, v in here.items()}
         | {"bias": torch.zeros(heads, hd, dtype=torch.float64)} for p, here in enumerate(parts)]  # fmt: skip
    k = [{k: project(v, p, attn.k_proj.weight, kv) for k, v in here.items()}
         | {"bias": torch.zeros(kv, hd, dtype=torch.float64)} for p, here in enumerate(parts)]  # fmt: skip
    return q, k, hd**-0.5, heads // kv


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_every_cell_equals_a_decomposition_written_by_hand(graphs, family):
    model, graph, ts = graph_of(graphs, family)
    table = graph.qk
    cells = cells_of(table)
    assert (cells["query_part"] != REST).all()  # (qk_rows=None: every cell)
    nodes = graph.nodes()
    checked = 0
    for layer in range(graph.n_layers):
        parts, resid = residual_parts(model, family, ts, layer)
        # the parts sum to the residual the norm read
        total = torch.stack([sum(here.values()) for here in parts])
        torch.testing.assert_close(total, resid, rtol=1e-12, atol=1e-12)
        q_side, k_side, scaling, group = hand_qk(model, family, parts, resid, layer)
        rows = cells[cells["layer"] == layer]
        assert len(rows)
        for r in rows.itertuples():
            qv = q_side[r.query_pos][r.query_part][r.head]
            kv = k_side[r.key_pos][r.key_part][r.head // group]
            want = float((qv @ kv).detach()) * scaling
            assert r.contribution == pytest.approx(want, rel=1e-9, abs=1e-12)
            checked += 1
        # every part of each position is in the table: as many cells as parts x parts
        for (q, k, _), pair in rows.groupby(["query_pos", "key_pos", "head"]):
            assert len(pair) == (len(parts[q]) + 1) * (len(parts[k]) + 1)
    assert checked > 100
    # a part that is a node names it: its kind, layer and position in the node table
    for side in ("query", "key"):
        named = cells[cells[f"{side}_node"] >= 0]
        assert len(named)
        for r in named.drop_duplicates(f"{side}_node").itertuples():
            node = nodes.loc[getattr(r, f"{side}_node")]
            part = getattr(r, f"{side}_part")
            assert part.startswith(node["kind"]) and part.endswith(f"@{node['pos']}")
            if node["kind"] == "feature":
                assert part == f"feature {node['layer']}:{node['feature']}@{node['pos']}"


def test_the_viewer_json_carries_qk_tracing_results_and_validates(graphs):
    jsonschema = pytest.importorskip("jsonschema")
    _, graph, _ = graph_of(graphs, "llama", qk_rows=5)
    data = json.loads(json.dumps(graph_model(graph, "qk", node_threshold=0.8)))
    jsonschema.validate(data, NEURONPEDIA_GRAPH, cls=jsonschema.Draft7Validator)
    if circuit_tracer_source() is not None:  # and circuit-tracer's viewer reads it
        pytest.importorskip("pydantic")
        models = pytest.importorskip("circuit_tracer.frontend.graph_models")
        models.Model.model_validate(data)
    traced = [n for n in data["nodes"] if "qk_tracing_results" in n]
    pairs = graph.qk.groupby(["layer", "head", "query_pos", "key_pos"])
    assert len(traced) == pairs.ngroups
    ids = {node_id(graph, i) for i in range(graph.n_nodes)}  # (pruned ones too)
    for node in traced:
        layer, rest = node["node_id"][1:].split(".")
        head, key, query = (int(v) for v in rest.split("_"))
        rows = pairs.get_group((int(layer), head, query, key))
        results = node["qk_tracing_results"]
        cells = rows[(rows["query_part"] != ALL) & (rows["key_part"] != ALL) & (rows["query_part"] != REST)]  # fmt: skip
        assert [c for _, _, c in results["pair_wise_contributors"]] == cells[
            "contribution"
        ].tolist()
        q_side = rows[(rows["key_part"] == ALL) & (rows["query_part"] != REST)]
        k_side = rows[(rows["query_part"] == ALL) & (rows["key_part"] != REST)]
        assert [c for _, c in results["top_q_marginal_contributors"]] == q_side[
            "contribution"
        ].tolist()
        assert [c for _, c in results["top_k_marginal_contributors"]] == k_side[
            "contribution"
        ].tolist()
        assert 0 < len(q_side) <= 5 and 0 < len(k_side) <= 5
        for a, b, _ in results["pair_wise_contributors"]:  # a node's id, else a part's name
            for got in (a, b):
                assert got in ids or got == "bias" or got.split()[0] in PART_KINDS


def test_a_saved_graph_loads_back_with_its_qk_table_and_the_same_viewer_json(graphs, tmp_path):
    """save / load_graph keep the QK table as qk_table computed it (every value and dtype), so
    the Neuronpedia JSON of the loaded graph is the original's, and it validates."""
    jsonschema = pytest.importorskip("jsonschema")
    from probe.graphs.graph_files import load_graph, save_graph

    _, graph, _ = graph_of(graphs, "llama")
    assert graph.qk is not None and len(graph.qk) > 100
    back = load_graph(graph.save(tmp_path / "g.h5"))
    pd.testing.assert_frame_equal(back.qk, graph.qk, check_exact=True)
    want = json.loads(json.dumps(graph_model(graph, "qk", node_threshold=0.8)))
    got = json.loads(json.dumps(graph_model(back, "qk", node_threshold=0.8)))
    assert any("qk_tracing_results" in n for n in got["nodes"])
    assert got == want
    jsonschema.validate(got, NEURONPEDIA_GRAPH, cls=jsonschema.Draft7Validator)
    # as another prompt of a file; a graph without a table loads back without one
    pd.testing.assert_frame_equal(load_graph(save_graph(graph, tmp_path / "p.h5", prompt=7), 7).qk,
                                  graph.qk, check_exact=True)  # fmt: skip
    plain = dataclasses.replace(graph, qk=None)
    assert load_graph(plain.save(tmp_path / "plain.h5")).qk is None


@pytest.mark.parametrize(
    "options, words",
    [({"qk": -1}, "graph.qk=-1"), ({"qk": 1.5}, "graph.qk=1.5"), ({"qk": 2, "qk_rows": 0}, "graph.qk_rows=0")],
)  # fmt: skip
def test_bad_qk_options_are_refused_by_name(options, words):
    with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
        GraphOptions(**options)


def test_without_qk_a_graph_holds_no_qk_table(models):
    ts = random_transcoders(32, 2, expansion=1, dtype=torch.float64)
    graph = probe.attribution_graph(models("gpt2"), PROMPT, ts, max_feature_nodes=4)
    assert graph.qk is None
    assert not any("qk_tracing_results" in n for n in graph_model(graph, "plain")["nodes"])
