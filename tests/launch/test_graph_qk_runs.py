"""The QK attribution in a run (graph.qk): graph_qk.csv holds, per prompt, the table
`qk_table` gives for the graph the attribution makes of the same tokens outside the run; the
viewer JSON carries it as qk_tracing_results; a run cut short between a prompt's QK table and
its graph resumes to the files of an uninterrupted one; bad graph.qk and graph.qk_rows exit 2
by name before the model runs. (Two torchrun ranks: tests/launch/test_graph_runs.py.)"""

from __future__ import annotations

import json

import h5py
import numpy as np
import pandas as pd
import pytest

from probe.errors import DataError
from probe.graphs.qk_h5 import QK_CSV
from probe.launch.parts import attribution_graphs
from probe.testing.toy_graphs import toy_qk
from tests.launch.test_error_catalogue import assert_words
from tests.launch.test_graph_runs import (
    FILES,
    graph_args,
    graph_file,
    named_transcoders,
    prompts,
    read,
    stand_in,
)

__all__ = ["prompts", "stand_in"]  # (fixtures)


def test_a_run_writes_each_prompts_qk_table_as_the_api_computes_it(
    cli_here, tiny_gpt2, prompts, tmp_path, monkeypatch
):
    from transformers import AutoModelForCausalLM

    from probe.graphs.attribution import GraphOptions, attribute
    from probe.graphs.pruning import prune
    from probe.graphs.qk_attribution import qk_table

    root, tokens = prompts
    transcoders = named_transcoders()
    monkeypatch.setattr(attribution_graphs, "load_transcoder_set", lambda p: transcoders)
    code, text = cli_here(
        *graph_args(tiny_gpt2, root, "graph.qk=2", "graph.qk_rows=6", "dataset.num_samples=2")
    )
    assert code == 0, text
    run_dir = tmp_path / "run"
    got = pd.read_csv(run_dir / QK_CSV, keep_default_na=False)
    assert sorted(set(got["prompt"])) == [0, 1]
    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2[0]).eval()
    for i in (1,):  # (a padded prompt)
        graph = prune(attribute(model, tokens[i], transcoders, GraphOptions()), 0.8, 0.98)
        want = qk_table(model, graph, transcoders, keys=2, rows=6)
        here = got[got["prompt"] == i].drop(columns="prompt").reset_index(drop=True)
        pd.testing.assert_frame_equal(here, want, check_dtype=False, rtol=1e-5, atol=1e-8)
    data = json.loads((run_dir / "graph_json" / "prompt_1.json").read_text())
    traced = [n for n in data["nodes"] if "qk_tracing_results" in n]
    assert (
        len(traced)
        == got[got["prompt"] == 1].groupby(["layer", "head", "query_pos", "key_pos"]).ngroups
    )


@pytest.mark.parametrize(
    "args, words",
    [
        (["graph.qk=-1"], ["graph.qk=-1 must be at least 0"]),
        (["graph.qk=2", "graph.qk_rows=0"], ["graph.qk_rows=0 must be at least 1", "null"]),
        (
            ["graph.qk=2", "graph.qk_sources=everything"],
            ["graph.qk_sources='everything'", "position", "nodes"],
        ),
    ],
)
def test_bad_qk_keys_exit_2_by_name_before_the_model_runs(
    cli_here, tiny_gpt2, prompts, stand_in, tmp_path, args, words
):
    code, text = cli_here(*graph_args(tiny_gpt2, prompts[0]), *args)
    assert code == 2, text
    assert_words(text, *words)
    assert not stand_in and not (tmp_path / "run" / "probe.h5").exists()


def test_a_run_cut_between_a_qk_table_and_its_graph_resumes_to_an_uninterrupted_ones_files(
    cli_here, tiny_gpt2, prompts, stand_in, tmp_path, monkeypatch
):
    """The third prompt's QK table is in /graph_qk when the run fails writing its graph: the
    file keeps two graphs and three tables; resume=true makes the other three graphs and the
    other two tables (none twice), and /graph, /graph_qk, graph_qk.csv, the tables and the
    viewer JSON equal a run never stopped."""
    root, tokens = prompts
    args = graph_args(tiny_gpt2, root, "graph.qk=2")
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert cli_here(*args, run_dir=whole)[0] == 0
    tabled: list[list[int]] = []

    def qk_of(model, graph, *rest):
        tabled.append(graph.tokens.tolist())
        return toy_qk(graph)

    append_graph = attribution_graphs.append_graph

    def fails_at_the_third(out, prompt, graph):
        if prompt == 2:
            raise DataError("the disk failed while writing prompt 2's graph")
        return append_graph(out, prompt, graph)

    monkeypatch.setattr(attribution_graphs, "qk_of", qk_of)
    monkeypatch.setattr(attribution_graphs, "append_graph", fails_at_the_third)
    code, text = cli_here(*args, run_dir=cut)
    assert code == 2 and "the disk failed" in text, text
    with h5py.File(cut / "probe.h5") as f:
        assert list(f["graph/prompts/prompt"][:]) == [0, 1]
        assert list(f["graph_qk/prompts/prompt"][:]) == [0, 1, 2]
    monkeypatch.setattr(attribution_graphs, "append_graph", append_graph)
    stand_in.clear()
    tabled.clear()
    code, text = cli_here(*args, "resume=true", run_dir=cut)
    assert code == 0, text
    assert stand_in == [t.tolist() for t in tokens[2:]]
    assert tabled == [t.tolist() for t in tokens[3:]]  # (the third's table was whole)
    for name in (*FILES, QK_CSV):
        pd.testing.assert_frame_equal(read(cut, name), read(whole, name))
    for group in ("graph", "graph_qk"):
        a, b = graph_file(whole, group), graph_file(cut, group)
        assert a.keys() == b.keys()
        for name in a:
            np.testing.assert_array_equal(a[name], b[name], err_msg=f"{group}/{name}")
    for i in range(len(tokens)):
        name = f"graph_json/prompt_{i}.json"
        assert json.loads((cut / name).read_text()) == json.loads((whole / name).read_text())
    with h5py.File(cut / "probe.h5") as f:
        assert f.attrs["complete"] and f["graph_qk"].attrs["complete"]
