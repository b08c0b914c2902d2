"""The QK attribution in a run (graph.qk): graph_qk.csv holds, per prompt, the table
`qk_table` gives for the graph the attribution makes of the same tokens outside the run; the
viewer JSON carries it as qk_tracing_results; bad graph.qk and graph.qk_rows exit 2 by name
before the model runs."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from probe.graphs.qk_h5 import QK_CSV
from probe.launch.parts import attribution_graphs
from tests.launch.test_error_catalogue import assert_words
from tests.launch.test_graph_runs import graph_args, named_transcoders, prompts, stand_in

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
    ],
)
def test_bad_qk_keys_exit_2_by_name_before_the_model_runs(
    cli_here, tiny_gpt2, prompts, stand_in, tmp_path, args, words
):
    code, text = cli_here(*graph_args(tiny_gpt2, prompts[0]), *args)
    assert code == 2, text
    assert_words(text, *words)
    assert not stand_in and not (tmp_path / "run" / "probe.h5").exists()
