"""A graph read back from HDF5: one prompt's AttributionGraph from a run's probe.h5 (its
/graph) or from a file `AttributionGraph.save` wrote (the layout: probe.graphs.graph_h5), with
its QK table where the file holds one (/graph_qk: probe.graphs.qk_h5; else `qk` is None).

    from probe.graphs.graph_files import load_graph
    graph = load_graph("outputs/2026-11-28/10-00-00", prompt=3)
    graph.nodes(), graph.edges()
"""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import torch

from probe.errors import DataError
from probe.graphs.attribution_graph import AttributionGraph
from probe.graphs.graph_data import KINDS
from probe.graphs.graph_h5 import graph_group, graph_path, prompt_rows, write_graph
from probe.graphs.qk_h5 import read_qk
from probe.store.groups import read_columns


def load_graph(path_or_run: str | Path, prompt: int = 0) -> AttributionGraph:
    """Prompt `prompt`'s graph (the dataset's sample index in a run; 0 in a saved file) from a
    run directory's probe.h5 or an HDF5 file holding /graph, as the AttributionGraph it was (its
    QK table too, where /graph_qk holds one for the prompt)."""
    path = graph_path(path_or_run)
    with h5py.File(path, "r") as f:
        g = graph_group(f, path)
        rows = prompt_rows(g)
        match = rows.index[rows["prompt"] == prompt]
        if not len(match):
            have = rows["prompt"].tolist()
            shown = ", ".join(map(str, have[:10])) + (", ..." if len(have) > 10 else "")
            raise DataError(
                f"{str(path)!r} holds no graph of prompt {prompt}; it holds prompts "
                f"[{shown}] ({len(have)} in all)"
            )
        row = rows.loc[match[0]].to_dict()
        nodes = read_columns(g["nodes"], int(row["node_start"]), int(row["nodes"]))
        edges = read_columns(g["edges"], int(row["edge_start"]), int(row["edges"]))
        scan = json.loads(str(g.attrs.get("scan", "null")))
    graph = graph_of(row, nodes, edges, scan)
    graph.qk = read_qk(path, prompt)
    return graph


def graph_of(row: dict, nodes: dict, edges: dict, scan=None) -> AttributionGraph:
    """The AttributionGraph of one prompt's rows."""
    kind = nodes["kind"]
    feature = kind == KINDS.index("feature")
    token = kind == KINDS.index("token")
    logit = kind == KINDS.index("logit")
    n = len(kind)
    features = np.stack([nodes["layer"], nodes["pos"], nodes["feature"]], 1)[feature]
    adjacency = torch.sparse_coo_tensor(
        torch.from_numpy(np.stack([edges["target"], edges["source"]]).astype(np.int64)),
        torch.from_numpy(np.asarray(edges["weight"])),
        (n, n),
        check_invariants=True,  # (read from a file: indices checked against the node count)
    ).coalesce()
    pruned = bool(row["pruned"])
    cumulative = pruned and "cumulative" in nodes and not np.isnan(nodes["cumulative"]).all()
    return AttributionGraph(
        tokens=torch.from_numpy(nodes["token_id"][token].astype(np.int64)),
        token_strings=[str(s) for s in nodes["token"][token]],
        n_layers=int(row["layers"]),
        features=torch.from_numpy(features.astype(np.int64).reshape(-1, 3)),
        activations=torch.from_numpy(nodes["activation"][feature].astype(np.float32)),
        logit_tokens=torch.from_numpy(nodes["token_id"][logit].astype(np.int64)),
        logit_probs=torch.from_numpy(nodes["activation"][logit].astype(np.float32)),
        logit_strings=[str(s) for s in nodes["token"][logit]],
        adjacency=adjacency,
        floor=float(row["floor"]),
        prompt=str(row["text"]) or None,
        scan=scan,
        active_features=int(row["active_features"]),
        influence=torch.from_numpy(nodes["influence"].astype(np.float64)) if pruned else None,
        cumulative=torch.from_numpy(nodes["cumulative"].astype(np.float64)) if cumulative else None,
        node_kept=torch.from_numpy(nodes["kept"].astype(bool)) if pruned else None,
        edge_kept=torch.from_numpy(edges["kept"].astype(bool)) if pruned else None,
        scores=json.loads(str(row["scores"])),
    )


def save_graph(graph: AttributionGraph, path: str | Path, prompt: int = 0) -> Path:
    """`graph` alone in a new HDF5 file at `path` (replaced if there), as prompt `prompt`, its
    QK table (`graph.qk`) with it; `load_graph(path, prompt)` reads it back."""
    return write_graph(graph, path, prompt)
