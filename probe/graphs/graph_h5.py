"""The /graph layout in HDF5: `/graph` of a run's probe.h5 (one graph per prompt, appended as
each is computed: a keyed group of the run's sink, probe.store.groups) or a file of its own
(`AttributionGraph.save`, which also writes the graph's QK table, where it has one, as
/graph_qk: probe.graphs.qk_h5); a graph's rows written and read back as columns
(probe.graphs.graph_files makes an AttributionGraph of them again).

Layout (every dataset one column, chunked and resizable along its rows):

    /graph                attrs: format, options (JSON), transcoders, scan (JSON), complete
    /graph/prompts/*      one row per prompt: prompt, node_start, nodes, edge_start, edges,
                          layers, tokens, features, active_features, kept_nodes, kept_edges,
                          floor, replacement, completeness, pruned, scores (JSON), text
    /graph/nodes/*        one row per node: prompt, node, kind (0 feature, 1 error, 2 token,
                          3 logit: the `kinds` attribute), layer, pos, feature, token_id, token,
                          activation, influence, cumulative (pruning's cumulative influence),
                          kept
    /graph/edges/*        one row per stored edge of the attributed graph: prompt, target,
                          source, weight, kept

A prompt's nodes are rows [node_start, node_start + nodes) of /graph/nodes, its edges rows
[edge_start, edge_start + edges) of /graph/edges. The prompts row is written last and flushed:
a prompt is in the file once its row is, and rows past the last prompt's (a write cut short)
are cut off when the file is opened again to append (the rule of every keyed group).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pandas as pd

from probe.errors import DataError
from probe.graphs.qk_h5 import write_qk
from probe.store.groups import GroupKind, GroupTables, read_columns

KINDS = ("feature", "error", "token", "logit")  # the kind codes 0-3 (graph_data's KINDS)
GROUP = "graph"
FORMAT = "probe-graph 1"
STR = h5py.string_dtype()
PROMPT_COLUMNS = {
    "prompt": np.int64, "node_start": np.int64, "nodes": np.int64, "edge_start": np.int64,
    "edges": np.int64, "layers": np.int64, "tokens": np.int64, "features": np.int64,
    "active_features": np.int64, "kept_nodes": np.int64, "kept_edges": np.int64,
    "floor": np.float64, "replacement": np.float64, "completeness": np.float64,
    "pruned": np.bool_, "scores": STR, "text": STR,
}  # fmt: skip
NODE_COLUMNS = {
    "prompt": np.int64, "node": np.int64, "kind": np.int8, "layer": np.int64, "pos": np.int64,
    "feature": np.int64, "token_id": np.int64, "token": STR, "activation": np.float64,
    "influence": np.float64, "cumulative": np.float64, "kept": np.bool_,
}  # fmt: skip
EDGE_COLUMNS = {
    "prompt": np.int64, "target": np.int64, "source": np.int64, "weight": np.float32,
    "kept": np.bool_,
}  # fmt: skip
TABLES = {"prompts": PROMPT_COLUMNS, "nodes": NODE_COLUMNS, "edges": EDGE_COLUMNS}


GRAPH = GroupKind(
    root=GROUP, tables=TABLES, index="prompts", key="prompt",
    spans={"nodes": ("node_start", "nodes"), "edges": ("edge_start", "edges")},
    format=FORMAT, attrs={"nodes": {"kinds": list(KINDS)}},
)  # fmt: skip


def append_graph(tables: GroupTables, prompt: int, graph: Any) -> int:
    """`graph` as prompt `prompt`'s rows of /graph (its prompts row last, flushed); the bytes of
    its node and edge rows (strings counted by their UTF-8 length)."""
    nodes, edges = graph_rows(graph, prompt)
    tables.append(prompt_row(graph, prompt), {"nodes": nodes, "edges": edges})
    return sum(_nbytes(column) for rows in (nodes, edges) for column in rows.values())


def _nbytes(column: np.ndarray) -> int:
    if column.dtype == object:
        return sum(len(str(v).encode()) for v in column)
    return int(column.nbytes)


# -- one graph as rows ---------------------------------------------------------------------------
def graph_rows(graph: Any, prompt: int) -> tuple[dict, dict]:
    """The node and edge columns of `graph` (every stored edge) as prompt `prompt`'s."""
    table = graph.nodes()
    n = len(table)
    token_ids = graph.tokens.cpu().numpy().astype(np.int64)
    kind = pd.Categorical(table["kind"], categories=KINDS).codes.astype(np.int8)
    pos = table["pos"].to_numpy()
    token_id = np.where(kind == KINDS.index("logit"), -1, token_ids[np.clip(pos, 0, None)])
    token_id[kind == KINDS.index("logit")] = graph.logit_tokens.cpu().numpy().astype(np.int64)
    nodes = {
        "prompt": np.full(n, prompt, np.int64),
        "node": table["node"].to_numpy(np.int64),
        "kind": kind,
        "layer": table["layer"].to_numpy(np.int64),
        "pos": pos.astype(np.int64),
        "feature": table["feature"].to_numpy(np.int64),
        "token_id": token_id.astype(np.int64),
        "token": np.array(table["token"].tolist(), dtype=object),
        "activation": table["activation"].to_numpy(np.float64),
        "influence": table["influence"].to_numpy(np.float64),
        "cumulative": _per_node(getattr(graph, "cumulative", None), n),
        "kept": table["kept"].to_numpy(bool),
    }
    e = graph.edges(kept_only=False)
    edges = {
        "prompt": np.full(len(e), prompt, np.int64),
        "target": e["target"].to_numpy(np.int64),
        "source": e["source"].to_numpy(np.int64),
        "weight": e["weight"].to_numpy(np.float32),
        "kept": e["kept"].to_numpy(bool),
    }
    return nodes, edges


def _per_node(values, n: int) -> np.ndarray:
    """A per-node tensor as float64 (NaN where the graph has none)."""
    if values is None:
        return np.full(n, np.nan)
    return values.double().cpu().numpy()


def prompt_row(graph: Any, prompt: int) -> dict:
    """The prompts row of `graph` (its counts, floor, scores and text; the row offsets are
    the file's)."""
    pruned = graph.node_kept is not None
    scores = {k: float(v) for k, v in graph.scores.items()}
    return {
        "prompt": prompt,
        "layers": graph.n_layers,
        "tokens": graph.n_pos,
        "features": graph.n_features,
        "active_features": int(graph.active_features),
        "kept_nodes": int(graph.node_kept.sum()) if pruned else graph.n_nodes,
        "kept_edges": (
            int(graph.edge_kept.sum())
            if graph.edge_kept is not None
            else int(graph.adjacency._nnz())
        ),
        "floor": float(graph.floor),
        "replacement": scores.get("replacement", math.nan),
        "completeness": scores.get("completeness", math.nan),
        "pruned": pruned,
        "scores": json.dumps(scores),
        "text": graph.prompt or "",
    }


# -- reading -------------------------------------------------------------------------------------
def graph_path(path_or_run: str | Path) -> Path:
    """The HDF5 file of a run directory (its probe.h5) or the file itself."""
    path = Path(path_or_run).expanduser()
    if path.is_dir():
        path = path / "probe.h5"
    if not path.is_file():
        raise DataError(
            f"{str(path_or_run)!r} is neither a run directory holding probe.h5 nor an HDF5 file; "
            "give a run made with graph.transcoders set, or a file AttributionGraph.save wrote"
        )
    return path


def graph_group(f: h5py.File, path: Path) -> h5py.Group:
    if GROUP not in f or "prompts" not in f[GROUP]:
        raise DataError(
            f"{str(path)!r} holds no attribution graphs (/graph); make them with "
            "graph.transcoders=TRANSCODERS on a run, or AttributionGraph.save(path)"
        )
    return f[GROUP]


def prompt_rows(g: h5py.Group) -> pd.DataFrame:
    """/graph/prompts as a table."""
    cols = read_columns(g["prompts"], 0, len(g["prompts/prompt"]))
    return pd.DataFrame({k: cols[k] for k in PROMPT_COLUMNS})


def iter_prompts(path: Path) -> Iterator[tuple[dict, dict, dict]]:
    """(prompts row, node columns, edge columns) of every prompt in `path`'s /graph, one prompt
    in memory at a time, in the order they were written."""
    with h5py.File(path, "r") as f:
        g = graph_group(f, path)
        for row in prompt_rows(g).to_dict("records"):
            nodes = read_columns(g["nodes"], int(row["node_start"]), int(row["nodes"]))
            edges = read_columns(g["edges"], int(row["edge_start"]), int(row["edges"]))
            yield row, nodes, edges


def write_graph(graph: Any, path: str | Path, prompt: int = 0) -> Path:
    """`graph` (an AttributionGraph) alone in a new HDF5 file at `path` (replaced if there), as
    prompt `prompt`; its QK table, where it has one, in /graph_qk as a run writes it
    (probe.graphs.qk_h5)."""
    path = Path(path)
    path.unlink(missing_ok=True)
    attrs = {"scan": json.dumps(graph.scan), "options": "{}", "transcoders": ""}
    with h5py.File(path, "w") as f:
        qk = getattr(graph, "qk", None)
        if qk is not None:  # (first: a run's /graph_qk rows come before the prompt's graph)
            write_qk(f, prompt, qk)
        tables = GroupTables(f, GRAPH, attrs)
        append_graph(tables, prompt, graph)
        tables.mark(True)
    return path
