"""A run's graphs drawn and reported, and a feature edit in a run: a run with graph.transcoders
writes each prompt's graph as circuit-tracer's JSON in graph_json/, python -m probe.plot writes
graph_<prompt>.png for its first prompts, report.html has its graphs section, and a run with a site=feature edit measures in effects.csv the change a hand
forward gives."""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest
import torch

from probe.graphs.graph_files import load_graph
from probe.graphs.graph_json import graph_model
from probe.models.transcoder_files import save_transcoders
from probe.testing.compose import QUIET
from probe.testing.random_transcoders import random_transcoders

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_gpt2):
    root = tmp_path_factory.mktemp("graph_edits")
    ids = torch.randint(1, 40, (4, 6), generator=torch.Generator().manual_seed(1))
    torch.save({"input_ids": ids}, root / "ids.pt")
    tset = random_transcoders()
    return root, ids, tset, save_transcoders(tset, root / "tc")


def probe_cli(tmp_path, *args: str):
    done = subprocess.run([sys.executable, "-m", "probe", *QUIET, *args,
                           f"hydra.run.dir={tmp_path}"], capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return tmp_path


def base(tiny_gpt2, root) -> list[str]:
    return ["model=hf", f"model.name={tiny_gpt2[0]}", "model.task=causal_lm", "probes=none",
            "dataset=tokens", f"dataset.path={root / 'ids.pt'}", "dataset.batch_size=2"]  # fmt: skip


def test_a_graph_runs_pictures_and_report(tiny_gpt2, files, tmp_path):
    root, ids, tset, yaml = files
    run = probe_cli(tmp_path / "run", *base(tiny_gpt2, root), f"graph.transcoders={yaml}")
    done = subprocess.run([sys.executable, "-m", "probe.plot", str(run)], capture_output=True,
                          text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in run.glob("graph_*.png")) == [f"graph_{i}.png" for i in range(3)]
    from probe.report.page import write

    page = write(run).read_text()
    assert "<h3>Attribution graphs</h3>" in page and 'alt="graph_2.png"' in page
    assert "graph_features.csv" in page and page.count('alt="graph_') == 3
    assert "top examples" in page and "<b>" in page
    # each prompt's graph as circuit-tracer's JSON, the folder's index listing them all
    index = json.loads((run / "graph_json" / "graph-metadata.json").read_text())
    assert [g["slug"] for g in index["graphs"]] == [f"prompt_{i}" for i in range(len(ids))]
    for i in range(len(ids)):
        got = json.loads((run / "graph_json" / f"prompt_{i}.json").read_text())
        assert got == json.loads(json.dumps(graph_model(load_graph(run, i), f"prompt_{i}",
                                                        node_threshold=0.8)))  # fmt: skip


def test_a_feature_edit_runs_effects_equal_a_hand_forward(tiny_gpt2, files, tmp_path):
    from transformers import AutoModelForCausalLM

    root, ids, tset, yaml = files
    t = tset.transcoders[1]
    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2[0]).eval()
    mlp = model.transformer.h[1].mlp
    seen = {}
    handle = mlp.register_forward_hook(lambda m, a, o: seen.update(x=a[0]))
    with torch.no_grad():
        clean = model(ids).logits[:, -1].double()
    handle.remove()
    feature = int(t.encode(seen["x"])[:, -1].sum(0).argmax())  # active at the last positions

    def hand(m, args, out):
        act = t.encode(args[0])[..., feature]
        delta = torch.zeros_like(act)
        delta[:, -1] = -act[:, -1]
        return out + delta[..., None] * t.W_dec[feature]

    handle = mlp.register_forward_hook(hand)
    with torch.no_grad():
        edited = model(ids).logits[:, -1].double()
    handle.remove()
    edit = f"{{site: feature, op: zero, layer: 1, feature: {feature}, positions: [-1], transcoders: '{yaml}'}}"
    run = probe_cli(tmp_path / "run", *base(tiny_gpt2, root), f"+intervene.f={edit}")
    effects = pd.read_csv(run / "effects.csv")
    want = float((edited - clean).abs().mean())
    assert want > 1e-4
    assert effects.loc[0, "mean_abs_change"] == pytest.approx(want, rel=1e-4)
    assert effects.loc[0, "samples"] == len(ids)
