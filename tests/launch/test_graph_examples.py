"""graph.examples: a graph run's kept features get circuit-tracer's example files from a run of
the set's features over a dataset: each file's examples are the dataset's top activations of the
feature (a hand maximum with forward hooks), its per-token activations the feature's at those
tokens, its logits the decoder row through the unembedding; the files validate against
circuit-tracer's feature model and the graph JSON points its viewer at them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from probe.graphs.graph_json import cantor_pairing
from probe.models.transcoder_files import save_transcoders
from probe.testing.peers import circuit_tracer_source
from probe.testing.random_transcoders import random_transcoders
from probe.testing.tiny_lms import make_tiny, make_tokenizer
from tests.helpers import run_probe
from tests.hooks.test_transcoder_site import K, block_inputs, hand_topk


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The examples run (24 x 12 tokens, the set's features with stats.topk) and a graph run of
    two prompts naming it."""
    root = tmp_path_factory.mktemp("graph_examples")
    model = make_tokenizer(make_tiny("gpt2", root / "gpt2", vocab_size=50))
    ids = torch.randint(4, 50, (24, 12), generator=torch.Generator().manual_seed(0))
    torch.save({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, root / "ids.pt")
    torch.save({"input_ids": ids[:2, :7]}, root / "prompts.pt")
    tset = random_transcoders(seed=3)
    save_transcoders(tset, root / "tc")
    base = ["model=hf", f"model.name={model}", "model.task=causal_lm", "probes=none",
            "dataset=tokens"]  # fmt: skip
    _, f = run_probe(root / "examples", *base, f"dataset.path={root / 'ids.pt'}",
                     "+probes.tc.layers=[@blocks.mlp]", "+probes.tc.capture=[]",
                     "+probes.tc.rows=tokens", f"+probes.tc.transcoders={root / 'tc'}",
                     f"stats.topk={K}")  # fmt: skip
    f.close()
    _, f = run_probe(root / "graph", *base, f"dataset.path={root / 'prompts.pt'}",
                     f"graph.transcoders={root / 'tc'}",
                     f"graph.examples={root / 'examples'}")  # fmt: skip
    f.close()
    return root, model, ids, tset


def test_kept_features_get_their_dataset_examples(runs):
    import pandas as pd
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, model_dir, ids, tset = runs
    folder = root / "graph" / "graph_json"
    nodes = pd.read_csv(root / "graph" / "graph_nodes.csv")
    kept = nodes[(nodes["kind"] == "feature") & nodes["kept"]]
    features = sorted(set(zip(kept["layer"], kept["feature"], strict=True)))
    assert len(features) > 3
    written = sorted((folder / "features").glob("*.json"))
    assert sorted(p.stem for p in written) == sorted(str(cantor_pairing(*f)) for f in features)
    want = hand_topk(model_dir, ids, tset, "mlp")
    tok = AutoTokenizer.from_pretrained(model_dir)
    unembed = AutoModelForCausalLM.from_pretrained(model_dir).lm_head.weight.detach()
    # the hand features at every token: (layer, sample, position) -> activations (d_tc,)
    acts = hand_features(model_dir, ids, tset)
    for layer, feature in features:
        data = json.loads(
            (folder / "features" / f"{cantor_pairing(layer, feature)}.json").read_text()
        )
        examples = data["examples_quantiles"][0]["examples"]
        values, keys = want[layer]
        top = [ex["tokens_acts_list"][ex["train_token_ind"]] for ex in examples]
        np.testing.assert_allclose(top, values[feature], rtol=1e-4, atol=1e-5)
        for ex, key in zip(examples, keys[feature], strict=True):
            sample, pos = divmod(int(key), ids.shape[1])
            lo = pos - ex["train_token_ind"]
            window = range(lo, lo + len(ex["tokens"]))
            assert ex["tokens"] == [tok.decode([int(ids[sample, p])]) for p in window]
            hand = [float(acts[layer][sample, p, feature]) for p in window]
            np.testing.assert_allclose(ex["tokens_acts_list"], hand, rtol=1e-4, atol=1e-5)
        effect = unembed @ tset[layer].W_dec[feature].detach()
        assert data["top_logits"][0] == tok.decode([int(effect.argmax())])
        assert data["bottom_logits"][0] == tok.decode([int(effect.argmin())])
        assert data["act_max"] == pytest.approx(values[feature][0], rel=1e-4)
    # the report lists each feature of graph_features.csv with its dataset examples
    import html

    from probe.report.graph_figure import section

    page = section(root / "graph", figures={})
    listed = pd.read_csv(root / "graph" / "graph_features.csv").head(20)
    for layer, feature in zip(listed["layer"], listed["feature"], strict=True):
        data = json.loads(
            (folder / "features" / f"{cantor_pairing(layer, feature)}.json").read_text()
        )
        best = data["examples_quantiles"][0]["examples"][0]
        at = best["train_token_ind"]
        shown = f"<b>{html.escape(best['tokens'][at])}</b> ({best['tokens_acts_list'][at]:.2f})"
        assert shown in page
    graph = json.loads((folder / "prompt_0.json").read_text())
    assert graph["metadata"]["transcoder_list"] == ["./data/features"] * 2
    assert graph["metadata"]["scan"].startswith("custom")
    assert graph["metadata"]["feature_details"] == {"feature_json_base_url": "features"}
    if circuit_tracer_source() is not None:
        pytest.importorskip("pydantic")
        models = pytest.importorskip("circuit_tracer.frontend.feature_models")
        for path in written:
            models.Model.model_validate_json(path.read_text())


def hand_features(model_dir, ids, tset) -> dict[int, torch.Tensor]:
    """{layer: (samples, positions, d_tc)} features of each block's MLP input, float64."""
    inputs = block_inputs(model_dir, ids, "mlp")
    return {
        layer: torch.relu(inputs[layer] @ t.W_enc.detach().double() + t.b_enc.detach().double())
        for layer, t in tset.transcoders.items()
    }


def test_a_graph_examples_key_naming_no_feature_run_is_refused(runs, tmp_path):
    from probe.errors import DataError

    root, model_dir, _, _ = runs
    with pytest.raises(DataError, match="holds no transcoder features: run the model over a"):
        run_probe(tmp_path / "g", "model=hf", f"model.name={model_dir}", "model.task=causal_lm",
                  "probes=none", "dataset=tokens", f"dataset.path={root / 'prompts.pt'}",
                  f"graph.transcoders={root / 'tc'}",
                  f"graph.examples={root / 'graph'}")  # fmt: skip


def test_the_picture_labels_each_cells_strongest_feature_with_its_top_token(runs):
    """graph_<prompt>.png: per (layer, position) cell, the most influential kept feature is
    labelled with its example file's top token; cantor_unpairing inverts the file names."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from probe.graphs.graph_files import load_graph
    from probe.graphs.graph_json import cantor_unpairing
    from probe.report.graph_figure import example_labels, graph_figures, node_positions

    root, *_ = runs
    assert all(
        cantor_unpairing(cantor_pairing(a, b)) == (a, b) for a in range(9) for b in range(300)
    )
    labels = example_labels(root / "graph")
    folder = root / "graph" / "graph_json" / "features"
    for (layer, feature), text in labels.items():
        data = json.loads((folder / f"{cantor_pairing(layer, feature)}.json").read_text())
        best = data["examples_quantiles"][0]["examples"][0]
        assert text == repr(best["tokens"][best["train_token_ind"]])
    fig = graph_figures(root / "graph", "t", count=1)["graph_0.png"]
    drawn = {(round(t.xy[0], 6), round(t.xy[1], 6)): t.get_text() for t in fig.axes[0].texts}
    nodes = node_positions(load_graph(root / "graph", 0))
    feats = nodes[nodes["kind"] == "feature"]
    cells = 0
    for _, cell in feats.groupby(["layer", "pos"]):
        best = cell.sort_values("influence", ascending=False).iloc[0]
        where = (round(best["x"], 6), round(best["y"], 6))
        assert drawn[where] == labels[int(best["layer"]), int(best["feature"])]
        others = cell.drop(index=best.name)
        assert not any((round(x, 6), round(y, 6)) in drawn
                       for x, y in zip(others["x"], others["y"], strict=True))  # fmt: skip
        cells += 1
    assert cells > 1
    plt.close(fig)
