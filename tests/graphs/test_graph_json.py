"""A graph's circuit-tracer frontend JSON: it validates against circuit-tracer's own pydantic
models (where its source is unpacked), its nodes and links are the pruned graph's (ids decoded
back to the node table, weights equal), and circuit-tracer's local server lists and serves it."""

from __future__ import annotations

import dataclasses
import json
import urllib.request

import pytest
import torch
import transformers

from probe.errors import ConfigError
from probe.graphs.attribution import GraphOptions, attribute
from probe.graphs.graph_json import graph_model, write_graph_json
from probe.graphs.pruning import prune
from probe.testing.peers import circuit_tracer_source
from probe.testing.random_transcoders import random_transcoders
from probe.testing.tiny_lms import TASK_CLASSES, make_tiny

PROMPT = torch.tensor([3, 7, 12, 9, 20, 5, 14])


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    """A real pruned graph of a tiny GPT-2 with random transcoders."""
    folder = make_tiny("gpt2", tmp_path_factory.mktemp("gpt2"))
    model = getattr(transformers, TASK_CLASSES["gpt2"]).from_pretrained(folder).eval()
    g = attribute(model, PROMPT, random_transcoders(), GraphOptions(batch_size=64))
    g.scan = ["tc0", "tc1"]
    g.prompt = "a b c d e f g"
    return prune(g, 0.8, 0.98)


def peer_models():
    if circuit_tracer_source() is None:
        pytest.skip("circuit-tracer's source is not unpacked at $PROBE_CIRCUIT_TRACER_SRC")
    pytest.importorskip("pydantic")
    return pytest.importorskip("circuit_tracer.frontend.graph_models")


def decode(node_id: str, n_layers: int) -> tuple[str, int, int, int]:
    """(kind, layer, pos, feature-or-token) of a circuit-tracer node id, as the table has them."""
    a, b, c = node_id.split("_")
    if a == "E":
        return "token", -1, int(c), int(b)
    if int(a) == n_layers + 1:
        return "logit", n_layers, int(c), int(b)
    return "feature", int(a), int(c), int(b)


def test_json_validates_against_circuit_tracers_models(graph, tmp_path):
    models = peer_models()
    path = write_graph_json(graph, tmp_path, "tiny", node_threshold=0.8)
    data = json.loads(path.read_text())
    model = models.Model.model_validate(data)
    assert model.metadata.slug == "tiny" and model.metadata.transcoder_list == ["tc0", "tc1"]
    assert model.metadata.prompt_tokens == graph.token_strings
    # every node field as circuit-tracer's own constructors make it
    for node in data["nodes"]:
        kind = node["feature_type"]
        if kind == "cross layer transcoder":
            layer, feat, pos = (int(x) for x in node["node_id"].split("_"))
            want = models.Node.feature_node(layer, pos, feat, node["influence"], node["activation"])
        elif kind == "mlp reconstruction error":
            _, layer, pos = (int(x) for x in node["node_id"].split("_"))
            want = models.Node.error_node(layer, pos, node["influence"])
        elif kind == "embedding":
            _, vocab, pos = node["node_id"].split("_")
            want = models.Node.token_node(int(pos), int(vocab), node["influence"])
        else:
            k = graph.logit_tokens.tolist().index(node["feature"])
            want = models.Node.logit_node(
                graph.n_pos - 1, node["feature"], graph.logit_strings[k], graph.n_layers,
                k == 0, float(graph.logit_probs[k]),
            )  # fmt: skip
        assert node == want.model_dump()
    for link in data["links"]:
        models.Link.model_validate(link)
    index = json.loads((tmp_path / "graph-metadata.json").read_text())
    assert index["graphs"] == [model.metadata.model_dump()]


def test_nodes_and_links_are_the_pruned_graphs(graph, tmp_path):
    data = json.loads(graph.to_json(tmp_path / "g.json").read_text())
    assert data["metadata"]["slug"] == "g"
    nodes, edges = graph.nodes(), graph.edges()
    key = {}
    for row in nodes.itertuples():
        if row.kind == "error":
            key[("error", row.layer, row.pos)] = row.node
        else:
            ident = row.feature if row.kind == "feature" else None
            key[(row.kind, row.layer, row.pos, ident)] = row.node
    token_ids = graph.tokens.tolist()
    logits = graph.logit_tokens.tolist()

    def number(node) -> int:
        if node["feature_type"] == "mlp reconstruction error":
            _, layer, pos = (int(x) for x in node["node_id"].split("_"))
            return key[("error", layer, pos)]
        kind, layer, pos, ident = decode(node["node_id"], graph.n_layers)
        if kind == "token":
            assert token_ids[pos] == ident
            return key[(kind, layer, pos, None)]
        if kind == "logit":
            return graph.offsets["logit"] + logits.index(ident)
        return key[(kind, layer, pos, ident)]

    numbers = {n["node_id"]: number(n) for n in data["nodes"]}
    assert len(numbers) == len(data["nodes"])  # ids unique in this graph
    kept = set(nodes.loc[nodes["kept"], "node"])
    assert set(numbers.values()) <= kept
    for n in data["nodes"]:  # activations and influence from the tables
        row = nodes.loc[numbers[n["node_id"]]]
        if row.kind == "feature":
            assert n["activation"] == pytest.approx(row.activation, rel=1e-6)
        if row.kind != "logit":
            assert n["influence"] == pytest.approx(float(graph.cumulative[row.node]))
    # the links: every kept edge between kept nodes, weights equal
    want = edges[edges["target"].isin(kept) & edges["source"].isin(kept)]
    got = {
        (numbers[link["target"]], numbers[link["source"]]): link["weight"] for link in data["links"]
    }
    assert len(got) == len(data["links"]) == len(want) > 0
    for row in want.itertuples():
        assert got[(row.target, row.source)] == pytest.approx(row.weight, rel=1e-12)
    # nodes: every token and logit, and the kept nodes a kept link touches
    touched = {x for pair in got for x in pair}
    expected = {i for i in kept if i in touched or i >= graph.offsets["token"]}
    assert set(numbers.values()) == expected


def test_an_unpruned_graph_is_pruned_on_a_copy(graph):
    bare = dataclasses.replace(
        graph, influence=None, cumulative=None, node_kept=None, edge_kept=None
    )
    assert graph_model(bare, "x") == graph_model(graph, "x")
    assert bare.node_kept is None  # the caller's graph untouched


def test_bad_slug_is_refused(graph):
    with pytest.raises(ConfigError, match="slug 'a/b'"):
        graph_model(graph, "a/b")


def test_circuit_tracers_server_lists_and_serves_the_graphs(graph, tmp_path):
    peer_models()
    from circuit_tracer.frontend.local_server import serve

    write_graph_json(graph, tmp_path, "one")
    write_graph_json(graph, tmp_path, "two")
    write_graph_json(graph, tmp_path, "one")  # (rewritten: listed once)
    server = serve(data_dir=str(tmp_path), port=0)
    try:
        port = server.httpd.server_address[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/graph-metadata.json") as r:
            listed = [g["slug"] for g in json.loads(r.read())["graphs"]]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/graph_data/two.json") as r:
            served = json.loads(r.read())
    finally:
        server.stop()
    assert sorted(listed) == ["one", "two"]
    assert served == json.loads((tmp_path / "two.json").read_text())


# Neuronpedia's graph schema (apps/webapp/app/api/graph/graph-schema.json in its repository,
# draft-07): the keys it requires and the types it gives them, written out here
_STRING, _NUMBER = {"type": "string"}, {"type": "number"}
NEURONPEDIA_GRAPH = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "type": "object",
    "required": ["metadata", "qParams", "nodes", "links"],
    "properties": {
        "metadata": {
            "type": "object",
            "required": ["slug", "scan", "prompt_tokens", "prompt"],
            "properties": {
                "slug": _STRING, "scan": _STRING, "prompt": _STRING,
                "prompt_tokens": {"type": "array", "items": _STRING},
                "feature_details": {"type": "object", "properties": {
                    "feature_json_base_url": _STRING, "neuronpedia_source_set": _STRING}},
                "node_threshold": _NUMBER,
                "info": {"type": "object"},
                "generation_settings": {"type": "object", "properties": {
                    "max_n_logits": {"type": "integer"}, "desired_logit_prob": _NUMBER,
                    "batch_size": {"type": "integer"}, "max_feature_nodes": {"type": "integer"}}},
                "pruning_settings": {"type": "object", "properties": {
                    "node_threshold": _NUMBER, "edge_threshold": _NUMBER}},
            },
        },
        "qParams": {"type": "object", "properties": {
            "pinnedIds": {"type": "array", "items": _STRING}, "supernodes": {"type": "array"},
            "linkType": _STRING, "clickedId": _STRING, "sg_pos": _STRING}},
        "nodes": {"type": "array", "items": {
            "type": "object",
            "required": ["node_id", "feature", "layer", "ctx_idx", "feature_type", "jsNodeId",
                         "clerp"],
            "properties": {
                "node_id": _STRING, "feature": {"type": ["integer", "null"]},
                "layer": {"type": ["string", "integer"]}, "ctx_idx": {"type": "integer"},
                "feature_type": _STRING, "jsNodeId": _STRING, "clerp": _STRING,
                "influence": {"type": ["number", "null"]},
                "activation": {"type": ["number", "null"]},
            },
        }},
        "links": {"type": "array", "items": {
            "type": "object", "required": ["source", "target", "weight"],
            "properties": {"source": _STRING, "target": _STRING, "weight": _NUMBER},
        }},
    },
}  # fmt: skip


def test_json_validates_against_neuronpedias_graph_schema(graph, tmp_path):
    """The viewer JSON is a graph Neuronpedia takes; a JSON missing a required key is not (the
    check itself)."""
    jsonschema = pytest.importorskip("jsonschema")
    data = json.loads(write_graph_json(graph, tmp_path, "tiny", node_threshold=0.8).read_text())
    jsonschema.Draft7Validator.check_schema(NEURONPEDIA_GRAPH)
    jsonschema.validate(data, NEURONPEDIA_GRAPH, cls=jsonschema.Draft7Validator)
    assert data["nodes"] and data["links"]
    del data["nodes"][0]["jsNodeId"]
    with pytest.raises(jsonschema.ValidationError, match="'jsNodeId' is a required property"):
        jsonschema.validate(data, NEURONPEDIA_GRAPH, cls=jsonschema.Draft7Validator)
