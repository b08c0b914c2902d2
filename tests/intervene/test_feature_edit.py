"""Feature edits (site=feature): zeroing, scaling or clamping a transcoder feature at chosen
positions equals a plain forward with `(new - act) x W_dec[feature]` added to that block's MLP
output by hand, and in the graph's frozen model (attention patterns, norm scales and MLP outputs
at their prompt values) zeroing a last-layer feature, whose only path to the logits is direct,
moves the answer's logit (minus the mean logit) by minus the graph's edge from it. (In the live
tiny random model the final norm's scale moves too: its strongest edge, -1.24, was a move of
-0.36 there, so a live check of a graph's claim is only as good as the frozen norms' fit.)"""

from __future__ import annotations

import pytest
import torch
import transformers

from probe.errors import ConfigError
from probe.graphs.attribution import GraphOptions, attribute
from probe.graphs.replacement import LocalReplacement
from probe.hooks.capture import Capture
from probe.hooks.hookset import HookSet
from probe.intervene.edit_hooks import EditHooks
from probe.intervene.edits import build_edits
from probe.layout import TokenBatch
from probe.models.transcoder_files import save_transcoders
from probe.plan import checked_edits
from probe.testing.random_transcoders import random_transcoders
from probe.testing.tiny_lms import TASK_CLASSES, make_tiny

PROMPT = torch.tensor([[3, 7, 12, 9, 20, 5, 14]])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = make_tiny("gpt2", tmp_path_factory.mktemp("gpt2"))
    model = getattr(transformers, TASK_CLASSES["gpt2"]).from_pretrained(folder).eval().double()
    tset = random_transcoders(dtype=torch.float64)
    path = save_transcoders(tset, tmp_path_factory.mktemp("tc"))
    return model, tset, str(path)


def edited_logits(model, path, **edit) -> torch.Tensor:
    specs = checked_edits({"f": {"site": "feature", **edit}})
    edits = build_edits(model, specs, seed=0, transcoders=path)
    capture = Capture([])
    with EditHooks(edits, capture), capture, torch.no_grad():
        capture.begin(1, 0, TokenBatch.of(PROMPT, None))
        out = model(PROMPT).logits
        capture.end()
    return out[0].double()


def hand_logits(model, tset, layer, feature, positions, new) -> torch.Tensor:
    """A plain forward with (new(act) - act) x W_dec[feature] added to block `layer`'s MLP
    output at `positions`, act read from the MLP's input."""
    t = tset.transcoders[layer]
    hooks = HookSet("hand")

    def add(module, args, out):
        act = t.encode(args[0])[..., feature]
        delta = torch.zeros_like(act)
        delta[:, positions] = (new(act) - act)[:, positions]
        return out + delta[..., None] * t.W_dec[feature]

    with hooks, torch.no_grad():
        hooks.forward(model.transformer.h[layer].mlp, add)
        return model(PROMPT).logits[0].double()


def active_feature(model, tset, layer, pos) -> int:
    with torch.no_grad():
        x = {}
        hooks = HookSet("read")
        with hooks:
            hooks.forward(model.transformer.h[layer].mlp, lambda m, a, o: x.update(x=a[0]))
            model(PROMPT)
        return int(tset.transcoders[layer].encode(x["x"])[0, pos].argmax())


@pytest.mark.parametrize(
    "op,extra,new",
    [
        ("zero", {}, torch.zeros_like),
        ("scale", {"factor": 3.0}, lambda a: 3 * a),
        ("clamp", {"value": 2.5}, lambda a: torch.full_like(a, 2.5)),
    ],
)
def test_feature_edit_equals_a_hand_forward(setup, op, extra, new):
    model, tset, path = setup
    f = active_feature(model, tset, 0, 2)
    got = edited_logits(model, path, op=op, layer=0, feature=f, positions=[2, -1], **extra)
    want = hand_logits(model, tset, 0, f, [2, 6], new)
    clean = model(PROMPT).logits[0].double().detach()
    assert (want - clean).abs().max() > 1e-4  # the edit moves the output
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_zeroing_a_last_layer_feature_moves_the_answer_as_its_graph_edge_says(setup):
    model, tset, path = setup
    graph = attribute(model, PROMPT[0], tset, GraphOptions(batch_size=64, floor=0.0))
    nodes = graph.nodes()
    row = graph.adjacency.to_dense()[graph.offsets["logit"]]  # edges into the top logit
    last = nodes[(nodes.kind == "feature") & (nodes.layer == 1) & (nodes.pos == 6)]
    last = last.iloc[row[torch.tensor(last.node.to_numpy())].abs().argsort(descending=True)[:8]]
    weights = row[torch.tensor(last.node.to_numpy())].double()  # the 8 strongest, the first first
    token = int(graph.logit_tokens[0])

    def answer(logits):  # the top logit's node: the logit minus the mean logit
        return float(logits[-1, token] - logits[-1].mean())

    rep = LocalReplacement(model, tset, mode="record")
    with torch.no_grad(), rep:
        clean = answer(model(PROMPT).logits[0].double())
    rep.mode = "replay"
    moved = []
    for feature in last.feature.tolist():
        with rep:  # attention patterns, norm scales and MLP outputs frozen: the graph's model
            edited = edited_logits(model, path, op="zero", layer=1, feature=feature, positions=[-1])
        moved.append(answer(edited) - clean)
    # in the frozen model, zeroing a feature whose only path is direct moves the logit by
    # exactly minus its edge weight
    # (the adjacency is float32)
    torch.testing.assert_close(
        torch.tensor(moved, dtype=torch.float64), -weights, rtol=1e-5, atol=1e-6
    )


def test_feature_edits_refused_by_name(setup, tmp_path):
    model, tset, path = setup
    with pytest.raises(ConfigError, match="needs layer"):
        checked_edits({"f": {"site": "feature", "op": "zero", "feature": 3}})
    with pytest.raises(ConfigError, match="op \\(site=feature\\)='noise' is unknown"):
        checked_edits({"f": {"site": "feature", "op": "noise", "layer": 0, "feature": 3}})
    with pytest.raises(ConfigError, match="not min"):
        checked_edits(
            {"f": {"site": "feature", "op": "clamp", "layer": 0, "feature": 3, "min": 0.0}}
        )
    specs = checked_edits({"f": {"site": "feature", "op": "zero", "layer": 0, "feature": 999}})
    with pytest.raises(ConfigError, match="feature=999 but layer 0's transcoder has 128"):
        build_edits(model, specs, 0, path)
    with pytest.raises(ConfigError, match="graph.transcoders=PATH"):
        build_edits(model, specs, 0)
    specs = checked_edits({"f": {"site": "feature", "op": "zero", "layer": 5, "feature": 1}})
    with pytest.raises(ConfigError, match="no layer 5"):
        build_edits(model, specs, 0, path)


def test_a_set_reading_mlp_normalized_edits_from_the_norm_without_weight_and_bias(setup, tmp_path):
    """reads=mlp_normalized (TransformerLens's ln2.hook_normalized): the feature's activation
    is read from ln_2's input layer-normed without ln_2's weight and bias (F.layer_norm)."""
    model, _, _ = setup
    tset = random_transcoders(reads="mlp_normalized", dtype=torch.float64)
    path = str(save_transcoders(tset, tmp_path / "tc"))
    t, ln = tset.transcoders[0], model.transformer.h[0].ln_2
    hooks, seen = HookSet("hand"), {}

    def keep(module, args):
        seen["x"] = torch.nn.functional.layer_norm(args[0], args[0].shape[-1:], eps=ln.eps)

    def add(module, args, out):
        act = t.encode(seen["x"])[..., 3]
        delta = torch.zeros_like(act)
        delta[:, 2] = -act[:, 2]
        return out + delta[..., None] * t.W_dec[3]

    with hooks, torch.no_grad():
        hooks.forward_pre(ln, keep)
        hooks.forward(model.transformer.h[0].mlp, add)
        want = model(PROMPT).logits[0].double()
    got = edited_logits(model, path, op="zero", layer=0, feature=3, positions=[2])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
