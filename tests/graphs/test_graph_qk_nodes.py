"""The QK attribution traced to the graph's nodes (qk_sources="nodes", probe.graphs.qk_sources),
by either direction (forward passes carrying tangents, backward passes seeded per component):
on 3-block GPT-2 (every bias random) and Llama (norm weights random) models in float64 with
skip transcoders, the cells and marginals of each pair sum to its pre-softmax score; a node's
query-side or key-side share, and a cell, equal the change a hand perturbation makes in the
frozen replacement model (the node's write taken out in a replay, the residual's move at the
attention's input projected by hand); where no attention lies between a node and the pair
(layer 0, a layer-0 feature at the query position of layer 1) the table is the position one's.
The two directions' tables are equal, cell by cell and marginal by marginal (on Gemma-2,
Gemma-3 and a Llama with a CLT too), the `nodes` table is the cheaper one's, and the passes each
ran are its cost estimate's, with the forward's batch and groups of layers the memory plan's.
A table whose cells are made in chunks of 3 query-side parts (probe.graphs.qk_cells) equals the
one-chunk table row for row, position and node sources, `rows` small and None; every cell past
the free memory is refused by name."""

from __future__ import annotations

import json
import math
import re

import pandas as pd
import pytest
import torch
import transformers

import probe
from probe.errors import ConfigError, ModelError
from probe.graphs import batch_plan, qk_attribution, qk_cells, qk_sources
from probe.graphs.attribution import GraphOptions
from probe.graphs.graph_json import graph_model, node_id
from probe.graphs.qk_attribution import ALL, REST, qk_table
from probe.graphs.qk_cells import PairCells
from probe.graphs.qk_sources import NodeSources
from probe.graphs.replacement import LocalReplacement
from probe.hooks.hookset import HookSet
from probe.testing.random_transcoders import random_cross_layer, random_transcoders
from tests.graphs.test_graph_attribution import error_vectors
from tests.graphs.test_graph_families import COMMON, tiny
from tests.graphs.test_graph_json import NEURONPEDIA_GRAPH
from tests.graphs.test_graph_qk import cells_of, hand_qk

PROMPT = torch.tensor([2, 7, 12, 9, 20, 5, 14])
KEYS = 2
LAYERS = 3
PAIR = ["layer", "head", "query_pos", "key_pos"]
DIRECTIONS = ["forward", "backward"]
ROW = [*PAIR, "query_part", "key_part"]


def three_blocks(family: str) -> torch.nn.Module:
    """A 3-block model in float64, eager attention: GPT-2 with every bias random, Llama with
    random norm weights."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        if family == "gpt2":
            config = transformers.GPT2Config(vocab_size=100, n_layer=LAYERS, n_embd=32, n_head=2,
                                             n_positions=64)  # fmt: skip
        else:
            config = transformers.LlamaConfig(num_hidden_layers=LAYERS, **COMMON)
        config._attn_implementation = "eager"
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if family == "gpt2" and name.endswith("bias"):
                    p.copy_(0.3 * torch.randn_like(p))
                if family == "llama" and "norm" in name:
                    p.copy_(0.3 * torch.randn_like(p) + 1.0)
    return model.double()


@pytest.fixture(scope="module")
def made():
    """(family, direction) -> (model, transcoders, graph, node table, position table), made once
    (the forward's table the graph's own, through the API)."""
    built: dict = {}

    def get(family: str, direction: str = "forward"):
        if family not in built:
            model = three_blocks(family)
            ts = random_transcoders(32, LAYERS, expansion=1, skip=True, dtype=torch.float64)
            graph = probe.attribution_graph(model, PROMPT, ts, qk=KEYS, qk_rows=None,
                                            qk_sources="nodes_forward", max_feature_nodes=16)  # fmt: skip
            plain = qk_table(model, graph, ts, keys=KEYS, rows=None)
            built[family] = built[family, "forward"] = model, ts, graph, graph.qk, plain
        if (family, direction) not in built:
            model, ts, graph, _, plain = built[family]
            table = qk_table(model, graph, ts, keys=KEYS, rows=None, sources=f"nodes_{direction}")
            built[family, direction] = model, ts, graph, table, plain
        return built[family, direction]

    return get


def equal_tables(got, want, tol: float) -> None:
    """The same rows (pair, query part, key part: cells and both marginal blocks), each
    contribution within `tol` of its pair's cells' |sum|."""
    got, want = (t.set_index(ROW).sort_index() for t in (got, want))
    assert got.index.equals(want.index) and len(got) > 0
    assert got["score"].equals(want["score"]) and got["pattern"].equals(want["pattern"])
    size = cells_of(want.reset_index()).groupby(PAIR)["contribution"].apply(lambda c: c.abs().sum())
    bound = tol * size.reindex(got.index.droplevel(["query_part", "key_part"])).values
    assert ((got["contribution"] - want["contribution"]).abs().values <= bound).all()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_forward_and_backward_tables_are_equal_and_nodes_is_the_cheaper(made, family):
    model, ts, graph, _, _ = made(family)
    forward, backward = (made(family, d)[3] for d in DIRECTIONS)
    equal_tables(forward, backward, 1e-12)  # (float64: 1e-15 of the cells' size measured)
    seen = qk_attribution._Forward(model, ts, None)
    with seen, torch.no_grad():
        model(PROMPT[None], use_cache=False)
        writes = qk_attribution._mlp_writes(seen.rep, ts, 1)
    traced = NodeSources(seen, writes, graph, ts, None)  # (no direction: the cheaper)
    cost = traced.cost
    weight = qk_sources.FORWARD_BLOCK_COST
    # the work: block passes times the copies each carries
    forward = weight * cost.forward_blocks * cost.forward_batch
    cheaper = "forward" if forward <= cost.backward_blocks * cost.backward_batch else "backward"
    assert traced.direction == cost.cheaper == cheaper


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_each_pairs_node_cells_and_marginals_sum_to_its_score(made, family, direction):
    model, ts, graph, table, plain = made(family, direction)
    # the same pairs, scores and patterns as the position table; no attention write left whole
    assert (
        table.groupby(PAIR)[["score", "pattern"]]
        .first()
        .equals(plain.groupby(PAIR)[["score", "pattern"]].first())
    )
    parts = set(table["query_part"]) | set(table["key_part"])
    assert not [p for p in parts if re.fullmatch(r"attn \d+@\d+", p)]
    assert any(p.startswith("attn 1 bias@") for p in parts) == (family == "gpt2")
    cells = cells_of(table)
    pairs = cells.groupby(PAIR)
    scores = pairs["score"].first()
    size = pairs["contribution"].apply(lambda c: c.abs().sum())
    # float64 throughout; Llama's RMSNorm rounds its output to float32 inside, so the score
    # read from it (and the writes made from it) differ from the frozen linear map by that
    # rounding, 2.4e-7 of the cells' size at most here (the position table's too)
    tol = 1e-12 if family == "gpt2" else 1e-6
    assert ((pairs["contribution"].sum() - scores).abs() <= tol * size).all()
    for side, other in (("query_part", "key_part"), ("key_part", "query_part")):
        marginal = table[table[other] == ALL].set_index([*PAIR, side])["contribution"]
        assert ((marginal.groupby(PAIR).sum() - scores).abs() <= tol * size).all()
        # each marginal is its part's cells summed against the whole other side
        summed = cells.groupby([*PAIR, side])["contribution"].sum()
        torch.testing.assert_close(torch.tensor(marginal.sort_index().values),
                                   torch.tensor(summed.sort_index().values), rtol=1e-9, atol=1e-12)  # fmt: skip
    # parts traced through attention: the pair's sides hold other positions' nodes
    far = cells[(cells["layer"] >= 1) & cells["query_part"].str.startswith("token@")]
    assert (far["query_part"] != far["query_pos"].map(lambda q: f"token@{q}")).any()


def test_the_viewer_json_of_a_node_traced_table_validates_and_names_its_nodes(made):
    jsonschema = pytest.importorskip("jsonschema")
    _, _, graph, table, _ = made("gpt2")
    data = json.loads(json.dumps(graph_model(graph, "qk nodes", node_threshold=0.8)))
    jsonschema.validate(data, NEURONPEDIA_GRAPH, cls=jsonschema.Draft7Validator)
    traced = [n for n in data["nodes"] if "qk_tracing_results" in n]
    assert len(traced) == table.groupby(PAIR).ngroups
    ids = {node_id(graph, i) for i in range(graph.n_nodes)}
    named = {a for n in traced for a, _, _ in n["qk_tracing_results"]["pair_wise_contributors"]}
    # a node by its id (another position's than the pair's too), a constant part by its name
    assert named & ids and all(a in ids or not re.fullmatch(r"(token|error \d+)@\d+", a)
                               for a in named)  # fmt: skip
    assert any(re.fullmatch(r"attn \d+ bias@\d+", a) for a in named)


def frozen_residuals(model, ts, remove=None) -> tuple[dict, dict]:
    """Each layer's attention input (n_pos, d) in the model and in the frozen replacement model
    (a replay of the prompt) with `remove` = (module, pos, vector) taken out of that module's
    output. (A move is a replay's against a replay: Llama's RMSNorm rounds its output to
    float32, a replay's frozen map does not.)"""
    rep = LocalReplacement(model, ts, mode="record")
    seen, hooks = {}, HookSet("qk nodes test")
    with torch.no_grad(), rep, hooks:
        for layer, norm in enumerate(rep.parts.attn_norms):
            hooks.forward_pre(norm, lambda m, a, i=layer: seen.update({i: a[0][0].clone()}))
        model(PROMPT[None], use_cache=False)
        real = dict(seen)
        rep.mode = "replay"
        if remove is not None:
            module, pos, vector = remove

            def minus(m, args, out):
                out = out.clone()
                out[0, pos] -= vector.to(out.dtype)
                return out

            hooks.forward(module, minus)
        model(PROMPT[None], use_cache=False)
    return real, seen


def removal(model, ts, part: str):
    """(module, pos, vector): where the node `part` names writes, and what."""
    rep = LocalReplacement(model, ts, mode="record")
    with torch.no_grad(), rep:
        model(PROMPT[None], use_cache=False)
    kind, rest = part.split(" ", 1) if " " in part else (part.split("@")[0], part)
    pos = int(part.rsplit("@", 1)[1])
    if kind == "token":
        return rep.parts.embed, pos, rep.captured.embed[0, pos]
    if kind == "error":
        layer = int(rest.split("@")[0])
        return rep.mlp_writes[layer], pos, error_vectors(rep, ts)[layer][pos]
    layer, feature = (int(v) for v in rest.split("@")[0].split(":"))
    t = ts[layer]
    act = t.encode(rep.saved["inputs"][layer][0])[pos, feature]
    return rep.mlp_writes[layer], pos, act * t.W_dec[feature]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_node_shares_equal_a_perturbation_of_the_frozen_model(made, family, direction):
    model, ts, graph, table, _ = made(family, direction)
    layer = LAYERS - 1
    real, base = frozen_residuals(model, ts)
    x = real[layer]
    q_pos = graph.n_pos - 1
    rows = table[(table["layer"] == layer) & (table["head"] == 0) & (table["query_pos"] == q_pos)]
    k_pos = int(rows["key_pos"].max())  # (of the keys it attends to most, the latest)
    rows = rows[rows["key_pos"] == k_pos]
    node = re.compile(r"(token|error|feature) ?[\d:]*@(\d+)")

    def elsewhere(parts, pos):
        """A token, an error and a feature node at another position than the side's (each
        reaches it through attention), where the side has them."""
        found = {}
        for p in parts:
            if (m := node.fullmatch(p)) and int(m[2]) != pos:
                found.setdefault(m[1], p)
        return list(found.values())

    q_rows = rows[rows["key_part"] == ALL].set_index("query_part")["contribution"]
    k_rows = rows[rows["query_part"] == ALL].set_index("key_part")["contribution"]
    q_parts, k_parts = elsewhere(q_rows.index, q_pos), elsewhere(k_rows.index, k_pos)
    assert len(q_parts) == 3 and len(k_parts) >= 2
    columns = {}  # part -> its column: the residual's move when it is taken out, negated
    for part in {*q_parts, *k_parts}:
        columns[part] = (
            base[layer] - frozen_residuals(model, ts, removal(model, ts, part))[1][layer]
        )
    # the whole side: the replay's residual, which the parts sum to (Llama's RMSNorm rounds its
    # output to float32, so the real residual is 1e-4 away in this random model); the norm's
    # frozen scale: the real residual's, as the table's
    parts = [{"x": base[layer][p]} | {name: c[p] for name, c in columns.items()}
             for p in range(len(x))]  # fmt: skip
    q_side, k_side, scaling, group = hand_qk(model, family, parts, x, layer)

    def q_of(name):
        return q_side[q_pos][name][0].detach()

    def k_of(name):
        return k_side[k_pos][name][0 // group].detach()

    def close(got, q, k):
        """got = scaling q . k, within float64's rounding of the parts."""
        want = float(q @ k) * scaling
        assert abs(got - want) <= 1e-9 * float(q.norm() * k.norm()) * abs(scaling) + 1e-12

    q_whole, k_whole = q_of("x") + q_of("bias"), k_of("x") + k_of("bias")
    for part in q_parts:
        close(q_rows[part], q_of(part), k_whole)
    for part in k_parts:
        close(k_rows[part], q_whole, k_of(part))
    cells = rows.set_index(["query_part", "key_part"])["contribution"]
    for a in q_parts:
        for b in k_parts:
            close(cells[a, b], q_of(a), k_of(b))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_without_attention_between_the_node_and_the_pair_the_table_is_the_position_ones(
    made, family, direction
):
    _, _, _, table, plain = made(family, direction)
    key = [*PAIR, "query_part", "key_part"]
    first = table[table["layer"] == 0].set_index(key)["contribution"].sort_index()
    want = plain[plain["layer"] == 0].set_index(key)["contribution"].sort_index()
    assert first.index.equals(want.index)
    torch.testing.assert_close(torch.tensor(first.values), torch.tensor(want.values),
                               rtol=1e-9, atol=1e-12)  # fmt: skip
    if family == "llama":  # (its RMSNorm's float32 rounding moves the whole key side by 1e-4)
        return
    # layer 1: a layer-0 feature or error at the query position reaches it directly alone, so
    # its share against the whole key is the position table's
    here = re.compile(r"(feature 0:\d+|error 0)@(\d+)")

    def local(t):
        rows = t[(t["layer"] == 1) & (t["key_part"] == ALL)]
        at_query = [
            bool((m := here.fullmatch(p)) and int(m[2]) == q)
            for p, q in zip(rows["query_part"], rows["query_pos"], strict=True)
        ]
        rows = rows[at_query]
        return rows.set_index([*PAIR, "query_part"])["contribution"].sort_index()

    got, old = local(table), local(plain)
    assert len(got) > 10 and got.index.equals(old.index)
    torch.testing.assert_close(torch.tensor(got.values), torch.tensor(old.values),
                               rtol=1e-9, atol=1e-12)  # fmt: skip
    assert REST not in set(table["query_part"])


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "llama+clt"])
def test_the_traced_parts_sum_to_the_frozen_models_residual_across_families(family):
    """Gemma-2 (sandwich norms: the post-attention norm's frozen map), Gemma-3 (a sliding layer
    first) and a Llama with a cross-layer transcoder (features writing into later layers): at
    block 1's attention input every position's parts sum to the frozen replacement model's
    residual (a replay), to float64's rounding of the parts, and hold the token before it, by
    either direction; and the two directions' QK tables are equal."""
    model = tiny(family.removesuffix("+clt"))
    ts = (
        random_cross_layer(32, 2, expansion=1, dtype=torch.float64)
        if family.endswith("+clt")
        else random_transcoders(32, 2, expansion=1, skip=True, dtype=torch.float64)
    )
    graph = probe.attribution_graph(model, PROMPT, ts, max_feature_nodes=16)
    seen = qk_attribution._Forward(model, ts, None)
    with seen, torch.no_grad():
        model(PROMPT[None], use_cache=False)
        writes = qk_attribution._mlp_writes(seen.rep, ts, 1)
    _, frozen = frozen_residuals(model, ts)
    for direction in DIRECTIONS:
        traced = NodeSources(seen, writes, graph, ts, None, direction=direction)
        rows = traced.rows(1, list(range(len(PROMPT))))
        for p, split in rows.items():
            size = float(split.abs().sum(1).max())
            assert float((split.sum(1) - frozen[1][p]).abs().max()) <= 1e-12 * size
            names = [traced.names[c] for c in split.abs().sum(0).nonzero().flatten().tolist()]
            assert p == 0 or f"token@{p - 1}" in names  # (through attention 0)
    forward, backward = (qk_table(model, graph, ts, keys=KEYS, rows=None, sources=f"nodes_{d}")
                         for d in DIRECTIONS)  # fmt: skip
    equal_tables(forward, backward, 1e-12)


def test_the_passes_are_the_cost_estimates_and_the_forwards_batch_and_groups_the_plans(
    made, monkeypatch, caplog
):
    """With 840,000 bytes free (float64, width 32, 7 positions, 2 heads), the forward's copies
    get a quarter of them: (210,000 - once) // per copy = 9 copies, and its parts too, which
    hold layer 1's or layer 2's alone: two groups, each one's forwards run again (the log line
    says so for the forward alone); the parts are still the backward's, and each direction ran
    the passes its estimate counted."""
    model, ts, graph, _, _ = made("gpt2")
    free = 840_000
    monkeypatch.setattr(batch_plan, "free_bytes", lambda device: free)
    monkeypatch.setattr(qk_sources, "free_bytes", lambda device: free)
    seen = qk_attribution._Forward(model, ts, None)
    with seen, torch.no_grad():
        model(PROMPT[None], use_cache=False)
        writes = qk_attribution._mlp_writes(seen.rep, ts, 1)
    n_pos, width = len(PROMPT), 32
    per_copy = 12 * n_pos * width * 8  # FORWARD_COPY_TENSORS of n_pos x width floats
    once = 3 * n_pos * width * 8 + 3 * 2 * n_pos * n_pos * 4  # one block's q, k, v; its pattern
    batch = (free / 4 - once) // per_copy
    assert batch == 9
    positions = qk_attribution.query_positions(graph)
    needed = {}
    for layer in range(LAYERS):
        pattern = seen.rep.saved["patterns"][layer][0]
        needed[layer] = qk_sources.needed_positions(pattern, positions, KEYS)
    # the columns before each layer's block: tokens and embedding rests, then per earlier layer
    # its features, error, MLP rest and attention bias
    traced = NodeSources(seen, writes, graph, ts, None, direction="forward", needed=needed)
    before = [2 * n_pos + sum(len({k for k in writes[s].features}) + 3 * n_pos
                              for s in range(layer)) for layer in range(LAYERS)]  # fmt: skip
    held = [len(needed[layer]) * width * before[layer] * 8 for layer in range(LAYERS)]
    assert max(held[1], held[2]) <= free / 4 < held[1] + held[2]
    cost = traced.cost
    assert cost.forward_batch == batch and cost.groups == ((1,), (2,)) and cost.forward_fits
    assert cost.parts_budget == free / 4 and cost.largest_parts == max(held[1], held[2])
    assert cost.forward_passes == sum(math.ceil(before[g] / batch) for g in (1, 2))
    # block passes: a forward stops at its group's last layer, having run that many blocks
    assert cost.forward_blocks == sum(math.ceil(before[g] / batch) * g for g in (1, 2))
    forward = {layer: traced.rows(layer, needed[layer]) for layer in (1, 2)}
    assert traced.forward_passes == cost.forward_passes
    caplog.clear()
    with caplog.at_level("INFO", logger="probe"):
        NodeSources(seen, writes, graph, ts, None, direction="backward", needed=needed)
    assert "qk sources: backward" in caplog.text and "groups" not in caplog.text
    with caplog.at_level("INFO", logger="probe"):
        NodeSources(seen, writes, graph, ts, None, direction="forward", needed=needed)
    assert "the forward's parts in 2 groups of layers (205.1 KiB)" in caplog.text
    monkeypatch.undo()  # (the backward's passes by the real plan: fewer)
    back = NodeSources(seen, writes, graph, ts, None, direction="backward", needed=needed)
    for layer in (1, 2):
        for p, split in back.rows(layer, needed[layer]).items():
            size = float(split.abs().sum(1).max())
            assert float((forward[layer][p] - split).abs().max()) <= 1e-12 * size
    passes = {g: math.ceil(width * len(needed[g]) / back.cost.backward_batch) for g in (1, 2)}
    assert back.backward_passes == back.cost.backward_passes == sum(passes.values())
    # a pass seeded at layer l runs back through l blocks, after one forward through all
    assert back.cost.backward_blocks == sum(k * g for g, k in passes.items()) + LAYERS


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("sources", ["position", "nodes_forward"])
@pytest.mark.parametrize("rows", [3, None])
def test_cells_made_in_chunks_of_three_parts_give_the_one_chunk_table(
    made, monkeypatch, family, sources, rows
):
    model, ts, graph, traced, plain = made(family)
    one_chunk = {"position": plain, "nodes_forward": traced}[sources]  # (rows=None)
    if rows is not None:
        one_chunk = qk_table(model, graph, ts, keys=KEYS, rows=rows, sources=sources)
    default = qk_cells.chunk_parts
    chunked: list[tuple[int, int]] = []  # (query-side parts, key-side parts) a query position
    monkeypatch.setattr(qk_cells, "chunk_parts", lambda *shape: 3)
    monkeypatch.setattr(PairCells, "__init__", counted(PairCells.__init__, chunked))
    got = qk_table(model, graph, ts, keys=KEYS, rows=rows, sources=sources)
    assert max(nq for nq, _ in chunked) > 3 * 5  # (many chunks a query position)
    heads = model.config.num_attention_heads
    assert all(default(heads, KEYS, nk) >= nq for nq, nk in chunked)  # (by default: one chunk)
    # row for row: the same pairs, parts and kind of row in the same order, except where
    # |contribution| ties exactly (a Llama's zero bias part: its cells all 0); the values to
    # float64 rounding of another summation order
    assert list(got.columns) == list(one_chunk.columns) and len(got) == len(one_chunk) > 0
    assert got[PAIR].equals(one_chunk[PAIR])
    assert got["score"].equals(one_chunk["score"]) and got["pattern"].equals(one_chunk["pattern"])
    size = cells_of(one_chunk).groupby(PAIR)["contribution"].apply(lambda c: c.abs().sum())
    bound = 1e-12 * size.reindex(pd.MultiIndex.from_frame(one_chunk[PAIR])).values
    magnitude = (got["contribution"].abs() - one_chunk["contribution"].abs()).abs()
    assert (magnitude.values <= bound).all()
    ties = one_chunk.duplicated([*PAIR, "contribution"], keep=False)
    untied = ~ties.values
    assert got[ROW][untied].equals(one_chunk[ROW][untied])
    equal_tables(got, one_chunk, 1e-12)  # (the same rows as a set, values to 1e-12)
    if rows is not None:
        assert (cells_of(got)["query_part"] == REST).any()  # (the rest summed across chunks)


def counted(init, into: list):
    """PairCells.__init__ recording each query position's (query-side parts, key-side parts)."""

    def wrapper(self, q_vectors, k_vectors, *args, **kwargs):
        into.append((q_vectors.shape[0], k_vectors.shape[0]))
        init(self, q_vectors, k_vectors, *args, **kwargs)

    return wrapper


def test_every_cell_past_the_free_memory_is_refused_by_name_and_kept_rows_are_not(
    made, monkeypatch
):
    model, ts, graph, _, plain = made("gpt2")
    monkeypatch.setattr(qk_cells, "free_bytes", lambda device: 1_000_000)
    shapes: list[tuple[int, int]] = []
    monkeypatch.setattr(PairCells, "__init__", counted(PairCells.__init__, shapes))
    with pytest.raises(
        ConfigError, match=r"qk_rows=None.*cells at layer \d+, query \d+.*qk_rows=20"
    ) as refused:
        qk_table(model, graph, ts, keys=KEYS, rows=None)
    nq, nk = shapes[-1]  # (the query position refused: its cells heads x keys x nq x nk)
    assert f"has {model.config.num_attention_heads * KEYS * nq * nk:,} cells" in str(refused.value)
    kept = qk_table(model, graph, ts, keys=KEYS, rows=3)  # (a pair's largest: no refusal)
    pairs = (t[PAIR].drop_duplicates().reset_index(drop=True) for t in (kept, plain))
    assert next(pairs).equals(next(pairs))


def test_bad_qk_sources_are_refused_by_name():
    with pytest.raises(ConfigError, match=r"graph\.qk_sources='neighbours'.*position.*nodes"):
        GraphOptions(qk=2, qk_sources="neighbours")


@pytest.mark.parametrize("batch", [0, -3, 2.5])
def test_a_bad_batch_of_the_traced_table_is_refused_by_name(made, batch):
    model, ts, graph, _, _ = made("gpt2")
    with pytest.raises(ConfigError, match=rf"qk_table\(batch={batch}\).*integer >= 1, or None"):
        qk_table(model, graph, ts, keys=KEYS, sources="nodes", batch=batch)


def traced_sources(model, ts, graph, **options) -> NodeSources:
    """NodeSources of `graph` from a record forward of the prompt."""
    seen = qk_attribution._Forward(model, ts, None)
    with seen, torch.no_grad():
        model(PROMPT[None], use_cache=False)
        writes = qk_attribution._mlp_writes(seen.rep, ts, 1)
    return NodeSources(seen, writes, graph, ts, None, **options)


def test_embeddings_rescaled_before_the_first_block_give_the_same_table_both_ways():
    """The model rescales the embeddings between its embeddings module and its first block (x3:
    older transformers' Gemma multiplies them by sqrt(width) in the model's forward): the token
    columns carry the rescaled embedding and the embedding's rest is x_0 less it, so the parts
    still sum to the residual (the table is not refused) and the two directions' tables are
    equal, the rest zero by the forward (exactly) and by the backward (to rounding)."""
    model = three_blocks("llama")

    def rescale(module, args, kwargs):
        if args:
            return (args[0] * 3.0, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": kwargs["hidden_states"] * 3.0}

    model.model.layers[0].register_forward_pre_hook(rescale, with_kwargs=True)
    ts = random_transcoders(32, LAYERS, expansion=1, skip=True, dtype=torch.float64)
    graph = probe.attribution_graph(model, PROMPT, ts, max_feature_nodes=16)
    forward, backward = (qk_table(model, graph, ts, keys=KEYS, rows=None, sources=f"nodes_{d}")
                         for d in DIRECTIONS)  # fmt: skip
    # the backward's rest parts are rounding (1e-18), rows the forward has none of: compare
    # every row either holds, a missing one zero
    got, want = (t.set_index(ROW)["contribution"] for t in (forward, backward))
    both = got.index.union(want.index)
    got, want = got.reindex(both, fill_value=0.0), want.reindex(both, fill_value=0.0)
    size = cells_of(backward).groupby(PAIR)["contribution"].apply(lambda c: c.abs().sum())
    bound = 1e-12 * size.reindex(both.droplevel(["query_part", "key_part"])).values
    assert ((got - want).abs().values <= bound).all()
    later = forward[forward["layer"] >= 1]
    assert not (
        later["query_part"].str.startswith("embed rest") & (later["contribution"] != 0)
    ).any()
    assert later["query_part"].str.startswith("token@").any()


def test_a_layer_over_the_forwards_budget_takes_the_backward_or_is_refused_by_name(
    made, monkeypatch, caplog
):
    """With 1,000 bytes free the forward's parts may hold 250 of them, and layer 2's alone
    (positions x width x columns before it, float64) take more: `nodes` takes the backward and
    logs why, `nodes_forward` is refused naming that size, the budget and the ways out; where
    the free memory cannot be read, the forward holds one layer at a time."""
    model, ts, graph, _, _ = made("gpt2")
    monkeypatch.setattr(qk_sources, "free_bytes", lambda device: 1_000)
    with caplog.at_level("INFO", logger="probe"):
        traced = traced_sources(model, ts, graph, batch=8)
    # every position of layer 2 (none given), the columns before its block, float64
    held = len(PROMPT) * 32 * traced.block_start[LAYERS - 1] * 8
    size = batch_plan.human(held)
    cost = traced.cost
    assert traced.direction == cost.cheaper == "backward" and not cost.forward_fits
    assert (cost.largest_layer, cost.largest_parts, cost.parts_budget) == (2, held, 250)
    assert "the forward cannot run: its parts of layer 2 alone" in caplog.text
    with pytest.raises(ModelError) as refused:
        traced_sources(model, ts, graph, batch=8, direction="forward")
    message = str(refused.value)
    assert f"layer 2 alone (positions x width x columns) take {size}" in message
    assert "budget of 250 B" in message and "graph.qk_sources=nodes_backward" in message
    monkeypatch.setattr(qk_sources, "free_bytes", lambda device: None)
    unknown = traced_sources(model, ts, graph, batch=8).cost
    assert unknown.groups == ((1,), (2,)) and unknown.parts_budget is None and unknown.forward_fits


def test_no_pass_carries_more_copies_than_it_can_use(made):
    """graph.batch_size 5,000: the backward's copies are capped at its largest layer's seeds
    (width x the positions that layer needs), the forward's at the columns its longest forward
    carries; a pass uses that many (the backward's kept forward holds that many copies)."""
    model, ts, graph, _, _ = made("gpt2")
    needed = {0: [0, 6], 1: [2, 5, 6], 2: [6]}
    traced = traced_sources(model, ts, graph, batch=5_000, needed=needed, direction="backward")
    assert traced.cost.backward_batch == 32 * 3
    assert traced.cost.forward_batch == traced.block_start[2]
    traced.rows(2, [6])
    assert traced.resid[2].shape[0] == 32 * 3 and traced.backward_passes == 1


def test_a_table_of_no_query_positions_is_empty_by_either_direction(made):
    model, ts, graph, _, _ = made("gpt2")
    plain = qk_table(model, graph, ts, keys=KEYS, positions=[])
    assert plain.empty
    for direction in DIRECTIONS:
        table = qk_table(model, graph, ts, keys=KEYS, positions=[], sources=f"nodes_{direction}")
        assert table.empty and list(table.columns) == list(plain.columns)
        assert traced_sources(model, ts, graph, direction=direction).rows(1, []) == {}


def test_parts_that_miss_the_residual_are_refused_naming_the_direction_and_ways_out(
    made, monkeypatch
):
    """The forward given a wrong x_0 for the tokens (zero: the embedding's rest then holds x_0
    whole, the tokens' share counted twice): the parts do not sum to the residual, and the
    refusal says which direction traced them and what to use instead."""
    model, ts, graph, _, _ = made("gpt2")
    monkeypatch.setattr(NodeSources, "_tokens_at_first_block",
                        lambda self, block: torch.zeros(len(PROMPT), 32, dtype=torch.float64))  # fmt: skip
    with pytest.raises(ModelError, match=r"do not sum to it .*traced to the nodes by the forward "
                       r"direction; graph\.qk_sources=nodes_backward or position"):  # fmt: skip
        qk_table(model, graph, ts, keys=KEYS, sources="nodes_forward")
