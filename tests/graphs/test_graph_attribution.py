"""Edge weights are direct effects: adding a source's write again in the frozen forward (attention
patterns, norm scales and MLP outputs at their prompt values, skip paths live) moves each target
by exactly its edge weight (circuit-tracer's own check), on a tiny GPT-2 and a tiny Llama with
random transcoders of each kind and both reading places. Also: the replacement model's forward is
bitwise the model's, chunking and the floor leave the graph as it is, bad input is refused."""

from __future__ import annotations

import pytest
import torch
import transformers

from probe.errors import ConfigError
from probe.graphs import attribution
from probe.graphs.attribution import DEFAULT_FLOOR, GraphOptions, attribute, kept_by_floor
from probe.graphs.replacement import LocalReplacement
from probe.hooks.hookset import HookSet
from probe.models.transcoder import TranscoderSet
from probe.testing.random_transcoders import random_transcoders as transcoders
from probe.testing.tiny_lms import TASK_CLASSES, make_tiny

PROMPT = torch.tensor([3, 7, 12, 9, 20, 5, 14])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for kind in ("gpt2", "llama", "bert"):
        folder = make_tiny(kind, tmp_path_factory.mktemp(kind))
        out[kind] = getattr(transformers, TASK_CLASSES[kind]).from_pretrained(folder).eval()
    return out


def error_vectors(rep: LocalReplacement, ts: TranscoderSet) -> dict[int, torch.Tensor]:
    """Each layer's error on the recorded prompt: the MLP's output minus the transcoder's, with
    position 0's features and error zeroed."""
    out = {}
    with torch.no_grad():
        for layer, t in ts.transcoders.items():
            x = rep.saved["inputs"][layer][0]
            acts = t.encode(x)
            acts[0] = 0
            err = rep.saved["mlp"][layer][0] - (t.decode(acts) + t.skip(x))
            err[0] = 0
            out[layer] = err
    return out


def frozen_targets(model, rep, ts, graph, add=None) -> torch.Tensor:
    """The graph's targets in the frozen forward (replay), with `add` = (module, pos, vector)
    added to that module's output at that position: feature pre-activations, then logits minus
    their mean at the last position."""
    hooks = HookSet("intervention")
    with torch.no_grad(), rep, hooks:
        if add is not None:
            module, pos, vec = add

            def plus(m, args, out):
                out = out.clone()
                out[0, pos] += vec.to(out.dtype)
                return out

            hooks.forward(module, plus)
        logits = model(graph.tokens[None]).logits[0, -1]
        pre = {
            layer: t.pre_activations(rep.captured.inputs[layer][0])
            for layer, t in ts.transcoders.items()
        }
        f = graph.features
        feats = torch.stack([pre[int(a)][p, k] for a, p, k in f.tolist()]) if len(f) else logits[:0]
        return torch.cat([feats, logits[graph.logit_tokens] - logits.mean()])


CASES = [
    ("gpt2", "mlp_in", "relu", True),
    ("gpt2", "resid_mid", "jumprelu", False),
    ("llama", "mlp_in", "topk", False),
    ("llama", "resid_mid", "relu", True),
    ("gpt2", "mlp_normalized", "relu", True),
    ("llama", "mlp_normalized", "jumprelu", False),
]


@pytest.mark.parametrize("kind,reads,activation,skip", CASES)
def test_edge_weights_equal_a_hand_perturbation_in_the_frozen_model(models, kind, reads, activation, skip):  # fmt: skip
    model = models[kind].double()
    try:
        ts = transcoders(reads=reads, activation=activation, skip=skip, dtype=torch.float64)
        graph = attribute(model, PROMPT, ts, GraphOptions(batch_size=32, floor=0.0))
        assert graph.n_features > 20 and graph.n_logits >= 1
        rep = LocalReplacement(model, ts, mode="record")
        seen, hooks = {}, HookSet("norm inputs")
        with torch.no_grad(), rep, hooks:
            for layer, norm in enumerate(rep.parts.mlp_norms):
                hooks.forward_pre(norm, lambda m, a, i=layer: seen.update({i: a[0]}))
            model(PROMPT[None])
        rep.mode = "replay"
        if reads == "mlp_normalized":  # the norm's output before its weight and bias, by hand
            for layer, x in seen.items():
                eps = getattr(rep.parts.mlp_norms[layer], "variance_epsilon", None)
                want = (
                    torch.nn.functional.layer_norm(x, x.shape[-1:], eps=1e-5)
                    if eps is None
                    else x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
                )
                torch.testing.assert_close(rep.saved["inputs"][layer], want)
        errors = error_vectors(rep, ts)
        clean = frozen_targets(model, rep, ts, graph)
        dense = graph.adjacency.to_dense().double()
        targets = torch.cat([torch.arange(graph.n_features), torch.arange(graph.n_nodes - graph.n_logits, graph.n_nodes)])  # fmt: skip
        off = graph.offsets
        sources = [
            ("feature", i) for i in range(0, graph.n_features, max(1, graph.n_features // 12))
        ]
        sources += [("error", i) for i in range(graph.n_errors)] + [
            ("token", p) for p in range(graph.n_pos)
        ]
        for kind_, i in sources:
            if kind_ == "feature":
                layer, pos, f = graph.features[i].tolist()
                add = (
                    rep.parts.mlps[layer],
                    pos,
                    graph.activations[i].double() * ts[layer].W_dec[f],
                )
            elif kind_ == "error":
                layer, pos = divmod(i, graph.n_pos)
                add = (rep.parts.mlps[layer], pos, errors[layer][pos])
            else:
                add = (rep.parts.embed, i, model.get_input_embeddings().weight[PROMPT[i]])
            moved = frozen_targets(model, rep, ts, graph, add) - clean
            column = dense[targets, off[kind_] + i]
            scale = dense.abs().max()
            torch.testing.assert_close(moved, column, rtol=1e-5, atol=1e-6 * float(scale))
    finally:
        model.float()


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_the_replacement_forward_is_the_model_forward_bitwise(models, kind):
    model = models[kind]
    batch = PROMPT[None].expand(5, -1)
    with torch.no_grad():
        plain = model(batch).logits
    with LocalReplacement(model, transcoders(skip=True)):
        replaced = model(batch).logits
    assert torch.equal(plain, replaced)
    assert replaced.requires_grad  # the backward runs through the frozen linear map
    assert all(p.requires_grad for p in model.parameters())  # restored on exit


def test_chunks_and_a_graph_computed_in_one_backward_agree(models):
    ts = transcoders(skip=True)
    small = attribute(models["gpt2"], PROMPT, ts, GraphOptions(batch_size=61, floor=0.0))
    one = attribute(models["gpt2"], PROMPT, ts, GraphOptions(batch_size=1024, floor=0.0))
    assert torch.equal(small.features, one.features)
    torch.testing.assert_close(small.adjacency.to_dense(), one.adjacency.to_dense(), rtol=1e-5, atol=1e-6)  # fmt: skip


def test_position_zero_has_no_feature_and_its_error_writes_nothing(models):
    graph = attribute(models["llama"], PROMPT, transcoders(), GraphOptions(floor=0.0))
    assert (graph.features[:, 1] > 0).all()
    r, c = graph.adjacency.indices()
    err0 = [graph.offsets["error"] + layer * graph.n_pos for layer in range(graph.n_layers)]
    assert not torch.isin(c, torch.tensor(err0)).any()
    assert graph.active_features == graph.n_features


def test_max_feature_nodes_takes_the_most_influential_by_the_logit_rows(models):
    """With one ranking round, the features chosen are the top ones by circuit-tracer's partial
    influence of the logit rows (computed here densely), and their rows are the full graph's."""
    ts = transcoders(skip=True)
    full = attribute(models["gpt2"], PROMPT, ts, GraphOptions(floor=0.0))
    k = 17
    part = attribute(models["gpt2"], PROMPT, ts, GraphOptions(floor=0.0, max_feature_nodes=k, batch_size=32))  # fmt: skip
    a = full.adjacency.to_dense()
    logit_rows = a[-full.n_logits :, : -full.n_logits].abs()
    norm = logit_rows / logit_rows.sum(1, keepdim=True).clamp(min=1e-8)
    influence = full.logit_probs @ norm  # one step: the logit rows read no logit
    top = torch.argsort(influence[: full.n_features], descending=True)[:k].sort().values
    assert torch.equal(part.features, full.features[top])
    cols = torch.cat([top, torch.arange(full.n_features, full.n_nodes)])
    sub = a[cols][:, cols]
    torch.testing.assert_close(part.adjacency.to_dense(), sub, rtol=1e-5, atol=1e-6)
    assert part.active_features == full.n_features


def test_the_floor_leaves_the_pruned_graph_as_it_is(models):
    ts = transcoders(skip=True)
    exact = attribute(models["gpt2"], PROMPT, ts, GraphOptions(floor=0.0)).prune()
    floored = attribute(models["gpt2"], PROMPT, ts, GraphOptions(floor=DEFAULT_FLOOR)).prune()
    assert floored.adjacency._nnz() < exact.adjacency._nnz()
    assert torch.equal(exact.node_kept, floored.node_kept)
    kept = exact.edges()[["target", "source"]].values.tolist()
    assert floored.edges()[["target", "source"]].values.tolist() == kept
    for score in ("replacement", "completeness"):
        assert floored.scores[score] == pytest.approx(exact.scores[score], abs=1e-3)
    # written in (target, source) order, no entry twice: what coalesce() gives
    a = floored.adjacency
    assert a.is_coalesced() and a.indices().dtype == torch.long
    assert torch.equal(a.indices(), a.to_dense().to_sparse().indices())


def test_the_floor_drops_a_rows_smallest_entries_while_their_sum_stays_under_the_bound():
    g = torch.Generator().manual_seed(0)
    dense = torch.randn(6, 50, generator=g) * torch.rand(6, 50, generator=g).pow(8)
    dense[0, :10] = 0
    dense[1] = 0
    for floor in (0.0, 1e-6, 1e-3, 0.05):
        keep = kept_by_floor(dense, floor)
        for row, kept in zip(dense.abs().double(), keep, strict=True):
            want, dropped = torch.zeros_like(kept), 0.0
            for j in torch.argsort(row).tolist():  # by hand: smallest first
                if row[j] == 0:
                    continue
                if dropped + row[j] < floor * row.sum():
                    dropped += float(row[j])
                else:
                    want[j] = True
            assert torch.equal(kept, want)
            assert row[~kept].sum() < floor * row.sum() or row.sum() == 0 or floor == 0


def test_small_storage_blocks_give_the_same_graph(models, monkeypatch):
    """Rows stored across many blocks (the smallest 16 entries) give the graph one block gives,
    and so do the influence rankings of max_feature_nodes."""
    ts = transcoders(skip=True)
    options = GraphOptions(batch_size=8, floor=0.0, max_feature_nodes=40, update_interval=1)
    one = attribute(models["gpt2"], PROMPT, ts, options)
    monkeypatch.setattr(attribution, "BLOCK_MIN", 16)
    monkeypatch.setattr(attribution, "BLOCK_MAX", 64)
    many = attribute(models["gpt2"], PROMPT, ts, options)
    assert torch.equal(one.features, many.features)
    assert torch.equal(one.adjacency.indices(), many.adjacency.indices())
    assert torch.equal(one.adjacency.values(), many.adjacency.values())


def test_post_norm_and_unknown_families_are_refused_by_name(models):
    with pytest.raises(ConfigError, match="'bert' is a post-norm model"):
        attribute(models["bert"], PROMPT, transcoders())
    model = models["gpt2"]
    model.config.model_type = "mystery"
    try:
        with pytest.raises(ConfigError, match="'mystery' model cannot be built.*mlp_out"):
            attribute(model, PROMPT, transcoders())
    finally:
        model.config.model_type = "gpt2"
    headless = model.transformer  # (GPT2Model: the same blocks, no LM head)
    with pytest.raises(ConfigError, match="'gpt2' model has no LM head \\(GPT2Model makes no"):
        attribute(headless, PROMPT, transcoders())


def test_bad_input_is_refused_by_name(models):
    with pytest.raises(ConfigError, match=r"graph.max_logits=0"):
        GraphOptions(max_logits=0)
    with pytest.raises(ConfigError, match=r"graph.edges='some'"):
        GraphOptions(edges="some")
    with pytest.raises(ConfigError, match=r"graph.floor=2"):
        GraphOptions(floor=2)
    with pytest.raises(ConfigError, match="longer than the model's context of 512"):
        attribute(models["gpt2"], torch.ones(513, dtype=torch.long), transcoders())
    with pytest.raises(ConfigError, match="reads 16 and writes 16.*32 wide"):
        attribute(models["gpt2"], PROMPT, transcoders(width=16))
    with pytest.raises(ConfigError, match="3 layers, the model 2"):
        attribute(models["gpt2"], PROMPT, transcoders(layers=3))
