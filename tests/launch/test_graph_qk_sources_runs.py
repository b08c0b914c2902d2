"""graph.qk_sources=nodes (the cheaper direction), nodes_forward and nodes_backward (the one
named, which the run's traced table takes) in a run: graph_qk.csv holds the table
`qk_table(sources=...)` gives for the graph the attribution makes of the same tokens outside
the run; a bad value exits 2 by name before the model runs."""

from __future__ import annotations

import pandas as pd
import pytest

from probe.graphs import qk_sources
from probe.graphs.qk_h5 import QK_CSV
from probe.launch.parts import attribution_graphs
from tests.launch.test_graph_runs import graph_args, named_transcoders, prompts

__all__ = ["prompts"]  # (fixture)


@pytest.mark.parametrize("sources", ["nodes", "nodes_forward", "nodes_backward"])
def test_a_run_writes_the_node_traced_qk_table_as_the_api_computes_it(
    cli_here, tiny_gpt2, prompts, tmp_path, monkeypatch, sources
):
    from transformers import AutoModelForCausalLM

    from probe.graphs.attribution import GraphOptions, attribute
    from probe.graphs.pruning import prune
    from probe.graphs.qk_attribution import qk_table

    root, tokens = prompts
    transcoders = named_transcoders()
    monkeypatch.setattr(attribution_graphs, "load_transcoder_set", lambda p: transcoders)
    args = ("graph.qk=2", "graph.qk_rows=6", f"graph.qk_sources={sources}", "dataset.num_samples=1")
    taken = []  # (direction taken, the cheaper by the estimate) of each traced table
    made = qk_sources.NodeSources.__init__

    def spy(self, *a, **k):
        made(self, *a, **k)
        taken.append((self.direction, self.cost.cheaper))

    monkeypatch.setattr(qk_sources.NodeSources, "__init__", spy)
    code, text = cli_here(*graph_args(tiny_gpt2, root, *args))
    named = {"nodes_forward": "forward", "nodes_backward": "backward"}.get(sources)
    assert taken and all(d == (named or cheaper) for d, cheaper in taken), taken
    assert code == 0, text
    got = pd.read_csv(tmp_path / "run" / QK_CSV, keep_default_na=False)
    for side in ("query_part", "key_part"):  # no attention write left whole
        assert not got[side].str.fullmatch(r"attn \d+@\d+").any()
    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2[0]).eval()
    graph = prune(attribute(model, tokens[0], transcoders, GraphOptions()), 0.8, 0.98)
    want = qk_table(model, graph, transcoders, keys=2, rows=6, sources=sources)
    here = got[got["prompt"] == 0].drop(columns="prompt").reset_index(drop=True)
    pd.testing.assert_frame_equal(here, want, check_dtype=False, rtol=1e-5, atol=1e-8)
