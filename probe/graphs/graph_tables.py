"""A run's graph tables from its /graph (probe.graphs.graph_files), one prompt in memory at a
time: graph_nodes.csv, graph_edges.csv (the pruned graph's edges, or all), graph_scores.csv
(one row per prompt) and graph_features.csv (each transcoder feature across the prompts'
pruned graphs)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from probe.graphs.graph_data import EDGE_COLUMNS, KINDS, NODE_COLUMNS
from probe.graphs.graph_h5 import iter_prompts

NODES_CSV = "graph_nodes.csv"
EDGES_CSV = "graph_edges.csv"
SCORES_CSV = "graph_scores.csv"
FEATURES_CSV = "graph_features.csv"
SCORE_COLUMNS = ("prompt", "tokens", "active_features", "features", "nodes", "edges",
                 "kept_nodes", "kept_edges", "replacement", "completeness")  # fmt: skip
FEATURE_COLUMNS = ("layer", "feature", "prompts", "prompt_share", "nodes", "mean_influence",
                   "max_influence", "mean_activation", "max_activation")  # fmt: skip
_SUMS = ("nodes", "influence_sum", "influence_max", "activation_sum", "activation_max")


def write_graph_tables(h5_path: Path, run_dir: Path, edges: str = "pruned") -> list[Path]:
    """The four tables of the graphs in `h5_path`, written into `run_dir`; `edges`: pruned (the
    kept edges) or all (every stored edge) in graph_edges.csv. Returns the paths."""
    paths = [run_dir / n for n in (NODES_CSV, EDGES_CSV, SCORES_CSV, FEATURES_CSV)]
    parts, scores = [], []
    with open(paths[0], "w", newline="") as nodes_out, open(paths[1], "w", newline="") as e_out:
        pd.DataFrame(columns=["prompt", *NODE_COLUMNS]).to_csv(nodes_out, index=False)
        pd.DataFrame(columns=["prompt", *EDGE_COLUMNS]).to_csv(e_out, index=False)
        for row, n, e in iter_prompts(h5_path):
            node_table = node_frame(n)
            node_table.to_csv(nodes_out, header=False, index=False)
            edge_table = pd.DataFrame({c: e[c] for c in ("prompt", *EDGE_COLUMNS)})
            if edges == "pruned":
                edge_table = edge_table[edge_table["kept"]]
            edge_table.to_csv(e_out, header=False, index=False)
            parts.append(prompt_features(node_table))
            scores.append({k: row[k] for k in SCORE_COLUMNS})
    pd.DataFrame(scores, columns=list(SCORE_COLUMNS)).to_csv(paths[2], index=False)
    feature_table(parts, len(scores)).to_csv(paths[3], index=False)
    return paths


def node_frame(columns: dict) -> pd.DataFrame:
    """graph_nodes.csv's rows of one prompt's node columns (kind by name)."""
    table = pd.DataFrame({c: columns[c] for c in ("prompt", *NODE_COLUMNS) if c != "kind"})
    table.insert(2, "kind", np.asarray(KINDS, dtype=object)[columns["kind"].astype(np.int64)])
    return table


def prompt_features(nodes: pd.DataFrame) -> pd.DataFrame:
    """One prompt's kept feature nodes summed per (layer, feature): count, influence and
    activation sums and maxima."""
    kept = nodes[(nodes["kind"] == "feature") & nodes["kept"]]
    grouped = kept.groupby(["layer", "feature"])
    return pd.DataFrame({
        "nodes": grouped.size(),
        "influence_sum": grouped["influence"].sum(),
        "influence_max": grouped["influence"].max(),
        "activation_sum": grouped["activation"].sum(),
        "activation_max": grouped["activation"].max(),
    })  # fmt: skip


def feature_table(parts: list[pd.DataFrame], prompts: int) -> pd.DataFrame:
    """graph_features.csv from the prompts' `prompt_features`: per (layer, feature), in how
    many prompts' pruned graphs it is (`prompts`, and that share of all prompts), at how many
    nodes (positions, over all prompts), the mean and largest influence and activation over
    those nodes; most prompts first, then the larger mean influence."""
    parts = [p for p in parts if len(p)]
    if not parts:
        return pd.DataFrame(columns=list(FEATURE_COLUMNS))
    every = pd.concat(parts)
    by = every.groupby(level=["layer", "feature"])
    sums = by[["nodes", "influence_sum", "activation_sum"]].sum()
    table = pd.DataFrame({
        "prompts": by.size(),
        "prompt_share": by.size() / max(prompts, 1),
        "nodes": sums["nodes"],
        "mean_influence": sums["influence_sum"] / sums["nodes"],
        "max_influence": by["influence_max"].max(),
        "mean_activation": sums["activation_sum"] / sums["nodes"],
        "max_activation": by["activation_max"].max(),
    }).reset_index()  # fmt: skip
    order = ["prompts", "mean_influence", "layer", "feature"]
    table = table.sort_values(order, ascending=[False, False, True, True], kind="stable")
    return table[list(FEATURE_COLUMNS)].reset_index(drop=True)
