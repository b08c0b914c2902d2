"""Attribution graphs as a run feature: the run's files hold each prompt's graph as the graph's
own tables give it, graph_features.csv is a groupby of graph_nodes.csv, a stopped run resumes
to the files of an uninterrupted one, and bad graph.* keys are named before the model runs.
The attribution and the pruning are stood in for (probe.testing.toy_graphs): what is under test
is the run around them."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys

import h5py
import numpy as np
import pandas as pd
import pytest
import torch

import probe
from probe.errors import ConfigError
from probe.graphs.graph_files import load_graph
from probe.launch.parts import attribution_graphs
from probe.testing.compose import QUIET
from probe.testing.random_transcoders import random_transcoders
from probe.testing.toy_graphs import toy_graph, toy_prune, toy_qk
from tests.graphs.test_graph_files import same_graph
from tests.helpers import ROOT
from tests.launch.test_error_catalogue import assert_words

FILES = ("graph_nodes.csv", "graph_edges.csv", "graph_scores.csv", "graph_features.csv")


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    """5 prompts of at most 6 tokens, two of them padded (a dict with an attention_mask), and a
    file standing for a transcoder set."""
    root = tmp_path_factory.mktemp("graph_prompts")
    ids = torch.randint(1, 40, (5, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(5, 6, dtype=torch.long)
    mask[1, 4:] = 0
    mask[3, 5:] = 0
    torch.save({"input_ids": ids, "attention_mask": mask}, root / "ids.pt")
    (root / "transcoders.yaml").write_text("transcoders: []\n")
    return root, [ids[i][mask[i].bool()] for i in range(5)]


@pytest.fixture
def stand_in(monkeypatch):
    """The attribution and the pruning stood in for; returns the token ids each call saw."""
    seen: list[list[int]] = []

    def attribute(model, tokens, transcoders, spec, tokenizer, overrides=None):
        assert transcoders == "a transcoder set"
        seen.append(tokens.tolist())
        return toy_graph(tokens)

    monkeypatch.setattr(attribution_graphs, "load_transcoder_set", lambda p: "a transcoder set")
    monkeypatch.setattr(attribution_graphs, "check_transcoders", lambda m, t, o: None)
    monkeypatch.setattr(attribution_graphs, "attribute_prompt", attribute)
    monkeypatch.setattr(
        attribution_graphs, "prune_graph",
        lambda g, spec: toy_prune(g, spec.node_threshold, spec.edge_threshold),
    )  # fmt: skip
    monkeypatch.setattr(attribution_graphs, "qk_of", lambda model, graph, *rest: toy_qk(graph))
    return seen


def graph_args(tiny_gpt2, root, *args: str) -> list[str]:
    return [
        "model=hf", f"model.name={tiny_gpt2[0]}", "model.task=causal_lm", "probes=none",
        "dataset=tokens", f"dataset.path={root / 'ids.pt'}", "dataset.batch_size=2",
        f"graph.transcoders={root / 'transcoders.yaml'}", *args,
    ]  # fmt: skip


def expected(tokens: list[torch.Tensor], node_threshold=0.8, edge_threshold=0.98):
    return [toy_prune(toy_graph(t), node_threshold, edge_threshold) for t in tokens]


def read(run_dir, name: str) -> pd.DataFrame:
    """A table with its token strings as written (only the number columns read "" as NaN)."""
    numbers = {c: [""] for c in ("activation", "influence", "replacement", "completeness")}
    return pd.read_csv(run_dir / name, dtype={"token": str}, keep_default_na=False,
                       na_values=numbers)  # fmt: skip


@pytest.mark.parametrize("edges", ["pruned", "all"])
def test_the_files_hold_each_prompts_graph_as_its_own_tables(
    cli_here, tiny_gpt2, prompts, stand_in, tmp_path, edges
):
    root, tokens = prompts
    code, text = cli_here(*graph_args(tiny_gpt2, root, "graph.node_threshold=0.7",
                                      f"graph.edges={edges}"))  # fmt: skip
    assert code == 0, text
    assert stand_in == [t.tolist() for t in tokens]  # every prompt once, without its padding
    run_dir = tmp_path / "run"
    graphs = expected(tokens, node_threshold=0.7)
    nodes, edge_rows, scores = (read(run_dir, n) for n in FILES[:3])
    for i, graph in enumerate(graphs):
        want = graph.nodes()
        want["token"] = want["token"].astype(str)
        got = nodes[nodes["prompt"] == i].drop(columns="prompt").reset_index(drop=True)
        pd.testing.assert_frame_equal(got, want, check_dtype=False)
        want_edges = graph.edges(kept_only=edges == "pruned")
        got_edges = edge_rows[edge_rows["prompt"] == i].drop(columns="prompt")
        assert len(want_edges) < graph.adjacency._nnz() or edges == "all"
        pd.testing.assert_frame_equal(got_edges.reset_index(drop=True), want_edges,
                                      check_dtype=False, rtol=1e-6)  # fmt: skip
        row = scores.iloc[i]
        assert row["prompt"] == i and row["tokens"] == len(tokens[i])
        assert row["kept_nodes"] == int(graph.node_kept.sum())
        assert row["kept_edges"] == int(graph.edge_kept.sum())
        assert row["edges"] == graph.adjacency._nnz() and row["nodes"] == graph.n_nodes
        assert row["replacement"] == pytest.approx(graph.scores["replacement"])
        assert row["completeness"] == pytest.approx(graph.scores["completeness"])
        same_graph(graph, load_graph(run_dir, prompt=i))
    # the features across prompts: graph_nodes.csv's kept feature nodes grouped
    features = read(run_dir, "graph_features.csv")
    kept = nodes[(nodes["kind"] == "feature") & nodes["kept"]]
    by = kept.groupby(["layer", "feature"])
    want = pd.DataFrame({
        "prompts": by["prompt"].nunique(), "nodes": by.size(),
        "mean_influence": by["influence"].mean(), "max_influence": by["influence"].max(),
        "mean_activation": by["activation"].mean(), "max_activation": by["activation"].max(),
    }).reset_index()  # fmt: skip
    want["prompt_share"] = want["prompts"] / 5
    want = want.sort_values(["prompts", "mean_influence"], ascending=False)
    pd.testing.assert_frame_equal(features.reset_index(drop=True),
                                  want[features.columns].reset_index(drop=True),
                                  check_dtype=False)  # fmt: skip


def graph_file(run_dir, group: str = "graph") -> dict[str, np.ndarray]:
    """Every dataset of the run's /graph (or another group of its probe.h5), by name."""
    with h5py.File(run_dir / "probe.h5") as f:
        out = {}
        f[group].visititems(
            lambda n, o: out.__setitem__(n, o[:]) if isinstance(o, h5py.Dataset) else None
        )
        return out


def test_a_stopped_run_resumes_to_the_files_of_an_uninterrupted_one(
    cli_here, tiny_gpt2, prompts, stand_in, tmp_path, monkeypatch
):
    root, tokens = prompts
    args = graph_args(tiny_gpt2, root)
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert cli_here(*args, run_dir=whole)[0] == 0
    stand_in.clear()
    attribute = attribution_graphs.attribute_prompt

    def stopped_at_the_third(model, t, *rest):
        if len(stand_in) == 2:  # a SIGINT while the third prompt is attributed
            os.kill(os.getpid(), signal.SIGINT)
        return attribute(model, t, *rest)

    monkeypatch.setattr(attribution_graphs, "attribute_prompt", stopped_at_the_third)
    code, text = cli_here(*args, run_dir=cut)
    assert code == 128 + signal.SIGINT, text
    assert_words(text, "while attributing graphs after 3 of 5 prompts", "resume=true")
    with h5py.File(cut / "probe.h5") as f:
        assert list(f["graph/prompts/prompt"][:]) == [0, 1, 2]
        assert not f["graph"].attrs["complete"] and not f.attrs["complete"]
    assert not (cut / "graph_nodes.csv").exists()
    code, text = cli_here(*args, "resume=true", "graph.node_threshold=0.5", run_dir=cut)
    assert code == 2 and "holds the attribution graphs of other graph.* settings" in text
    assert "graph.node_threshold" in text
    monkeypatch.setattr(attribution_graphs, "attribute_prompt", attribute)
    stand_in.clear()
    code, text = cli_here(*args, "resume=true", run_dir=cut)
    assert code == 0, text
    assert stand_in == [t.tolist() for t in tokens[3:]]  # the prompts it had are not redone
    for name in FILES:
        pd.testing.assert_frame_equal(read(cut, name), read(whole, name))
    a, b = graph_file(whole), graph_file(cut)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["model=resnet18"], ["graph.transcoders=", "model.library='torchvision' is not one",
                              "model=hf"]),
        (["model.task=base"], ["model.task='base' has no language-model head",
                               "model.task=causal_lm"]),
        (["dataset=random_tokens"], ["dataset=random_tokens", "dataset=text or dataset=tokens"]),
        (["graph.node_threshold=1.5"], ["graph.node_threshold=1.5 must lie in [0, 1]"]),
        (["graph.edge_threshold=-0.1"], ["graph.edge_threshold=-0.1 must lie in [0, 1]"]),
        (["graph.logit_prob=0"], ["graph.logit_prob=0 chooses no logit"]),
        (["graph.max_logits=0"], ["graph.max_logits=0 must be at least 1"]),
        (["graph.max_feature_nodes=0"], ["graph.max_feature_nodes=0 must be at least 1"]),
        (["graph.edges=some"], ["graph.edges='some' is unknown", "pruned, all"]),
        (["graph.floor=-1"], ["graph.floor=-1.0 must be a fraction in [0, 1)"]),
        (["graph.floor=1"], ["graph.floor=1.0 must be a fraction in [0, 1)", "row's |weight| sum"]),
        (["train_mode=true"], ["graph.transcoders needs train_mode=false"]),
    ],
)  # fmt: skip
def test_bad_graph_keys_are_named_before_the_model_runs(
    cli_here, tiny_gpt2, prompts, stand_in, tmp_path, args, words
):
    code, text = cli_here(*graph_args(tiny_gpt2, prompts[0]), *args)
    assert code == 2, text
    assert_words(text, *words)
    assert not stand_in and not (tmp_path / "run" / "probe.h5").exists()


def test_a_missing_transcoder_set_is_named_by_the_command(tiny_gpt2, prompts, tmp_path):
    """In its own process, as a user runs it: exit 2 and the message, before torch is imported."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HYDRA_FULL_ERROR", None)
    missing = tmp_path / "nowhere.yaml"
    args = [*graph_args(tiny_gpt2, prompts[0]), f"graph.transcoders={missing}"]
    done = subprocess.run(
        [sys.executable, "-m", "probe", *QUIET, *args, f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert f"graph.transcoders='{missing}' does not exist" in done.stderr
    assert "a folder holding one" in done.stderr
    assert not (tmp_path / "run").exists()


STAND_IN = """
import sys
from probe.__main__ import main
from probe.launch.parts import attribution_graphs as ag
from probe.testing.toy_graphs import toy_graph, toy_prune, toy_qk

ag.load_transcoder_set = lambda path: "a transcoder set"
ag.check_transcoders = lambda model, tc, overrides: None
ag.attribute_prompt = lambda model, tokens, *rest: toy_graph(tokens)
ag.prune_graph = lambda g, spec: toy_prune(g, spec.node_threshold, spec.edge_threshold)
ag.qk_of = lambda model, graph, *rest: toy_qk(graph)
sys.argv = ["probe", *sys.argv[1:]]
main()
"""


def test_two_ranks_write_the_files_of_one_process(cli_here, tiny_gpt2, prompts, stand_in, tmp_path):
    """torchrun, 2 CPU ranks (gloo): rank 0 attributes prompts 0-3, rank 1 prompt 4, each into
    its own file; the run's /graph and tables equal a single process's, and with graph.qk so do
    its /graph_qk, graph_qk.csv and the viewer JSON's QK nodes."""
    root, _ = prompts
    args = graph_args(tiny_gpt2, root, "graph.qk=2")
    assert cli_here(*args, run_dir=tmp_path / "one")[0] == 0
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    two = tmp_path / "two"
    done = subprocess.run(
        [*command, str(script), *QUIET, *args, f"hydra.run.dir={two}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr + done.stdout
    with h5py.File(two / "probe.rank1.h5") as f:
        assert list(f["graph/prompts/prompt"][:]) == [4]
        assert list(f["graph_qk/prompts/prompt"][:]) == [4]
    for name in (*FILES, "graph_qk.csv"):
        pd.testing.assert_frame_equal(read(two, name), read(tmp_path / "one", name))
    for group in ("graph", "graph_qk"):
        a, b = graph_file(tmp_path / "one", group), graph_file(two, group)
        assert a.keys() == b.keys()
        for name in a:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    for i in range(5):
        name = f"graph_json/prompt_{i}.json"
        assert json.loads((two / name).read_text()) == json.loads(
            (tmp_path / "one" / name).read_text()
        )


KILLED_AT_THE_THIRD = STAND_IN.replace(
    "ag.attribute_prompt = lambda model, tokens, *rest: toy_graph(tokens)",
    """seen = []


def attribute(model, tokens, *rest):
    seen.append(tokens)
    if len(seen) == 3:  # SIGKILL while the third prompt is attributed: no handler runs
        import os, signal
        os.kill(os.getpid(), signal.SIGKILL)
    return toy_graph(tokens)


ag.attribute_prompt = attribute""",
)


def test_a_run_killed_in_its_graphs_resumes_to_the_files_of_an_uninterrupted_one(
    cli_here, tiny_gpt2, prompts, stand_in, tmp_path
):
    """SIGKILL mid-pass: the file keeps the two whole prompts (it opens, /graph cut to them on
    resume) and says it is not complete; resume=true computes the other three, and the files
    equal an uninterrupted run's."""
    root, tokens = prompts
    args = graph_args(tiny_gpt2, root)
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert cli_here(*args, run_dir=whole)[0] == 0
    script = tmp_path / "killed.py"
    script.write_text(KILLED_AT_THE_THIRD)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HYDRA_FULL_ERROR", None)
    done = subprocess.run(
        [sys.executable, str(script), *QUIET, *args, f"hydra.run.dir={cut}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    stand_in.clear()
    code, text = cli_here(*args, "resume=true", run_dir=cut)
    assert code == 0, text
    assert stand_in == [t.tolist() for t in tokens[2:]]  # the two whole prompts are not redone
    for name in FILES:
        pd.testing.assert_frame_equal(read(cut, name), read(whole, name))
    a, b = graph_file(whole), graph_file(cut)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    with h5py.File(cut / "probe.h5") as f:
        assert f.attrs["complete"] and f["graph"].attrs["complete"]


def named_transcoders(width: int = 32):
    """A random transcoder set for the tiny GPT-2 (2 blocks, as many features as its width),
    its transcoders named tc0 and tc1."""
    transcoders = random_transcoders(width, expansion=1)
    transcoders.ids = {0: "tc0", 1: "tc1"}
    return transcoders


def test_a_run_writes_the_graphs_the_attribution_gives_on_a_tiny_gpt2(
    cli_here, tiny_gpt2, prompts, tmp_path, monkeypatch
):
    """End to end with the real attribution and pruning: each prompt's rows equal the graph
    `attribute` and `prune` give for the same tokens outside the run."""
    from transformers import AutoModelForCausalLM

    from probe.graphs.attribution import GraphOptions, attribute
    from probe.graphs.pruning import prune

    root, tokens = prompts
    transcoders = named_transcoders()
    monkeypatch.setattr(attribution_graphs, "load_transcoder_set", lambda p: transcoders)
    code, text = cli_here(*graph_args(tiny_gpt2, root, "graph.edges=all"))
    assert code == 0, text
    run_dir = tmp_path / "run"
    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2[0]).eval()
    nodes, edges, scores = (read(run_dir, n) for n in FILES[:3])
    for i, t in enumerate(tokens):
        graph = prune(attribute(model, t, transcoders, GraphOptions()), 0.8, 0.98)
        assert graph.n_features > 0
        want = graph.nodes()
        want["token"] = want["token"].astype(str)
        got = nodes[nodes["prompt"] == i].drop(columns="prompt").reset_index(drop=True)
        pd.testing.assert_frame_equal(got, want, check_dtype=False, rtol=1e-5)
        got_edges = edges[edges["prompt"] == i].drop(columns="prompt").reset_index(drop=True)
        pd.testing.assert_frame_equal(got_edges, graph.edges(kept_only=False),
                                      check_dtype=False, rtol=1e-5, atol=1e-7)  # fmt: skip
        assert scores.loc[i, "replacement"] == pytest.approx(graph.scores["replacement"])
        assert scores.loc[i, "completeness"] == pytest.approx(graph.scores["completeness"])
        back = load_graph(run_dir, i)
        torch.testing.assert_close(back.cumulative, graph.cumulative, equal_nan=True)
        assert back.scan == ["tc0", "tc1"]


def test_a_transcoder_set_of_another_width_is_refused_before_the_loop(
    cli_here, tiny_gpt2, prompts, tmp_path, monkeypatch
):
    monkeypatch.setattr(
        attribution_graphs, "load_transcoder_set", lambda p: named_transcoders(width=16)
    )
    code, text = cli_here(*graph_args(tiny_gpt2, prompts[0]))
    assert code == 2, text
    assert_words(text, "the transcoder of layer 0 reads 16", "residual stream is 32 wide")
    assert not (tmp_path / "run" / "probe.h5").exists()


def test_text_prompts_are_named_by_the_tokenizer(cli_here, tiny_gpt2, tmp_path, monkeypatch):
    """dataset=text: each row a prompt, a special token first as the API puts it
    (probe.attribution_graph on the row's ids: the same graph), its tokens and logits named and
    its text decoded by dataset.tokenizer; graph.prepend_bos=false takes the rows as they are."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from probe.graphs.attribution import GraphOptions, attribute
    from probe.graphs.pruning import prune

    (tmp_path / "docs.txt").write_text("the cat sat on the mat\na dog ran\nthe cat ran on a mat\n")
    (tmp_path / "transcoders.yaml").write_text("transcoders: []\n")
    transcoders = named_transcoders()
    monkeypatch.setattr(attribution_graphs, "load_transcoder_set", lambda p: transcoders)
    args = [
        "model=hf", f"model.name={tiny_gpt2[0]}", "model.task=causal_lm", "probes=none",
        "dataset=text", f"dataset.path={tmp_path / 'docs.txt'}", f"dataset.tokenizer={tiny_gpt2[1]}",
        "dataset.seq_len=5", f"graph.transcoders={tmp_path / 'transcoders.yaml'}",
    ]  # fmt: skip
    code, text = cli_here(*args)
    assert code == 0, text
    tok = AutoTokenizer.from_pretrained(tiny_gpt2[1])
    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2[0]).eval()
    run_dir = tmp_path / "run"
    with h5py.File(run_dir / "probe.h5") as f:
        count = int(f.attrs["num_samples"])
        texts = list(f["graph/prompts/text"].asstr()[:])
    nodes = read(run_dir, "graph_nodes.csv")
    assert count >= 2 and sorted(set(nodes["prompt"])) == list(range(count))
    rows = [tok(line)["input_ids"][:5] for line in (tmp_path / "docs.txt").read_text().split("\n")]
    for i in range(count):
        graph = load_graph(run_dir, i)
        ids = graph.tokens
        assert ids.tolist() == [tok.bos_token_id, *rows[i]]  # (the tokenizer adds none itself)
        assert texts[i] == tok.decode(ids.tolist())
        api = probe.attribution_graph(model, torch.tensor(rows[i]), transcoders, tokenizer=tok)
        assert api.tokens.tolist() == ids.tolist()
        torch.testing.assert_close(api.adjacency.to_dense(), graph.adjacency.to_dense())
        want = prune(attribute(model, ids, transcoders, GraphOptions(), tokenizer=tok))
        assert graph.token_strings == want.token_strings == [tok.decode([t]) for t in ids.tolist()]
        assert graph.logit_strings == want.logit_strings
        got = nodes[nodes["prompt"] == i].drop(columns="prompt").reset_index(drop=True)
        table = want.nodes()
        assert got["token"].tolist() == table["token"].tolist()
    code, text = cli_here(*args, "graph.prepend_bos=false", run_dir=tmp_path / "plain")
    assert code == 0, text
    assert load_graph(tmp_path / "plain", 0).tokens.tolist() == rows[0]


def test_the_command_reads_a_saved_transcoder_set_and_writes_its_graphs(
    tiny_gpt2, prompts, tmp_path
):
    """`python -m probe ... graph.transcoders=FOLDER` in its own process, the set saved as
    circuit-tracer's YAML and files: graph_nodes.csv equals `attribute` and `prune` on the set
    read back."""
    files = pytest.importorskip("probe.models.transcoder_files")
    from transformers import AutoModelForCausalLM

    from probe.graphs.attribution import GraphOptions, attribute
    from probe.graphs.pruning import prune

    root, tokens = prompts
    files.save_transcoders(named_transcoders(), tmp_path / "set")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HYDRA_FULL_ERROR", None)
    args = [*graph_args(tiny_gpt2, root), f"graph.transcoders={tmp_path / 'set'}"]
    done = subprocess.run(
        [sys.executable, "-m", "probe", *QUIET, *args, f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    transcoders = files.load_transcoders(tmp_path / "set")
    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2[0]).eval()
    nodes = read(tmp_path / "run", "graph_nodes.csv")
    for i in (0, 3):
        want = prune(attribute(model, tokens[i], transcoders, GraphOptions())).nodes()
        want["token"] = want["token"].astype(str)
        got = nodes[nodes["prompt"] == i].drop(columns="prompt").reset_index(drop=True)
        pd.testing.assert_frame_equal(got, want, check_dtype=False, rtol=1e-5)


def test_the_graph_keys_become_the_attributions_options():
    """Every graph.* key GraphOptions has is passed on; a null where its default is not null
    leaves that default."""
    from probe.graphs.attribution import GraphOptions
    from probe.specs import GraphSpec

    spec = GraphSpec(transcoders="t.yaml", logit_prob=0.5, max_logits=3, max_feature_nodes=7,
                     node_threshold=0.6, edge_threshold=0.9, edges="all", floor=0.01,
                     zero_bos=False, update_interval=2)  # fmt: skip
    got = attribution_graphs.graph_options(spec)
    assert got == GraphOptions(logit_prob=0.5, max_logits=3, max_feature_nodes=7,
                               node_threshold=0.6, edge_threshold=0.9, edges="all",
                               floor=0.01, zero_bos=False, update_interval=2)  # fmt: skip
    assert got.batch_size == GraphOptions().batch_size  # (graph.batch_size null)
    assert attribution_graphs.graph_options(GraphSpec(batch_size=8)).batch_size == 8


def test_the_documented_graph_keys_compose_and_reach_the_run(tmp_path):
    """graph.zero_bos, graph.update_interval, graph.prepend_bos and graph.examples as a command
    line gives them: parsed into the plan, and the first two passed on to the attribution."""
    from probe.plan import parse
    from probe.testing.compose import make_cfg

    torch.save(torch.ones(2, 3, dtype=torch.long), tmp_path / "ids.pt")
    (tmp_path / "t.yaml").write_text("transcoders: []\n")
    plan = parse(make_cfg("model=hf", "model.name=x", "model.task=causal_lm", "dataset=tokens",
                          f"dataset.path={tmp_path / 'ids.pt'}", f"graph.transcoders={tmp_path / 't.yaml'}",
                          "graph.zero_bos=false", "graph.update_interval=2",
                          "graph.prepend_bos=false", "graph.examples=RUN"))  # fmt: skip
    assert (plan.graph.prepend_bos, plan.graph.examples) == (False, "RUN")
    got = attribution_graphs.graph_options(plan.graph)
    assert (got.zero_bos, got.update_interval) == (False, 2)


def test_a_resume_takes_keys_its_file_predates_at_their_defaults_and_ignores_the_batch(tmp_path):
    """A /graph written before graph.qk existed resumes under qk=0 (what it was computed with)
    and not under qk=2; graph.batch_size and graph.examples leave the graphs as they are."""
    from types import SimpleNamespace

    from probe.specs import GraphSpec

    new = dataclasses.asdict(GraphSpec(transcoders="set"))
    old = {k: v for k, v in new.items() if k not in ("qk", "qk_rows")} | {"batch_size": 64}
    written = SimpleNamespace(group=SimpleNamespace(attrs={"options": json.dumps(old)}))
    path = tmp_path / "probe.h5"
    attribution_graphs._check_same_options(written, {"options": json.dumps(new)}, path)
    examples = json.dumps(new | {"examples": "outputs/run"})
    attribution_graphs._check_same_options(written, {"options": examples}, path)
    with pytest.raises(ConfigError, match=r"other graph\.\* settings \(graph\.qk\)"):
        attribution_graphs._check_same_options(written, {"options": json.dumps(new | {"qk": 2})},
                                               path)  # fmt: skip
