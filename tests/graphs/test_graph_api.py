"""probe.attribution_graph: text or ids in, the pruned graph out, equal to attributing the
circuit-tracer-tokenized prompt and pruning it by hand."""

from __future__ import annotations

import pytest
import torch
import transformers

import probe
from probe.errors import ConfigError
from probe.graphs.attribution import GraphOptions, attribute
from probe.graphs.prompt_graph import prompt_tokens
from probe.graphs.pruning import prune
from probe.testing.random_transcoders import random_transcoders as transcoders
from probe.testing.tiny_lms import make_tiny, make_tokenizer


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm")
    tok = transformers.AutoTokenizer.from_pretrained(make_tokenizer(folder / "tok"))
    model = transformers.GPT2LMHeadModel.from_pretrained(make_tiny("gpt2", folder / "m", len(tok)))
    return model.eval(), tok


def test_a_text_prompt_gets_a_special_token_first_and_the_graph_is_attributed_and_pruned(lm):
    model, tok = lm
    ts = transcoders(skip=True)
    graph = probe.attribution_graph(model, "the cat sat on the", ts, tokenizer=tok, floor=0.0,
                                    node_threshold=0.7)  # fmt: skip
    words = tok("the cat sat on the", add_special_tokens=False)["input_ids"]
    assert graph.tokens.tolist() == [tok.bos_token_id, *words]
    assert graph.token_strings[1:] == ["the", "cat", "sat", "on", "the"]
    assert graph.prompt == "the cat sat on the"
    by_hand = prune(attribute(model, graph.tokens, ts, GraphOptions(floor=0.0)), 0.7, 0.98)
    assert torch.equal(graph.node_kept, by_hand.node_kept)
    assert torch.equal(graph.edge_kept, by_hand.edge_kept)
    assert graph.scores == pytest.approx(by_hand.scores)
    nodes = graph.nodes()
    assert list(nodes["kind"].unique()) == ["feature", "error", "token", "logit"]
    assert nodes["kept"].sum() == int(graph.node_kept.sum())
    assert set(graph.logit_strings) <= set(tok.get_vocab())


def test_token_ids_that_begin_with_a_special_token_are_kept_as_they_are(lm):
    _, tok = lm
    assert prompt_tokens([3, 7, 8], tok).tolist() == [3, 7, 8]
    assert prompt_tokens(torch.tensor([[7, 8]]), tok).tolist() == [3, 7, 8]
    assert prompt_tokens([7, 8]).tolist() == [7, 8]


def test_bad_calls_are_refused_by_name(lm):
    model, tok = lm
    with pytest.raises(ConfigError, match="needs its tokenizer"):
        probe.attribution_graph(model, "the cat", transcoders())
    with pytest.raises(ConfigError, match="option.*max_nodes unknown"):
        probe.attribution_graph(model, [3, 7], transcoders(), max_nodes=3)
    with pytest.raises(ConfigError, match="transcoders is a dict"):
        probe.attribution_graph(model, [3, 7], {})


def test_transcoders_from_a_yaml_folder_give_the_same_graph(lm, tmp_path):
    from probe.models import transcoder_files

    model, tok = lm
    ts = transcoders(skip=True)
    transcoder_files.save_transcoders(ts, tmp_path / "set")
    loaded = probe.attribution_graph(model, [3, 7, 8, 9], tmp_path / "set", floor=0.0)
    given = probe.attribution_graph(model, [3, 7, 8, 9], ts, floor=0.0)
    torch.testing.assert_close(loaded.adjacency.to_dense(), given.adjacency.to_dense())
