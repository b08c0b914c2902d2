"""Attribution graphs through a cross-layer transcoder: each edge weight is the direct effect in
the frozen forward (a feature's write added again into its layer's and every later layer's MLP
output, an error or a token embedding added again, moves every target by exactly its edge
weight), with errors computed here by hand from the CLT's formula; the nodes and the
reconstruction are circuit-tracer's own CrossLayerTranscoder's (its source, where unpacked).
The whole graph against circuit-tracer's `attribute` is scripts/graph_peers.py's comparison
(docs/bench/graphs.md)."""

from __future__ import annotations

import pytest
import torch
import transformers

from probe.errors import ConfigError
from probe.graphs.attribution import GraphOptions, attribute
from probe.graphs.replacement import LocalReplacement
from probe.hooks.hookset import HookSet
from probe.models.cross_layer_transcoder import CrossLayerTranscoder
from probe.testing.random_transcoders import random_cross_layer
from probe.testing.tiny_lms import TASK_CLASSES, make_tiny

PROMPT = torch.tensor([3, 7, 12, 9, 20, 5, 14])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for kind in ("gpt2", "llama"):
        folder = make_tiny(kind, tmp_path_factory.mktemp(kind))
        out[kind] = getattr(transformers, TASK_CLASSES[kind]).from_pretrained(folder).eval()
    return out


def hand_errors(rep: LocalReplacement, clt: CrossLayerTranscoder) -> list[torch.Tensor]:
    """Each layer's error on the recorded prompt, written out: the MLP's output minus b_dec,
    the skip path and the writes of every feature of this and every earlier layer (position 0's
    features dropped, its error zeroed)."""
    n = len(clt)
    acts = []
    with torch.no_grad():
        for layer in range(n):
            x = rep.saved["inputs"][layer][0]
            pre = x @ clt.W_enc[layer] + clt.b_enc[layer]
            a = pre.clamp(min=0) if clt.activation == "relu" else pre * (pre > clt.threshold[layer])
            a[0] = 0
            acts.append(a)
        errors = []
        for target in range(n):
            x = rep.saved["inputs"][target][0]
            recon = clt.b_dec[target] + sum(
                acts[s] @ clt.W_dec[s][:, target - s] for s in range(target + 1)
            )
            if clt.W_skip is not None:
                recon = recon + x @ clt.W_skip[target]
            err = rep.saved["mlp"][target][0] - recon
            err[0] = 0
            errors.append(err)
    return errors


def frozen_targets(model, rep, clt, graph, adds=()) -> torch.Tensor:
    """The graph's targets in the frozen forward (replay) with each (module, pos, vector) of
    `adds` added to that module's output: feature pre-activations, then logits minus their mean
    at the last position."""
    hooks = HookSet("intervention")
    with torch.no_grad(), rep, hooks:
        for module, pos, vec in adds:

            def plus(m, args, out, pos=pos, vec=vec):
                out = out.clone()
                out[0, pos] += vec.to(out.dtype)
                return out

            hooks.forward(module, plus)
        logits = model(graph.tokens[None]).logits[0, -1]
        pre = [
            clt.pre_activations(layer, rep.captured.inputs[layer][0]) for layer in range(len(clt))
        ]
        f = graph.features
        feats = torch.stack([pre[int(a)][p, k] for a, p, k in f.tolist()])
        return torch.cat([feats, logits[graph.logit_tokens] - logits.mean()])


@pytest.mark.parametrize(
    "kind,reads,activation,skip",
    [("gpt2", "resid_mid", "relu", False), ("llama", "mlp_in", "jumprelu", True)],
)
def test_clt_edge_weights_equal_a_hand_perturbation_in_the_frozen_model(models, kind, reads, activation, skip):  # fmt: skip
    model = models[kind].double()
    try:
        width, n = model.config.hidden_size, model.config.num_hidden_layers
        clt = random_cross_layer(width, n, reads=reads, activation=activation, skip=skip,
                                 dtype=torch.float64)  # fmt: skip
        graph = attribute(model, PROMPT, clt, GraphOptions(batch_size=64, floor=0.0))
        assert graph.n_features > 20 and graph.n_logits >= 1 and n >= 2
        rep = LocalReplacement(model, clt, mode="record")
        with torch.no_grad(), rep:
            model(PROMPT[None])
        rep.mode = "replay"
        errors = hand_errors(rep, clt)
        clean = frozen_targets(model, rep, clt, graph)
        dense = graph.adjacency.to_dense().double()
        targets = torch.cat([torch.arange(graph.n_features), torch.arange(graph.n_nodes - graph.n_logits, graph.n_nodes)])  # fmt: skip
        off, mlps = graph.offsets, rep.parts.mlps
        # features of the first layer (writing to every layer) and of the last, errors, tokens
        layer0 = (graph.features[:, 0] == 0).nonzero()[:, 0]
        last = (graph.features[:, 0] == n - 1).nonzero()[:, 0]
        sources = [("feature", int(i)) for i in [*layer0[:: max(1, len(layer0) // 6)], *last[:3]]]
        sources += [("error", i) for i in range(graph.n_errors)]
        sources += [("token", p) for p in range(graph.n_pos)]
        for kind_, i in sources:
            if kind_ == "feature":
                layer, pos, f = graph.features[i].tolist()
                a = graph.activations[i].double()
                adds = [
                    (mlps[layer + j], pos, a * clt.W_dec[layer][f, j]) for j in range(n - layer)
                ]
            elif kind_ == "error":
                layer, pos = divmod(i, graph.n_pos)
                adds = [(mlps[layer], pos, errors[layer][pos])]
            else:
                adds = [(rep.parts.embed, i, model.get_input_embeddings().weight[PROMPT[i]])]
            moved = frozen_targets(model, rep, clt, graph, adds) - clean
            column = dense[targets, off[kind_] + i]
            scale = dense.abs().max()
            torch.testing.assert_close(moved, column, rtol=1e-5, atol=1e-6 * float(scale))
    finally:
        model.float()


def test_clt_nodes_and_reconstruction_are_circuit_tracers(models, tmp_path):
    """circuit-tracer's CrossLayerTranscoder (its load_clt on the files save_cross_layer wrote)
    on the prompt's inputs: the same active features in the same order, the same activations,
    and its reconstruction (b_dec and every write) is the one the errors are made from."""
    from probe.testing.peers import circuit_tracer_source

    if circuit_tracer_source() is None:
        pytest.skip("circuit-tracer's source is not unpacked at $PROBE_CIRCUIT_TRACER_SRC")
    from circuit_tracer.transcoder.cross_layer_transcoder import load_clt

    from probe.models.clt_files import save_cross_layer

    model = models["gpt2"]
    width, n = model.config.hidden_size, model.config.num_hidden_layers
    clt = random_cross_layer(width, n, reads="resid_mid", activation="jumprelu")
    save_cross_layer(clt, tmp_path / "clt")
    theirs = load_clt(str(tmp_path / "clt"), device=torch.device("cpu"), dtype=torch.float32,
                      lazy_decoder=False)  # fmt: skip
    graph = attribute(model, PROMPT, clt, GraphOptions(floor=0.0))
    rep = LocalReplacement(model, clt, mode="record")
    with torch.no_grad(), rep:
        model(PROMPT[None])
    inputs = torch.stack([rep.saved["inputs"][layer][0] for layer in range(n)])
    with torch.no_grad():
        parts = theirs.compute_attribution_components(inputs, zero_positions=slice(0, 1))
    act = parts["activation_matrix"].coalesce()
    assert torch.equal(act.indices().T, graph.features)
    torch.testing.assert_close(act.values(), graph.activations, rtol=1e-6, atol=1e-7)
    rep.mode = "replay"
    errors = hand_errors(rep, clt)
    for layer in range(n):
        mine = rep.saved["mlp"][layer][0] - errors[layer]
        torch.testing.assert_close(
            parts["reconstruction"][layer, 1:], mine[1:], rtol=1e-5, atol=1e-6
        )


def test_a_clt_of_other_layers_or_width_is_refused(models):
    model = models["gpt2"]
    width, n = model.config.hidden_size, model.config.num_hidden_layers
    with pytest.raises(ConfigError, match=rf"has {n + 1} layers, the model {n} blocks"):
        attribute(model, PROMPT, random_cross_layer(width, n + 1))
    with pytest.raises(ConfigError, match=rf"reads {width + 8} and writes {width + 8}"):
        attribute(model, PROMPT, random_cross_layer(width + 8, n))
