"""The picture of a pruned attribution graph: what the axes hold (node positions by kind, the
edges drawn, the tokens as x labels) equals the graph's pruned node and edge tables, and
python -m probe.plot's figures and the report section of a file holding /graph draw them."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
import transformers

from probe.graphs.attribution import GraphOptions, attribute
from probe.graphs.graph_files import save_graph
from probe.graphs.pruning import prune
from probe.report.graph_figure import feature_examples, graph_figure, graph_figures, section
from probe.testing.random_transcoders import random_transcoders
from probe.testing.tiny_lms import TASK_CLASSES, make_tiny

pytest.importorskip("matplotlib")
PROMPT = torch.tensor([3, 7, 12, 9, 20, 5, 14])


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    folder = make_tiny("gpt2", tmp_path_factory.mktemp("gpt2"))
    model = getattr(transformers, TASK_CLASSES["gpt2"]).from_pretrained(folder).eval()
    g = attribute(model, PROMPT, random_transcoders(), GraphOptions(batch_size=64))
    g.token_strings = [f"t{i}" for i in PROMPT.tolist()]
    return prune(g, 0.8, 0.98)


def test_drawn_nodes_and_edges_are_the_pruned_tables(graph):
    import matplotlib.pyplot as plt
    from matplotlib.collections import LineCollection, PathCollection

    fig = graph_figure(graph, "t", top=40)
    ax = fig.axes[0]
    nodes = graph.nodes()
    kept = nodes[nodes["kept"]]
    drawn = {
        c.get_label(): c.get_offsets() for c in ax.collections if isinstance(c, PathCollection)
    }
    assert set(drawn) == set(kept["kind"])
    at = {}
    for kind, offsets in drawn.items():
        part = kept[kept["kind"] == kind]
        assert len(offsets) == len(part)
        # rows: layer + 1 (tokens 0, logits n_layers + 1), a crowded cell's lines within 0.3 of
        # it; x within 0.4 of the position
        assert np.all(np.abs(offsets[:, 1] - (part["layer"].to_numpy() + 1)) <= 0.3)
        assert np.all(np.abs(offsets[:, 0] - part["pos"].to_numpy()) <= 0.4)
        at.update({n: tuple(xy) for n, xy in zip(part["node"], offsets, strict=True)})
    assert len(set(at.values())) == len(at)  # no two nodes on one spot
    # edges: the 40 strongest kept edges between kept nodes, from source to target
    edges = graph.edges()
    edges = edges[edges["source"].isin(at) & edges["target"].isin(at)]
    strongest = edges.iloc[np.argsort(-edges["weight"].abs().to_numpy(), kind="stable")[:40]]
    (lines,) = [c for c in ax.collections if isinstance(c, LineCollection)]
    segments = lines.get_segments()
    assert len(segments) == min(40, len(edges)) > 0
    want = [(at[s], at[t]) for s, t in zip(strongest["source"], strongest["target"], strict=True)]
    np.testing.assert_allclose(np.array(segments), np.array(want))
    colours = lines.get_colors()
    assert np.all((colours[:, 2] > colours[:, 0]) == (strongest["weight"].to_numpy() >= 0))
    assert [t.get_text() for t in ax.get_xticklabels()] == graph.token_strings
    plt.close(fig)


def test_a_crowded_cell_is_a_grid():
    """20 features of one (layer, position): lines of LINE side by side, 3 lines stacked, no two
    on one spot, every one within the cell."""
    from probe.report import graph_figure as gf

    class Crowded:
        def nodes(self):
            return pd.DataFrame({"node": range(21), "kind": ["feature"] * 20 + ["logit"],
                                 "layer": [1] * 20 + [2], "pos": [4] * 21, "kept": True})  # fmt: skip

    drawn = gf.node_positions(Crowded())  # type: ignore[arg-type]
    cell = drawn[drawn["kind"] == "feature"]
    assert sorted(np.round(cell["y"], 6).unique()) == pytest.approx([1.8, 2.0, 2.2])
    assert (cell.groupby("y").size().to_numpy() == [8, 8, 4]).all()
    assert len(set(zip(cell["x"], cell["y"], strict=True))) == 20
    assert cell["x"].between(4 - 0.4, 4 + 0.4).all()
    assert drawn[drawn["kind"] == "logit"][["x", "y"]].to_numpy().tolist() == [[4.0, 3.0]]


def test_a_files_graphs_are_drawn_and_reported(graph, tmp_path):
    save_graph(graph, tmp_path / "probe.h5", prompt=0)
    made = graph_figures(tmp_path, "run")
    assert list(made) == ["graph_0.png"]
    (graph_scores := tmp_path / "graph_scores.csv").write_text("prompt,replacement\n0,0.5\n")
    page = section(tmp_path, made)
    assert "Attribution graphs" in page and "graph_0.png" in page and "graph_scores.csv" in page
    assert graph_scores.is_file()
    assert section(tmp_path / "nothing") == ""


def test_top_examples_are_the_largest_activations_with_their_tokens():
    nodes = pd.DataFrame({
        "prompt": [0, 0, 0, 1, 1, 1, 0, 1, 1],
        "kind": ["token", "token", "token", "token", "token", "token", "feature", "feature",
                 "feature"],
        "layer": [-1, -1, -1, -1, -1, -1, 1, 1, 1],
        "pos": [0, 1, 2, 0, 1, 2, 1, 2, 0],
        "feature": [-1, -1, -1, -1, -1, -1, 7, 7, 7],
        "token": ["a", " cat", " sat", "the", " dog", " ran", "", "", ""],
        "activation": [np.nan] * 6 + [2.0, 3.5, 1.0],
    })  # fmt: skip
    found = feature_examples(nodes, pd.DataFrame({"layer": [1], "feature": [7]}), k=2)
    assert found == {(1, 7): "the dog<b> ran</b> (3.50, prompt 1)<br>a<b> cat</b> (2.00, prompt 0)"}
