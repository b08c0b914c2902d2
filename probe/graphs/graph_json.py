"""One prompt's pruned graph as circuit-tracer's frontend JSON: the file its local viewer
(`circuit_tracer.frontend.local_server.serve(folder)`) and Neuronpedia's graph format read.

The JSON holds `metadata` (slug, scan, transcoder_list, prompt_tokens, prompt, node_threshold,
schema_version), `qParams` (the viewer's saved state, empty), `nodes` and `links` (source,
target, weight), as circuit-tracer 0.5's create_graph_files writes them: the nodes pruning
kept that a kept edge touches, plus every token and logit node; the kept edges between kept
nodes. Node ids are circuit-tracer's: `{layer}_{feature}_{pos}` for a feature,
`0_{layer}_{pos}` for an error, `E_{token id}_{pos}` for a token, `{n_layers + 1}_{token id}_{last
pos}` for a logit. A node's `influence` is its cumulative influence (the share of the total
influence held by the nodes at least as influential), as circuit-tracer's.

    write_graph_json(graph, "graphs", "prompt-0")   # graphs/prompt-0.json, graphs/graph-metadata.json
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from pathlib import Path
from typing import Any

import torch

from probe.errors import ConfigError
from probe.graphs.graph_data import GraphData
from probe.graphs.pruning import prune

log = logging.getLogger("probe")

METADATA_JSON = "graph-metadata.json"  # the viewer's index of the graphs in its folder
SCHEMA_VERSION = 1
FEATURE_TYPES = {
    "feature": "cross layer transcoder",
    "error": "mlp reconstruction error",
    "token": "embedding",
    "logit": "logit",
}


def cantor_pairing(x: int, y: int) -> int:
    """circuit-tracer's `feature` number of a (layer, feature) pair."""
    return (x + y) * (x + y + 1) // 2 + y


def cantor_unpairing(z: int) -> tuple[int, int]:
    """The (layer, feature) pair of circuit-tracer's `feature` number `z` (cantor_pairing's
    inverse)."""
    w = (math.isqrt(8 * z + 1) - 1) // 2
    y = z - w * (w + 1) // 2
    return w - y, y


def scan_of(graph: GraphData, scan: str | list[str] | None) -> tuple[str, list[str]]:
    """(metadata.scan, metadata.transcoder_list): a named scan as it is; a list of transcoder
    ids as circuit-tracer names it, `custom-<number>` (a stable hash of the ids joined by "-")
    with the list; no scan at all: `custom` and an empty list."""
    scan = graph.scan if scan is None else scan
    if scan is None:
        return "custom", []
    if isinstance(scan, str):
        return scan, []
    ids = [str(s) for s in scan]
    digest = int(hashlib.sha1("-".join(ids).encode()).hexdigest()[:15], 16)
    return f"custom-{digest}", ids


def pruned_copy(graph: GraphData) -> GraphData:
    """`graph` itself when pruned; else a copy pruned at circuit-tracer's defaults (0.8, 0.98)."""
    if graph.node_kept is not None and graph.edge_kept is not None:
        return graph
    return prune(dataclasses.replace(graph))


def json_nodes(graph: GraphData) -> dict[int, dict]:
    """{node number: the node's JSON} of the nodes pruning kept, in node order."""
    graph = pruned_copy(graph)
    if graph.node_kept is None:  # (pruned_copy's graph is pruned)
        raise RuntimeError("a pruned graph without its kept nodes")
    kept = graph.node_kept.nonzero().flatten().tolist()
    influence = graph.cumulative if graph.cumulative is not None else graph.influence
    off = graph.offsets
    n_pos, n_layers = graph.n_pos, graph.n_layers
    last = n_pos - 1
    out = {}
    for i in kept:
        score = float(influence[i]) if influence is not None else None
        if i < off["error"]:
            layer, pos, feat = (int(v) for v in graph.features[i].tolist())
            node = {"node_id": f"{layer}_{feat}_{pos}", "feature": cantor_pairing(layer, feat),
                    "layer": str(layer), "ctx_idx": pos, "feature_type": FEATURE_TYPES["feature"],
                    "jsNodeId": f"{layer}_{feat}-0", "influence": score,
                    "activation": float(graph.activations[i])}  # fmt: skip
        elif i < off["token"]:
            layer, pos = divmod(i - off["error"], n_pos)
            node = {"node_id": f"0_{layer}_{pos}", "feature": -1, "layer": str(layer),
                    "ctx_idx": pos, "feature_type": FEATURE_TYPES["error"],
                    "jsNodeId": f"{layer}_{pos}-0", "influence": score}  # fmt: skip
        elif i < off["logit"]:
            pos = i - off["token"]
            vocab = int(graph.tokens[pos])
            node = {"node_id": f"E_{vocab}_{pos}", "feature": pos, "layer": "E", "ctx_idx": pos,
                    "feature_type": FEATURE_TYPES["token"], "jsNodeId": f"E_{vocab}-{pos}",
                    "influence": score}  # fmt: skip
        else:
            k = i - off["logit"]
            vocab, prob = int(graph.logit_tokens[k]), float(graph.logit_probs[k])
            above = str(n_layers + 1)  # (the logits' layer: above the last)
            node = {"node_id": f"{above}_{vocab}_{last}", "feature": vocab, "layer": above,
                    "ctx_idx": last, "feature_type": FEATURE_TYPES["logit"], "token_prob": prob,
                    "is_target_logit": k == 0, "jsNodeId": f"L_{vocab}-{last}",
                    "clerp": f'Output "{graph.logit_strings[k]}" (p={prob:.3f})'}  # fmt: skip
        out[i] = _with_defaults(node)
    return out


def _with_defaults(node: dict) -> dict:
    """A node with every field of circuit-tracer's Node model, in its order."""
    full = {"node_id": node["node_id"], "feature": node["feature"], "layer": node["layer"],
            "ctx_idx": node["ctx_idx"], "feature_type": node["feature_type"],
            "token_prob": node.get("token_prob", 0.0),
            "is_target_logit": node.get("is_target_logit", False), "run_idx": 0,
            "reverse_ctx_idx": 0, "jsNodeId": node["jsNodeId"], "clerp": node.get("clerp", ""),
            "influence": node.get("influence"), "activation": node.get("activation")}  # fmt: skip
    return full


def graph_model(
    graph: GraphData,
    slug: str,
    *,
    scan: str | list[str] | None = None,
    node_threshold: float | None = None,
    clerps: dict[int, str] | None = None,
    features: str | None = None,
) -> dict:
    """circuit-tracer's frontend Model of `graph` (pruned first at 0.8/0.98 if it is not) as a
    dict: metadata, qParams, nodes, links. `scan` overrides the graph's transcoder ids;
    `node_threshold` is the metadata's (the run's graph.node_threshold); `clerps` {node number:
    label} fills feature nodes' `clerp` (the viewer's label); `features` the folder of the
    features' example files as circuit-tracer's viewer reaches it (probe.graphs.feature_files:
    every layer's source, a `custom-` scan, and `features` as Neuronpedia's base URL)."""
    if not isinstance(slug, str) or not slug or "/" in slug:
        raise ConfigError(f"graph JSON slug {slug!r}: a non-empty file name without '/'")
    graph = pruned_copy(graph)
    nodes = json_nodes(graph)
    for i, text in (clerps or {}).items():
        if i in nodes and nodes[i]["feature_type"] == FEATURE_TYPES["feature"]:
            nodes[i]["clerp"] = str(text)
    _warn_collisions(nodes, slug)
    a = graph.adjacency.coalesce()
    target, source = a.indices()
    if graph.edge_kept is None:  # (pruned_copy's graph is pruned)
        raise RuntimeError("a pruned graph without its kept edges")
    keep = graph.edge_kept.to(torch.bool)
    weights = a.values().double()[keep].tolist()
    links = [
        {"source": nodes[s]["node_id"], "target": nodes[t]["node_id"], "weight": w}
        for t, s, w in zip(target[keep].tolist(), source[keep].tolist(), weights, strict=True)
        if s in nodes and t in nodes
    ]
    connected = {x for link in links for x in (link["source"], link["target"])}
    used = [
        n
        for n in nodes.values()
        if n["node_id"] in connected or n["feature_type"] in ("embedding", "logit")
    ]
    scan_name, transcoder_list = scan_of(graph, scan)
    if features is not None:  # (the viewer reads transcoder_list[layer] of a custom- scan)
        scan_name = scan_name if scan_name.startswith("custom-") else f"custom-{scan_name}"
        transcoder_list = [features] * graph.n_layers
    metadata: dict[str, Any] = {
        "slug": slug,
        "scan": scan_name,
        "transcoder_list": transcoder_list,
        "prompt_tokens": [str(t) for t in graph.token_strings],
        "prompt": graph.prompt if graph.prompt is not None else "".join(graph.token_strings),
        "node_threshold": None if node_threshold is None else float(node_threshold),
        "schema_version": SCHEMA_VERSION,
    }
    if features is not None:
        metadata["feature_details"] = {"feature_json_base_url": "features"}
    qparams = {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "", "sg_pos": ""}
    if graph.qk is not None and len(graph.qk):
        used += qk_nodes(graph, graph.qk)
    return {"metadata": metadata, "qParams": qparams, "nodes": used, "links": links}


def node_id(graph: GraphData, i: int) -> str:
    """circuit-tracer's id of node number `i` (json_nodes' ids, for any node)."""
    off, n_pos = graph.offsets, graph.n_pos
    if i < off["error"]:
        layer, pos, feat = (int(v) for v in graph.features[i].tolist())
        return f"{layer}_{feat}_{pos}"
    if i < off["token"]:
        layer, pos = divmod(i - off["error"], n_pos)
        return f"0_{layer}_{pos}"
    if i < off["logit"]:
        pos = i - off["token"]
        return f"E_{int(graph.tokens[pos])}_{pos}"
    vocab = int(graph.logit_tokens[i - off["logit"]])
    return f"{graph.n_layers + 1}_{vocab}_{n_pos - 1}"


QK_ALL, QK_REST = "*", "rest"  # (probe.graphs.qk_attribution's ALL and REST)


def qk_nodes(graph: GraphData, table) -> list[dict]:
    """One node per decomposed attention pair of the QK table, with Neuronpedia's
    qk_tracing_results (see the module docstring); the table's kept rows in its order (largest
    |contribution| first), its `rest` rows left out."""

    def ids(nodes, parts) -> list[str]:
        return [
            node_id(graph, int(n)) if n >= 0 else str(p) for n, p in zip(nodes, parts, strict=True)
        ]

    out = []
    for (layer, head, q, k), rows in table.groupby(
        ["layer", "head", "query_pos", "key_pos"], sort=True
    ):
        qp, kp = rows["query_part"], rows["key_part"]
        cells = rows[(qp != QK_ALL) & (kp != QK_ALL) & (qp != QK_REST)]
        q_side = rows[(kp == QK_ALL) & (qp != QK_REST)]
        k_side = rows[(qp == QK_ALL) & (kp != QK_REST)]
        q_ids = ids(cells["query_node"], cells["query_part"])
        k_ids = ids(cells["key_node"], cells["key_part"])
        score, pattern = float(rows["score"].iloc[0]), float(rows["pattern"].iloc[0])
        results = {
            "pair_wise_contributors": [[a, b, float(c)] for a, b, c in
                                       zip(q_ids, k_ids, cells["contribution"], strict=True)],
            "top_q_marginal_contributors": [[a, float(c)] for a, c in zip(
                ids(q_side["query_node"], q_side["query_part"]), q_side["contribution"],
                strict=True)],
            "top_k_marginal_contributors": [[a, float(c)] for a, c in zip(
                ids(k_side["key_node"], k_side["key_part"]), k_side["contribution"],
                strict=True)],
        }  # fmt: skip
        node = _with_defaults({
            "node_id": f"A{layer}.{head}_{k}_{q}", "feature": int(head), "layer": str(layer),
            "ctx_idx": int(q), "feature_type": "lorsa", "jsNodeId": f"A{layer}.{head}_{k}-{q}",
            "clerp": f"head {layer}.{head}: position {q} attends to {k} (score {score:.4g}, "
                     f"pattern {pattern:.3f})",
            "activation": pattern,
        })  # fmt: skip
        node["qk_tracing_results"] = results
        out.append(node)
    return out


def _warn_collisions(nodes: dict[int, dict], slug: str) -> None:
    """circuit-tracer's ids name an error `0_{layer}_{pos}`, which is also layer 0's feature
    `{layer}` at `pos`: say so when both are in one graph (the viewer shows one of them)."""
    seen: dict[str, int] = {}
    for i, node in nodes.items():
        if node["node_id"] in seen:
            log.warning(
                "graph JSON %s: nodes %d and %d share circuit-tracer's id %s (layer 0's feature "
                "and an error node); its viewer shows one of them",
                slug, seen[node["node_id"]], i, node["node_id"],
            )  # fmt: skip
        seen[node["node_id"]] = i


def to_json(graph: GraphData, path: str | Path, slug: str | None = None, **options) -> Path:
    """`graph_model(graph, slug, **options)` written to `path` (slug: the file's stem).
    Returns the path."""
    path = Path(path)
    model = graph_model(graph, slug or path.stem, **options)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(model, indent=2))
    return path


def write_graph_json(graph: GraphData, folder: str | Path, slug: str, **options) -> Path:
    """`folder/<slug>.json` and its entry (the metadata) in `folder/graph-metadata.json`, the
    index circuit-tracer's viewer lists (an entry of the same slug replaced), so
    `circuit_tracer.frontend.local_server.serve(folder)` opens it. Returns the JSON's path."""
    folder = Path(folder)
    path = to_json(graph, folder / f"{slug}.json", slug, **options)
    add_to_index(folder, json.loads(path.read_text())["metadata"])
    return path


def add_to_index(folder: Path, metadata: dict) -> Path:
    """`metadata` into `folder/graph-metadata.json` ({"graphs": [...]}, one entry per slug)."""
    index = Path(folder) / METADATA_JSON
    graphs = json.loads(index.read_text())["graphs"] if index.exists() else []
    graphs = [g for g in graphs if g.get("slug") != metadata["slug"]] + [metadata]
    index.write_text(json.dumps({"graphs": graphs}, indent=2))
    return index
