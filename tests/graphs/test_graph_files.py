"""/graph in HDF5: a graph saved and loaded back has the same node and edge tables, prompts
appended one by one read back each as it was, and a write cut short is cut off on reopening."""

from __future__ import annotations

import h5py
import numpy as np
import pandas as pd
import pytest
import torch

from probe.errors import DataError
from probe.graphs.graph_files import load_graph
from probe.graphs.graph_h5 import GRAPH, append_graph, graph_rows
from probe.graphs.graph_tables import feature_table, prompt_features
from probe.store.groups import GroupTables, _extend
from probe.testing.toy_graphs import toy_graph, toy_prune


def prompts(n: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 40, (4 + i,), generator=g) for i in range(n)]


def same_graph(a, b) -> None:
    pd.testing.assert_frame_equal(a.nodes(), b.nodes())
    pd.testing.assert_frame_equal(a.edges(kept_only=False), b.edges(kept_only=False))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logit_tokens, b.logit_tokens)
    assert a.scores == b.scores and a.floor == b.floor and a.prompt == b.prompt
    assert a.active_features == b.active_features and a.n_layers == b.n_layers
    for name in ("influence", "cumulative", "node_kept", "edge_kept"):
        x, y = getattr(a, name, None), getattr(b, name, None)
        assert (x is None) == (y is None), name
        if x is not None:
            torch.testing.assert_close(y, x, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("pruned", [True, False])
def test_a_saved_graph_loads_back_equal(tmp_path, pruned):
    graph = toy_graph(prompts(1)[0], names=lambda ids: [f"t{i}" for i in ids])
    graph.prompt, graph.scan = "a prompt", ["tc0", "tc1"]
    if pruned:
        graph = toy_prune(graph)
    path = graph.save(tmp_path / "one.h5")
    back = load_graph(path)
    same_graph(graph, back)
    assert back.scan == ["tc0", "tc1"]
    assert (back.influence is None) == (not pruned)
    if pruned:
        assert torch.equal(back.edge_kept, graph.edge_kept)
        assert torch.equal(back.adjacency.to_dense(), graph.adjacency.to_dense())


def test_prompts_appended_read_back_each_and_a_missing_one_is_named(tmp_path):
    graphs = [toy_prune(toy_graph(t)) for t in prompts()]
    path = tmp_path / "run.h5"
    with h5py.File(path, "w") as f:
        out = GroupTables(f, GRAPH, {"options": "{}"})
        written = [append_graph(out, 10 + i, g) for i, g in enumerate(graphs)]
    for i, g in enumerate(graphs):
        same_graph(g, load_graph(path, 10 + i))
    with pytest.raises(
        DataError, match=r"holds no graph of prompt 0; it holds prompts \[10, 11, 12\]"
    ):
        load_graph(path, 0)
    with h5py.File(path) as f:  # the rows of each prompt lie where its prompts row says
        nodes = f["graph/prompts/nodes"][:]
        assert list(nodes) == [g.n_nodes for g in graphs]
        assert list(f["graph/prompts/node_start"][:]) == [0, *np.cumsum(nodes)[:-1]]
        assert len(f["graph/edges/weight"]) == sum(g.adjacency._nnz() for g in graphs)
        # each prompt's bytes (what a run's size projection counts): its node and edge rows
        stored = 0
        for table in ("nodes", "edges"):
            for ds in f[f"graph/{table}"].values():
                values = ds[:]
                stored += sum(len(v) for v in values) if ds.dtype.kind == "O" else values.nbytes
        assert sum(written) == stored and min(written) > 0


def test_a_write_cut_short_is_cut_off_when_the_file_is_opened_again(tmp_path):
    graphs = [toy_prune(toy_graph(t)) for t in prompts()]
    whole, cut = tmp_path / "whole.h5", tmp_path / "cut.h5"
    with h5py.File(whole, "w") as f:
        out = GroupTables(f, GRAPH, {})
        for i, g in enumerate(graphs):
            append_graph(out, i, g)
    with h5py.File(cut, "w") as f:
        out = GroupTables(f, GRAPH, {})
        for i, g in enumerate(graphs[:2]):
            append_graph(out, i, g)
        nodes, edges = graph_rows(graphs[2], 2)  # the third's rows, without its prompts row
        _extend(out.group["nodes"], nodes)
        _extend(out.group["edges"], {k: v[:5] for k, v in edges.items()})
    with h5py.File(cut, "a") as f:
        out = GroupTables(f, GRAPH, {})
        assert out.keys == [0, 1]
        append_graph(out, 2, graphs[2])
    with h5py.File(whole) as a, h5py.File(cut) as b:
        for table in ("prompts", "nodes", "edges"):
            for name, ds in a[f"graph/{table}"].items():
                np.testing.assert_array_equal(ds[:], b[f"graph/{table}/{name}"][:])


def test_a_file_without_graphs_is_named(tmp_path):
    with h5py.File(tmp_path / "probe.h5", "w") as f:
        f.attrs["x"] = 1
    with pytest.raises(DataError, match="holds no attribution graphs"):
        load_graph(tmp_path)
    with pytest.raises(DataError, match="neither a run directory"):
        load_graph(tmp_path / "nothing")


def test_the_feature_table_is_the_kept_feature_nodes_grouped():
    graphs = [toy_prune(toy_graph(t)) for t in prompts(4)]
    tables = []
    for i, g in enumerate(graphs):
        t = g.nodes()
        t.insert(0, "prompt", i)
        tables.append(t)
    got = feature_table([prompt_features(t) for t in tables], len(tables))
    nodes = pd.concat(tables)
    kept = nodes[(nodes["kind"] == "feature") & nodes["kept"]]
    by = kept.groupby(["layer", "feature"])
    want = pd.DataFrame({
        "prompts": by["prompt"].nunique(), "nodes": by.size(),
        "mean_influence": by["influence"].mean(), "max_influence": by["influence"].max(),
        "mean_activation": by["activation"].mean(), "max_activation": by["activation"].max(),
    }).reset_index()  # fmt: skip
    got = got.sort_values(["layer", "feature"]).reset_index(drop=True)
    assert len(got) == len(want) > 3
    for column in want.columns:
        np.testing.assert_allclose(got[column].to_numpy(float), want[column].to_numpy(float))
    np.testing.assert_allclose(got["prompt_share"], want["prompts"] / 4)


def test_the_files_kind_codes_are_the_containers_kinds():
    from probe.graphs import graph_data, graph_h5

    assert graph_h5.KINDS == graph_data.KINDS
