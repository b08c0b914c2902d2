"""A prompt's pruned attribution graph as a picture, and report.html's graphs section.

The picture: layers up (the tokens' embeddings at the bottom, row 0; block L's features and
errors at row L + 1; the logits at the top, row n_layers + 1), positions across (the prompt's
tokens as the x labels); the nodes pruning kept, coloured by kind, those of one (row, position)
spread over the cell in node order, LINE to a line and lines stacked within the row (so a cell of
dozens of features is a grid, not a bar); the `top` strongest kept edges between them as lines whose
width grows with |weight| and whose colour is its sign (blue positive, red negative); with
graph.examples, the most influential feature of each cell labelled with its top example's token.

`python -m probe.plot RUN` draws graph_<prompt>.png for the first GRAPH_FIGURES prompts of a
run holding /graph; report.html's graphs section shows them with graph_scores.csv and the
top of graph_features.csv, each feature with its top activating examples among the run's
prompts (from graph_nodes.csv: the tokens before the position where it was most active) and,
with graph.examples, among the dataset's (its example file).
"""

from __future__ import annotations

import html
from pathlib import Path

import numpy as np
import pandas as pd

from probe.graphs.attribution_graph import AttributionGraph

GRAPH_FIGURES = 3  # prompts drawn by python -m probe.plot and shown in report.html
TOP_EDGES = 150
COLOURS = {"token": "#7f7f7f", "feature": "#1f77b4", "error": "#ff7f0e", "logit": "#2ca02c"}
SPREAD = 0.8  # the width of a position's column the nodes of one cell share
LINE = 8  # nodes of one cell side by side before the next line
HEIGHT = 0.6  # the height of a row the lines of one cell share


def node_positions(graph: AttributionGraph) -> pd.DataFrame:
    """The drawn nodes (pruning's kept ones; every node of an unpruned graph): the node table's
    rows with `x` (position, spread within the cell) and `y` (row: layer + 1, lines of a crowded
    cell spread within HEIGHT of it)."""
    nodes = graph.nodes()
    nodes = nodes[nodes["kept"]].copy()
    row = (nodes["layer"] + 1).astype(float)
    cell = nodes.assign(row=row).groupby(["row", "pos"])["node"]
    rank = cell.rank(method="first").to_numpy().astype(int) - 1
    count = cell.transform("size").to_numpy()
    lines = -(-count // LINE)  # (ceil)
    line, column = rank // LINE, rank % LINE
    across = np.minimum(count, LINE)  # nodes on a full line of the cell
    nodes["x"] = nodes["pos"].to_numpy() + (column - (across - 1) / 2) * (SPREAD / across)
    nodes["y"] = row.to_numpy() + (line - (lines - 1) / 2) * (HEIGHT / lines)
    return nodes


def drawn_edges(graph: AttributionGraph, drawn: pd.DataFrame, top: int = TOP_EDGES) -> pd.DataFrame:
    """The `top` strongest (|weight|) kept edges between drawn nodes, strongest first."""
    edges = graph.edges(kept_only=True)
    inside = set(drawn["node"])
    edges = edges[edges["target"].isin(inside) & edges["source"].isin(inside)]
    order = np.argsort(-edges["weight"].abs().to_numpy(), kind="stable")
    return edges.iloc[order[:top]].reset_index(drop=True)


def graph_figure(graph: AttributionGraph, title: str = "", top: int = TOP_EDGES,
                 labels: dict[tuple[int, int], str] | None = None):  # fmt: skip
    """The figure of `graph` (see the module's docstring); `labels` {(layer, feature): text}
    name the most influential feature of each (row, position) cell that has one."""
    import matplotlib.pyplot as plt
    from matplotlib.collections import LineCollection

    nodes = node_positions(graph)
    edges = drawn_edges(graph, nodes, top)
    at = nodes.set_index("node")[["x", "y"]]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * graph.n_pos + 2), 1.1 * graph.n_layers + 3.5))
    if len(edges):
        w = edges["weight"].to_numpy()
        src, dst = at.loc[edges["source"]].to_numpy(), at.loc[edges["target"]].to_numpy()
        segments = np.stack([src, dst], 1)
        widths = 0.3 + 3.0 * np.abs(w) / np.abs(w).max()
        colours = np.where(w[:, None] >= 0, [[0.13, 0.4, 0.8, 0.6]], [[0.84, 0.15, 0.16, 0.6]])
        # (matplotlib's stub wants a Sequence of lines: an (edges, 2, 2) array is one at run time)
        lines = LineCollection(segments, linewidths=widths, colors=colours, zorder=1, label="edges")  # type: ignore[arg-type]
        ax.add_collection(lines)
    for kind, colour in COLOURS.items():
        part = nodes[nodes["kind"] == kind]
        if len(part):
            ax.scatter(part["x"], part["y"], s=28, c=colour, label=kind, zorder=2,
                       edgecolors="black", linewidths=0.3)  # fmt: skip
    for row in labelled(nodes, labels or {}).itertuples():
        ax.annotate(row.label, (row.x, row.y), xytext=(4, 4), textcoords="offset points",
                    fontsize=6, color="#1f77b4")  # fmt: skip
    for row in nodes[nodes["kind"] == "logit"].itertuples():
        ax.annotate(repr(str(row.token)), (row.x, row.y), xytext=(0, 6),
                    textcoords="offset points", ha="center", fontsize=7, rotation=30)  # fmt: skip
    ax.set_xticks(range(graph.n_pos), [str(t) for t in graph.token_strings], rotation=45,
                  ha="right", fontsize=8)  # fmt: skip
    rows = ["tokens", *(f"L{i}" for i in range(graph.n_layers)), "logits"]
    ax.set_yticks(range(graph.n_layers + 2), rows)
    ax.set_xlim(-0.6, graph.n_pos - 0.4)
    ax.set_ylim(-0.6, graph.n_layers + 1.8)
    scores = ", ".join(f"{k} {v:.3f}" for k, v in graph.scores.items())
    ax.set_title(f"{title}\n{len(nodes)} nodes, the {len(edges)} strongest edges"
                 + (f"; {scores}" if scores else ""), fontsize=9)  # fmt: skip
    ax.legend(loc="upper left", fontsize=7, framealpha=0.7)
    fig.tight_layout()
    return fig


def labelled(nodes: pd.DataFrame, labels: dict[tuple[int, int], str]) -> pd.DataFrame:
    """The drawn feature nodes to label: per (row, position) cell, its most influential feature
    that `labels` names, with its `label`."""
    feats = nodes[nodes["kind"] == "feature"].copy()
    keys = zip(feats["layer"].astype(int), feats["feature"].astype(int), strict=True)
    feats["label"] = [labels.get(k) for k in keys]
    feats = feats[feats["label"].notna()]
    if feats.empty:
        return feats
    order = feats.sort_values("influence", ascending=False, na_position="last")
    return order.groupby(["layer", "pos"], sort=False).head(1)


def example_labels(run_dir: Path) -> dict[tuple[int, int], str]:
    """{(layer, feature): its top example's token} from a run's graph.examples files ({} without
    them)."""
    import json

    from probe.graphs.graph_json import cantor_unpairing

    folder = Path(run_dir) / "graph_json" / "features"
    out = {}
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        examples = json.loads(path.read_text())["examples_quantiles"][0]["examples"]
        if examples:
            best = examples[0]
            out[cantor_unpairing(int(path.stem))] = repr(best["tokens"][best["train_token_ind"]])
    return out


def run_prompts(run_dir: Path) -> list[int]:
    """The prompts whose graphs a run's probe.h5 holds ([] without /graph)."""
    import h5py

    from probe.graphs.graph_h5 import GROUP, prompt_rows

    path = Path(run_dir) / "probe.h5"
    if not path.is_file():
        return []
    with h5py.File(path, "r") as f:
        if GROUP not in f or "prompts" not in f[GROUP]:
            return []
        return [int(p) for p in prompt_rows(f[GROUP])["prompt"]]


def graph_figures(run_dir: Path, title: str = "", count: int = GRAPH_FIGURES) -> dict:
    """{graph_<prompt>.png: Figure} of the run's first `count` prompts' graphs."""
    from probe.graphs.graph_files import load_graph

    labels = example_labels(run_dir)
    return {
        f"graph_{p}.png": graph_figure(
            load_graph(run_dir, p), f"prompt {p} | {title}", labels=labels
        )  # fmt: skip
        for p in run_prompts(run_dir)[:count]
    }


def section(run_dir: Path, figures: dict | None = None, top: int = 20) -> str:
    """report.html's graphs section ('' for a run without graphs): the first prompts' pictures
    (`figures`, else drawn here), the scores per prompt (graph_scores.csv) and the features in
    most pruned graphs (graph_features.csv)."""
    from probe.report.html_parts import figure_png, img

    run_dir = Path(run_dir)
    prompts = run_prompts(run_dir)
    if not prompts:
        return ""
    parts = [f"<h3>Attribution graphs</h3><p>{len(prompts)} prompts; the pruned graphs of the "
             f"first {min(len(prompts), GRAPH_FIGURES)}.</p>"]  # fmt: skip
    for name, fig in (graph_figures(run_dir) if figures is None else figures).items():
        parts.append(img(figure_png(fig), name))
    scores = run_dir / "graph_scores.csv"
    if scores.is_file():
        frame = pd.read_csv(scores).head(top)
        parts.append("<h4>Scores per prompt (graph_scores.csv)</h4>"
                     + frame.to_html(index=False, border=0))  # fmt: skip
    features = run_dir / "graph_features.csv"
    if features.is_file():
        frame = pd.read_csv(features).head(top)
        nodes = run_dir / "graph_nodes.csv"
        if nodes.is_file() and len(frame):
            found = feature_examples(pd.read_csv(nodes, keep_default_na=False,
                                                 na_values={"activation": [""]}), frame)  # fmt: skip
            frame["top examples"] = [found.get((int(a), int(b)), "") for a, b in
                                     zip(frame["layer"], frame["feature"], strict=True)]  # fmt: skip
        files = run_dir / "graph_json" / "features"
        if files.is_dir() and len(frame):
            frame["dataset examples"] = [dataset_examples(files, int(a), int(b)) for a, b in
                                         zip(frame["layer"], frame["feature"], strict=True)]  # fmt: skip
        parts.append(f"<h4>Features in most pruned graphs, the first {top} (graph_features.csv; "
                     "top examples: the prompts' tokens where each was most active, the token "
                     "in bold; dataset examples: graph.examples' top activations)</h4>" + frame.to_html(index=False, border=0, escape=False))  # fmt: skip
    return "".join(parts)


def dataset_examples(folder: Path, layer: int, feature: int, k: int = 3, before: int = 6) -> str:
    """HTML of a feature's `k` best examples from its graph.examples file (the `before` tokens
    and the token in bold, with the activation); '' without a file."""
    import json

    from probe.graphs.graph_json import cantor_pairing

    path = Path(folder) / f"{cantor_pairing(layer, feature)}.json"
    if not path.is_file():
        return ""
    examples = json.loads(path.read_text())["examples_quantiles"][0]["examples"][:k]
    shown = []
    for ex in examples:
        i = ex["train_token_ind"]
        text = html.escape("".join(ex["tokens"][max(0, i - before) : i]))
        shown.append(
            f"{text}<b>{html.escape(ex['tokens'][i])}</b> ({ex['tokens_acts_list'][i]:.2f})"
        )
    return "<br>".join(shown)


def feature_examples(nodes: pd.DataFrame, features: pd.DataFrame, k: int = 3,
                     context: int = 6) -> dict[tuple[int, int], str]:  # fmt: skip
    """{(layer, feature): HTML} of each feature's `k` largest activations among the run's
    attributed feature nodes (graph_nodes.csv): the `context` tokens before the position and
    the token itself in bold, with the activation."""
    wanted = set(zip(features["layer"].astype(int), features["feature"].astype(int), strict=True))
    feats = nodes[nodes["kind"] == "feature"]
    keys = list(zip(feats["layer"].astype(int), feats["feature"].astype(int), strict=True))
    feats = feats[[key in wanted for key in keys]]
    tokens = nodes[nodes["kind"] == "token"].sort_values(["prompt", "pos"])
    text = {p: [str(t) for t in group["token"]] for p, group in tokens.groupby("prompt")}
    out: dict[tuple[int, int], str] = {}
    for (layer, feature), rows in feats.groupby(["layer", "feature"]):
        best = rows.sort_values("activation", ascending=False).head(k)
        shown = []
        for row in best.itertuples():
            words = text.get(row.prompt, [])
            pos = int(row.pos)
            joiner = " " if all(w.isdigit() for w in words) else ""
            before = html.escape(joiner.join(words[max(0, pos - context) : pos]))
            at = html.escape(words[pos] if pos < len(words) else "?")
            shown.append(f"{before}<b>{at}</b> ({row.activation:.2f}, prompt {row.prompt})")
        out[(int(layer), int(feature))] = "<br>".join(shown)
    return out
