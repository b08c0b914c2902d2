"""Circuits in a run (circuit.method with dataset=pairs): the files of a run against the engine
called directly on the same batches, a run stopped in its circuit phase and resumed, mean
ablation from the run's pairs and from an earlier run, the command line (exit codes, torchrun's
two ranks against one process, probe.analyze and probe.sites), a sweep over checkpoints gathered
into one table, and bad input named."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import h5py
import numpy as np
import pandas as pd
import pytest
import torch

from probe.circuits.component_graph import ComponentGraph
from probe.circuits.exact import evaluate_dataset
from probe.circuits.faithfulness import areas, plan
from probe.circuits.parts import parts_of
from probe.circuits.scores import attribute
from probe.circuits.states import mean_states
from probe.circuits.task import Ablation
from probe.data.batches import build_batches
from probe.errors import ConfigError
from probe.launch.interrupt import Interrupted
from probe.launch.run import run
from probe.models.build import build_model
from probe.store.fileformat import read_progress
from probe.store.pass_state import PassState
from probe.store.runfile import open_probe_file
from probe.testing.compose import QUIET
from probe.testing.toy_circuits import pairs
from tests.circuits.test_hand import build
from tests.helpers import ROOT, cli, make_cfg


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny grouped-query Llama (4 heads, 2 key/value heads) saved, and 5 pairs of 6 tokens."""
    root = tmp_path_factory.mktemp("circuit_llama")
    build("llama").save_pretrained(root / "llama")
    p = pairs(50, n=5, length=6, seed=4)
    torch.save({"clean_ids": p["input_ids"], "corrupt_ids": p["corrupt_ids"],
                "answer": p["answer"][:, 0], "wrong": p["wrong"][:, 0]}, root / "pairs.pt")  # fmt: skip
    return root


def args_of(root, model="llama", *extra):
    return ["model=hf", f"model.name={root / model}", "model.task=causal_lm", "dataset=pairs",
            f"dataset.path={root / 'pairs.pt'}", "dataset.batch_size=2", "probes=none", *extra]  # fmt: skip


def direct(args):
    """The model and the batches (dicts) a run of `args` builds."""
    cfg = make_cfg(*args)
    model = build_model(cfg.model, cfg.seed)
    batches = [{**b.inputs, **b.side} for b in build_batches(cfg.dataset, cfg.model, 0, model)]
    return model, batches


def test_a_runs_files_equal_the_engine_on_the_same_batches(tmp_path, llama):
    args = args_of(llama, "llama", "circuit.method=[eap,exact]", "circuit.select=greedy")
    run(make_cfg(*args), run_dir=tmp_path)
    model, batches = direct(args)
    parts = parts_of(model)
    want = attribute(parts, batches, ["eap", "exact"])
    graph = parts.graph
    with h5py.File(tmp_path / "probe.h5") as f:
        g = f["circuit"]
        assert [e.decode() for e in g["edges"][:]] == graph.edges
        for m in ("eap", "exact"):
            np.testing.assert_allclose(g[m]["scores"][:], want[m].edges, rtol=1e-10, atol=1e-12)
            np.testing.assert_allclose(g[m]["edge_sum"][:], want[m].edge_sum, rtol=1e-10)
            assert g[m].attrs["count"] == 5
    # circuit.csv: every edge, ranked by |score|
    table = pd.read_csv(tmp_path / "circuit.csv")
    for m in ("eap", "exact"):
        rows = table[table.method == m]
        order = np.argsort(-np.abs(want[m].edges), kind="stable")
        assert list(rows.edge) == [graph.edges[i] for i in order]
        assert list(rows["rank"]) == list(range(1, graph.n_edges + 1))
        np.testing.assert_allclose(rows.score, want[m].edges[order], rtol=1e-10, atol=1e-12)
    # faithfulness.csv and circuit_areas.csv: the circuits cut from those scores, evaluated here
    sizes = [0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50]
    cut = plan(graph, {m: s.edges for m, s in want.items()}, sizes, "greedy", True, "logit_diff")
    curves = cut.curves(evaluate_dataset(parts, batches, cut.keep))
    faith = pd.read_csv(tmp_path / "faithfulness.csv")
    got_areas = pd.read_csv(tmp_path / "circuit_areas.csv").set_index("method")
    for m, curve in curves.items():
        rows = faith[faith.method == m]
        assert list(rows["size"]) == [0, *sizes, 100]
        assert list(rows.edges) == [0, *curve.edges, graph.n_edges]
        np.testing.assert_allclose(rows.metric, [curve.empty, *curve.metric, curve.full], rtol=1e-9)
        f = (np.array(curve.metric) - curve.empty) / (curve.full - curve.empty)
        np.testing.assert_allclose(rows.faithfulness, [0, *f, 1], rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(got_areas.loc[m, ["cpr", "cmd"]], areas(sizes, f), rtol=1e-6)
    with h5py.File(tmp_path / "probe.h5") as f:
        kept = f["circuit/eap/circuits"][:].astype(bool)
        np.testing.assert_array_equal(kept, cut.keep[cut.rows["eap"]])
    # MIB's importances: EAP-IG's ungrouped edge names, the score negated (a loss), a key/value
    # head's score shared by its two query heads
    mib = json.loads((tmp_path / "mib" / "eap" / "importances.json").read_text())
    assert mib["cfg"] == {"n_layers": 2, "n_heads": 4, "parallel_attn_mlp": False, "d_model": 32}
    assert set(mib["edges"]) == set(ComponentGraph(2, 4, 4).edges)
    assert set(mib["nodes"]) == set(ComponentGraph(2, 4, 4).nodes)
    score = dict(zip(graph.edges, want["eap"].edges, strict=True))
    assert mib["edges"]["m0->a1.h2<q>"]["score"] == pytest.approx(-score["m0->a1.h2<q>"])
    pair = mib["edges"]["a0.h1->a1.h2<k>"]["score"] + mib["edges"]["a0.h1->a1.h3<k>"]["score"]
    assert pair == pytest.approx(-score["a0.h1->a1.h1<k>"])  # key/value head 1 serves 2 and 3
    assert not any(e["in_graph"] for e in mib["edges"].values())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, llama):
    """The overrides of a run of the signalling Llama (EAP, circuits at 10% and 50%) and the
    directory of its uninterrupted run, which a stopped and a killed run resume to."""
    model = ["model=custom", "model._target_=probe.testing.models.signalling_lm",
             f"+model.kwargs.path={llama / 'llama'}"]  # fmt: skip
    args = [*args_of(llama, "llama", "circuit.method=[eap]", "circuit.sizes=[10,50]")[3:], *model]
    whole = tmp_path_factory.mktemp("circuit_whole")
    run(make_cfg(*args), run_dir=whole)
    return args, whole


def test_a_run_stopped_in_its_circuit_pass_resumes_to_the_same_files(tmp_path, uninterrupted):
    """SIGINT on the 3rd forward: the loop made none (its probes capture nothing, the circuit
    works after it) and the circuit pass is in its first batch; the file holds the pass's sums
    and says it is not complete; resume=true then gives the uninterrupted run's /circuit and
    tables, and no pass state is left."""
    from probe.testing.models import SIGNAL_AT

    args, whole = uninterrupted
    SIGNAL_AT[0] = 2
    try:
        with pytest.raises(Interrupted, match="while scoring edges after 1 of 3 batches"):
            run(make_cfg(*args), run_dir=tmp_path / "part")
    finally:
        SIGNAL_AT[0] = None
    with h5py.File(tmp_path / "part" / "probe.h5") as f:
        state = PassState(f, "circuit").load()
        assert not f.attrs["complete"] and "circuit" not in f
    assert state is not None and state["scored"] == 1 and state["eap.count"] == 2
    with pytest.raises(ConfigError, match="holds the circuit sums of other choices"):
        run(make_cfg(*args, "resume=true", "circuit.steps=3"), run_dir=tmp_path / "part")
    run(make_cfg(*args, "resume=true"), run_dir=tmp_path / "part")
    with h5py.File(tmp_path / "part" / "probe.h5") as f:
        assert "passes" not in f and f.attrs["complete"]
    with h5py.File(tmp_path / "part" / "probe.h5") as a, h5py.File(whole / "probe.h5") as b:  # fmt: skip
        for name in ("edge_sum", "edge_sumsq", "node_sum", "scores", "faithfulness/metric"):
            np.testing.assert_array_equal(a[f"circuit/eap/{name}"][:], b[f"circuit/eap/{name}"][:])
    for name in ("circuit.csv", "faithfulness.csv", "circuit_areas.csv"):
        pd.testing.assert_frame_equal(*(pd.read_csv(d / name) for d in (tmp_path / "part", whole)))
    # resuming the finished run makes no forward: the files are rewritten from /circuit
    (tmp_path / "part" / "circuit.csv").unlink()
    SIGNAL_AT[0] = 0  # (any forward of this run would signal)
    try:
        run(make_cfg(*args, "resume=true"), run_dir=tmp_path / "part")
    finally:
        SIGNAL_AT[0] = None
    again = [pd.read_csv(d / "circuit.csv") for d in (tmp_path / "part", whole)]
    pd.testing.assert_frame_equal(*again)


KILLED = """
import signal, sys
from probe.__main__ import main
from probe.testing import models
models.SIGNAL_AT[0], models.SIGNAL[0] = 5, signal.SIGKILL  # in the pass's scoring
sys.argv = ["probe", *sys.argv[1:]]
main()
"""


def test_a_run_killed_in_its_circuit_pass_resumes_to_the_same_files(tmp_path, uninterrupted):
    """SIGKILL in the circuit pass's scoring: the file keeps the sums of the batches scored
    before and says it is not complete; resume=true continues after them, to the uninterrupted
    run's /circuit and tables."""
    from tests.launch.test_distributed import ONE_THREAD

    args, whole = uninterrupted
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    env = {**ONE_THREAD, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(script), *QUIET, *args, f"hydra.run.dir={tmp_path / 'part'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    with open_probe_file(tmp_path / "part" / "probe.h5") as f:  # (a killed writer's file)
        state = PassState(f, "circuit").load()
        assert not read_progress(f).complete
    assert state is not None and 1 <= state["scored"] < 3  # (some batches scored, not all)
    run(make_cfg(*args, "resume=true"), run_dir=tmp_path / "part")
    with h5py.File(tmp_path / "part" / "probe.h5") as a, h5py.File(whole / "probe.h5") as b:  # fmt: skip
        assert "passes" not in a and a.attrs["complete"]
        for name in ("edge_sum", "edge_sumsq", "node_sum", "scores", "faithfulness/metric"):
            np.testing.assert_array_equal(a[f"circuit/eap/{name}"][:], b[f"circuit/eap/{name}"][:])
    for name in ("circuit.csv", "faithfulness.csv", "circuit_areas.csv"):
        pd.testing.assert_frame_equal(*(pd.read_csv(d / name) for d in (tmp_path / "part", whole)))


def test_mean_ablation_over_the_pairs_and_from_an_earlier_run(tmp_path, llama):
    args = args_of(
        llama, "llama", "circuit.method=[eap]", "circuit.ablation=mean", "circuit.sizes=[]"
    )
    run(make_cfg(*args), run_dir=tmp_path / "first")
    model, batches = direct(args)
    parts = parts_of(model)
    means = mean_states(parts, [{"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]}
                                for b in batches])  # fmt: skip
    want = attribute(parts, batches, ["eap"], ablation=Ablation("mean", means))["eap"]
    with h5py.File(tmp_path / "first" / "probe.h5") as f:
        np.testing.assert_allclose(f["circuit/means/mlp1"][:], means.mlp[1][0, 0], rtol=1e-6)
        np.testing.assert_allclose(f["circuit/eap/scores"][:], want.edges, rtol=1e-6, atol=1e-9)
        assert "faithfulness" not in f["circuit/eap"]  # circuit.sizes=[]: no circuits
    again = [*args, f"circuit.mean_source={tmp_path / 'first'}"]
    run(make_cfg(*again), run_dir=tmp_path / "again")
    a, b = (pd.read_csv(tmp_path / d / "circuit.csv") for d in ("first", "again"))
    pd.testing.assert_frame_equal(a, b, check_exact=False, rtol=1e-6)
    assert not (tmp_path / "again" / "faithfulness.csv").exists()


def bert_dir(root):
    from probe.testing.tiny_lms import make_tiny

    return make_tiny("bert", root / "bert", vocab_size=50)


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["circuit.sizes=[0,5]"], ["circuit.sizes", "(0, 100]", "0 is not"]),
        (["circuit.sizes=[150]"], ["circuit.sizes", "150 is not"]),
        (["circuit.method=[exact]", "circuit.max_exact=10"], ["max_exact=10", "eap"]),
        (["circuit.method=[eap_ig_inputs]", "circuit.ablation=zero"], ["counterfactual"]),
        (["circuit.ablation=mean", "circuit.mean_source=NOWHERE"], ["mean_source", "no probe.h5"]),
        (["circuit.select=best"], ["circuit.select='best'", "greedy"]),
        (["circuit.method=[eap]", "model=custom", "model._target_=probe.testing.models.LinearLM"],
         ["model.anatomy", "attn_norm"]),
        (["circuit.method=[eap]", "model.task=masked_lm", "BERT"], ["post-norm"]),
        (["circuit.method=[eap]", "dataset=tokens", "dataset.path=TOKENS"], ["dataset=pairs"]),
    ],
)  # fmt: skip
def test_bad_circuit_input_is_named(tmp_path, llama, extra, words):
    """Each before the run's loop writes anything."""
    extra = [e.replace("NOWHERE", str(tmp_path)) for e in extra]
    args = args_of(llama, "llama", "circuit.method=[eap]")
    if "BERT" in extra:
        extra = [e for e in extra if e != "BERT"] + [f"model.name={bert_dir(tmp_path)}"]
    if "dataset.path=TOKENS" in extra:
        torch.save(torch.randint(3, 50, (4, 6)), tmp_path / "ids.pt")
        extra = [e.replace("TOKENS", str(tmp_path / "ids.pt")) for e in extra]
    with pytest.raises(ConfigError) as e:
        run(make_cfg(*args, *extra), run_dir=tmp_path / "run")
    for w in words:
        assert w in str(e.value)
    assert not (tmp_path / "run" / "probe.h5").exists()


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory, llama):
    """One process and torchrun's two ranks, from the command line; and a bad size's exit."""
    from tests.launch.test_distributed import ONE_THREAD, torchrun

    root = tmp_path_factory.mktemp("circuit_cli")
    args = args_of(llama, "llama", "circuit.method=[eap,eap_ig_activations]", "circuit.steps=2",
                   "circuit.absolute=false", "circuit.sizes=[5,20,50]")  # fmt: skip
    one = cli(*args, f"hydra.run.dir={root / 'one'}", cwd=root, env=ONE_THREAD)
    assert one.returncode == 0, one.stderr
    two = torchrun(root / "two", *args)
    assert two.returncode == 0, two.stderr + two.stdout
    bad = cli(*args, "circuit.sizes=[150]", f"hydra.run.dir={root / 'bad'}", cwd=root)
    return root, bad


def test_two_ranks_merge_into_the_one_process_circuit(cli_runs):
    root, bad = cli_runs
    assert bad.returncode == 2 and "circuit.sizes" in bad.stderr and "150" in bad.stderr
    with h5py.File(root / "one" / "probe.h5") as a, h5py.File(root / "two" / "probe.h5") as b:
        for m in ("eap", "eap_ig_activations"):
            assert a[f"circuit/{m}"].attrs["count"] == b[f"circuit/{m}"].attrs["count"] == 5
            for name in ("edge_sum", "node_sum", "faithfulness/metric"):
                np.testing.assert_allclose(
                    a[f"circuit/{m}/{name}"][:], b[f"circuit/{m}/{name}"][:], rtol=1e-9, atol=1e-12
                )
            np.testing.assert_array_equal(
                a[f"circuit/{m}/circuits"][:], b[f"circuit/{m}/circuits"][:]
            )
    for rank in (0, 1):
        with h5py.File(root / "two" / f"probe.rank{rank}.h5") as f:
            assert "passes" not in f
    for name in ("circuit.csv", "faithfulness.csv"):
        x, y = (pd.read_csv(root / d / name) for d in ("one", "two"))
        pd.testing.assert_frame_equal(x, y, check_exact=False, rtol=1e-7, atol=1e-12)


def test_analyze_prints_the_best_edges_and_sites_the_graphs_counts(cli_runs, llama, capsys):
    from probe.analyze import main as analyze
    from probe.hooks.site_table import main as sites
    from probe.sites import circuit_counts

    root, _ = cli_runs
    assert analyze([str(root / "one"), "circuit", "--top", "3"]) == 0
    printed = capsys.readouterr().out
    table = pd.read_csv(root / "one" / "circuit.csv")
    top = pd.read_csv(root / "one" / "circuit_top.csv")
    pd.testing.assert_frame_equal(top, table[table["rank"] <= 3].reset_index(drop=True))
    for edge in top.edge:
        assert edge in printed
    # signed: the edges whose ablation lowers the logit difference most come first
    eap = table[table.method == "eap"]
    assert list(eap.score) == sorted(eap.score)
    # a rank's file holds the circuit of every rank's scores (the stitched file takes rank 0's)
    assert analyze([str(root / "two" / "probe.rank0.h5"), "circuit", "--top", "3"]) == 0
    capsys.readouterr()
    ranked = pd.read_csv(root / "two" / "circuit_top.csv")
    pd.testing.assert_frame_equal(
        ranked[["method", "edge", "rank"]], top[["method", "edge", "rank"]]
    )
    assert analyze([str(root / "missing"), "circuit"]) == 2  # no run there: named
    assert f"{str(root / 'missing')!r} is neither a run directory" in capsys.readouterr().err
    assert sites(args_of(llama), notes=circuit_counts) == 0
    counts = ComponentGraph(2, 4, 2).counts()
    assert (
        f"component graph: {counts['nodes']} nodes, {counts['senders']} senders"
        in capsys.readouterr().out
    )


def test_a_sweep_over_checkpoints_gathers_each_runs_scores(tmp_path, llama):
    """Three checkpoints of the tiny Llama (its weights, then scaled twice): circuit_sweep.csv's
    column of each equals that run's circuit.csv."""
    from probe.report.circuits import write_sweep

    model = build("llama")
    names = []
    for i, scale in enumerate((1.0, 1.3, 0.7)):
        state = {
            k: v * scale if v.is_floating_point() else v for k, v in model.state_dict().items()
        }
        names.append(str(tmp_path / f"step{i}.pt"))
        torch.save(state, names[-1])
    args = args_of(llama, "llama", "circuit.method=[eap]", "circuit.sizes=[]")
    done = cli("-m", *args, f"model.checkpoint={','.join(names)}",
               f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    written = write_sweep(tmp_path / "sweep", top=5)
    table = pd.read_csv(written[0])
    assert list(table.columns) == [
        "method",
        "edge",
        "sender",
        "receiver",
        "step0.pt",
        "step1.pt",
        "step2.pt",
    ]
    for i in range(3):
        own = pd.read_csv(tmp_path / "sweep" / str(i) / "circuit.csv").set_index("edge")
        got = table.set_index("edge")[f"step{i}.pt"]
        np.testing.assert_array_equal(got.loc[own.index].to_numpy(), own.score.to_numpy())
    first = table["step0.pt"].to_numpy()  # each run read its own checkpoint
    assert all(not np.allclose(first, table[f"step{i}.pt"].to_numpy()) for i in (1, 2))
    assert [p.name for p in written] == ["circuit_sweep.csv", "circuit_sweep_eap.png"]
