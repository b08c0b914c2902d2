"""What a new user of circuits trips over, each the exact command a user meets it with: a model
loaded without its language-model head (model.task left at base) refused by name for every
answer metric, one method without brackets, the image models' default probes, probe.sites on
GPT-2 built without weights, the log's list of files, and circuits.md's snippet and sweep."""

from __future__ import annotations

import logging
import re

import h5py
import numpy as np
import pytest
import torch

from probe.circuits.component_graph import ComponentGraph
from probe.circuits.parts import parts_of
from probe.circuits.scores import METHODS, attribute
from probe.errors import SelectionError
from probe.launch.run import run
from tests.circuits.test_circuit_runs import args_of, direct, llama  # noqa: F401 (a fixture)
from tests.helpers import ROOT, make_cfg

HEADLESS = "has no language-model head"


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """GPT-2s of width 64 (wider than the first's vocabulary of 50, narrower than the second's
    1000) saved with their heads, and pairs whose answers reach 40 and 300."""
    from transformers import GPT2Config, GPT2LMHeadModel

    root = tmp_path_factory.mktemp("headless")
    g = torch.Generator().manual_seed(5)
    for vocab, top in ((50, 40), (1000, 300)):
        config = GPT2Config(
            vocab_size=vocab,
            n_layer=2,
            n_embd=64,
            n_head=2,
            n_positions=64,
            bos_token_id=2,
            eos_token_id=2,
        )
        with torch.random.fork_rng():
            torch.manual_seed(0)
            GPT2LMHeadModel(config).save_pretrained(root / f"gpt2_{vocab}")
        clean = torch.randint(3, 40, (4, 6), generator=g)
        corrupt = clean.clone()
        corrupt[:, 2] = torch.randint(3, 40, (4,), generator=g)
        answer = torch.full((4,), top)
        torch.save({"clean_ids": clean, "corrupt_ids": corrupt, "answer": answer,
                    "wrong": answer - 1}, root / f"pairs_{vocab}.pt")  # fmt: skip
    return root


def headless(root, vocab: int, *extra: str) -> list[str]:
    """The issue's command: model=hf without model.task (base: the bare model)."""
    return ["model=hf", f"model.name={root / f'gpt2_{vocab}'}", "dataset=pairs",
            f"dataset.path={root / f'pairs_{vocab}.pt'}", "dataset.batch_size=2", "probes=none",
            *extra]  # fmt: skip


@pytest.mark.parametrize("vocab", [50, 1000], ids=["small_vocabulary", "normal_vocabulary"])
def test_a_circuit_run_on_a_model_without_its_head_is_refused_by_name(
    tmp_path, wide, vocab, cli_in_process
):
    """Before: exit 0 with a circuit read off the hidden states (50), or exit 1 with torch's
    'index 300 is out of bounds for dimension 1 with size 64' (1000)."""
    out = cli_in_process(*headless(wide, vocab, "circuit.method=[eap]"),
                         f"hydra.run.dir={tmp_path / 'run'}")  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    assert "circuit.metric=logit_diff" in out.stderr and HEADLESS in out.stderr
    assert "model.task=causal_lm" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "run" / "probe.h5").exists()
    # with its head the same command runs: the model the message points to
    fixed = cli_in_process(*headless(wide, vocab, "circuit.method=[eap]", "circuit.sizes=[]"),
                           "model.task=causal_lm", f"hydra.run.dir={tmp_path / 'ok'}")  # fmt: skip
    assert fixed.returncode == 0, fixed.stderr[-2000:]


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        (["+intervene.metrics=[kl]", "+intervene.p={layers: [h.0], op: patch, source: pair}"],
         "intervene.metrics"),
        (["intervene=patch_grid", "intervene.grid.layers=[h.0]"], "intervene.metrics"),
        (["intervene=patch_grid", "intervene.grid.layers=[h.0]", "intervene.grid.method=atp"],
         "intervene.metrics"),
        (["lens=logit"], "lens=logit"),
    ],
    ids=["patching", "grid", "atp", "lens"],
)  # fmt: skip
def test_every_answer_metric_refuses_a_model_without_its_head(tmp_path, wide, extra, key):
    """The patching metrics, the grid, attribution patching and the lens, each before any file."""
    from probe.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        run(make_cfg(*headless(wide, 50, *extra)), run_dir=tmp_path)
    assert key in str(e.value) and "model.task=causal_lm" in str(e.value)
    assert not (tmp_path / "probe.h5").exists()


def test_one_method_without_brackets_is_a_list_of_one(tmp_path, llama, cli_in_process):  # noqa: F811
    """Before: OmegaConf's 'str is not a ListConfig' (exit 1)."""
    args = [a for a in args_of(llama, "llama", "circuit.sizes=[]")]
    out = cli_in_process(*args, "circuit.method=eap", f"hydra.run.dir={tmp_path}")
    assert out.returncode == 0, out.stderr[-2000:]
    model, batches = direct(args)
    want = attribute(parts_of(model), batches, ["eap"])["eap"]
    with h5py.File(tmp_path / "probe.h5") as f:
        assert [k for k in f["circuit"] if k in METHODS] == ["eap"]
        np.testing.assert_allclose(f["circuit/eap/scores"][:], want.edges, rtol=1e-10, atol=1e-12)


def test_the_default_probes_on_a_token_model_name_probes_none(tmp_path, llama):  # noqa: F811
    """Before: "probe 'convs' selects no module of LlamaForCausalLM ...; widen the pattern"."""
    args = [a for a in args_of(llama, "llama", "circuit.method=[eap]") if a != "probes=none"]
    with pytest.raises(SelectionError) as e:
        run(make_cfg(*args), run_dir=tmp_path)
    message = str(e.value)
    assert "probe 'convs'" in message and "image models" in message
    assert "probes=none" in message and "probes=residual" in message


def test_sites_of_gpt2_built_without_weights_prints_the_graphs_counts(capsys):
    """The documented `python -m probe.sites model=gpt2 model.pretrained=false`. Before: the
    default synthetic images went into GPT-2's embedding ('Expected tensor for argument #1
    'indices' ... FloatTensor')."""
    from probe.hooks.site_table import main
    from probe.sites import circuit_counts

    assert main(["model=gpt2", "model.pretrained=false"], notes=circuit_counts) == 0
    out = capsys.readouterr()
    counts = ComponentGraph(12, 12, 12).counts()
    assert "component graph: " + ", ".join(f"{v:,} {k}" for k, v in counts.items()) in out.out
    assert "component graph: 158 nodes, 157 senders, 445 receivers, 32,491 edges" in out.out
    row = next(line for line in out.out.splitlines() if line.split()[:1] == ["transformer.wte"])
    assert "(8, 128)" in row and "(8, 128, 768)" in row  # token ids in, embeddings out
    assert "random_tokens" in out.err  # says where the example came from


def test_the_log_names_each_file_the_circuit_phase_wrote_once(tmp_path, llama, caplog):  # noqa: F811
    """Before: 'importances.json, importances.json, importances.json' for three methods."""
    args = args_of(llama, "llama", "circuit.method=[eap,eap_ig_activations,exact]",
                   "circuit.steps=2", "circuit.sizes=[50]")  # fmt: skip
    with caplog.at_level(logging.INFO, logger="probe"):
        run(make_cfg(*args), run_dir=tmp_path)
    (line,) = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("wrote /circuit")
    ]
    named = line.split(" and ", 1)[1].split(", ")
    assert len(named) == len(set(named))
    written = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")
               if p.is_file() and (p.suffix in (".csv", ".png", ".json"))}  # fmt: skip
    assert set(named) == written
    assert {f"mib/{m}/importances.json" for m in ("eap", "eap_ig_activations", "exact")} <= written


def _blocks(page: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", page, flags=re.S)


def test_the_circuits_page_says_what_pair_batches_hold(lm, monkeypatch, tmp_path):
    """circuits.md's first Python block, given only `model` and the pairs file it names, scores
    what a run over that file (dataset=pairs) scores."""
    from transformers import AutoModelForCausalLM

    folder, path, _ = lm
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    snippet = _blocks((ROOT / "docs" / "circuits.md").read_text(), "python")[0]
    monkeypatch.chdir(path.parent)  # (it reads pairs.pt)
    space = {"model": model}
    exec(snippet, space)
    args = ["model=hf", f"model.name={folder}", "model.task=causal_lm", "dataset=pairs",
            f"dataset.path={path}", "dataset.batch_size=2", "probes=none",
            "circuit.method=[eap,eap_ig_inputs]", "circuit.sizes=[]"]  # fmt: skip
    run(make_cfg(*args), run_dir=tmp_path)
    with h5py.File(tmp_path / "probe.h5") as f:
        for m in ("eap", "eap_ig_inputs"):
            got = space["scores"][m]
            assert got.count == f[f"circuit/{m}"].attrs["count"]
            np.testing.assert_allclose(
                got.edges, f[f"circuit/{m}/scores"][:], rtol=1e-9, atol=1e-12
            )


def test_the_checkpoint_sweep_example_names_the_task():
    page = (ROOT / "docs" / "circuits.md").read_text()
    sweep = next(b for b in _blocks(page, "bash") if "model.checkpoint=" in b)
    assert "model=hf" in sweep and "model.task=causal_lm" in sweep


def test_the_answer_token_check_is_worded_alike_for_patching_and_circuits(tmp_path, lm):
    """One check (probe.checks.check_answers) for the patching metrics, the circuit run and
    the library: pairs without wrong tokens, the same words after each key."""
    from probe.circuits.task import AnswerMetric, pair_batch
    from probe.errors import ConfigError

    folder, path, pairs = lm
    torch.save({k: v for k, v in pairs.items() if k != "wrong"}, tmp_path / "pairs.pt")
    base = ["model=hf", f"model.name={folder}", "model.task=causal_lm", "dataset=pairs",
            f"dataset.path={tmp_path / 'pairs.pt'}", "probes=none"]  # fmt: skip
    said = {}
    for key, extra in {
        "intervene.metrics: logit_diff": ["intervene=patch_grid", "intervene.metrics=[logit_diff]"],
        "circuit.metric=logit_diff": ["circuit.method=[eap]"],
    }.items():
        with pytest.raises(ConfigError) as e:
            run(make_cfg(*base, *extra), run_dir=tmp_path / "run")
        assert str(e.value).startswith(f"{key} reads the wrong tokens")
        said[key] = str(e.value).removeprefix(key)
    model, batches = direct(base)
    with pytest.raises(ConfigError) as e:
        pair_batch(model, {k: v for k, v in batches[0].items() if k != "wrong"}, AnswerMetric())
    said["library"] = str(e.value).removeprefix("circuit.metric=logit_diff")
    assert len(set(said.values())) == 1, said
    assert not (tmp_path / "run" / "probe.h5").exists()
