"""A planted circuit: a small transformer whose weights carry the answer (the token at position 0)
through three chosen heads, each moving it into the next one's value input, while every other
head and MLP reads and writes a subspace the answer never touches. EAP and exact patching put the
route's four edges on top; the circuit of those edges alone gives the clean metric, the empty
circuit the corrupt one, the full circuit the clean one."""

from __future__ import annotations

import runpy

import numpy as np
import torch

from probe.circuits.context import BatchContext
from probe.circuits.exact import evaluate, evaluate_dataset
from probe.circuits.parts import parts_of
from probe.circuits.scores import attribute
from probe.circuits.task import Ablation, AnswerMetric, pair_batch
from tests.circuits.toy import Toy, overrides
from tests.helpers import ROOT

VOCAB, WIDTH, HEADS, DH = 12, 32, 4, 8
S1, S2, S3, JUNK = slice(12, 16), slice(16, 20), slice(20, 24), slice(24, 32)
ROUTE = [(0, 1), (1, 2), (2, 0)]  # (layer, head): a0.h1 -> a1.h2 -> a2.h0
EDGES = ["input->a0.h1<v>", "a0.h1->a1.h2<v>", "a1.h2->a2.h0<v>", "a2.h0->logits"]


def planted() -> Toy:
    model = Toy(VOCAB, WIDTH, layers=3, heads=HEADS, norms=False, seed=3)
    g = torch.Generator().manual_seed(5)
    junk = lambda *shape: torch.randn(*shape, generator=g) * 0.5  # noqa: E731
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.embed.weight[:, :VOCAB] = torch.eye(VOCAB)
        model.pos.weight[:, JUNK] = junk(16, 8)
        sources = {0: slice(0, 4), 1: S1, 2: S2}
        targets = {0: S1, 1: S2, 2: S3}
        for layer, block in enumerate(model.blocks):
            attn = block.attn
            for h in range(HEADS):
                cols = slice(h * DH, (h + 1) * DH)
                attn.q.weight[cols, JUNK], attn.k.weight[cols, JUNK] = junk(8, 8), junk(8, 8)
                if (layer, h) in ROUTE:  # the value copies the previous step's subspace on
                    attn.v.weight[cols.start : cols.start + 4, sources[layer]] = torch.eye(4)
                    attn.o.weight[targets[layer], cols.start : cols.start + 4] = torch.eye(4)
                else:
                    attn.v.weight[cols, JUNK], attn.o.weight[JUNK, cols] = junk(8, 8), junk(8, 8)
            block.mlp[0].weight[:, JUNK], block.mlp[2].weight[JUNK] = junk(64, 8), junk(8, 64)
        model.head.weight[:4, S3] = torch.eye(4)
    return model


def batch():
    g = torch.Generator().manual_seed(2)
    clean = torch.randint(4, VOCAB, (6, 5), generator=g)
    answer = torch.randint(0, 4, (6,), generator=g)
    wrong = (answer + torch.randint(1, 4, (6,), generator=g)) % 4
    clean[:, 0] = answer
    corrupt = clean.clone()
    corrupt[:, 0] = wrong
    return {"input_ids": clean, "corrupt_ids": corrupt, "answer": answer[:, None],
            "wrong": wrong[:, None]}  # fmt: skip


def test_the_top_edges_are_the_planted_route_and_the_circuit_is_faithful():
    parts = parts_of(planted(), overrides(HEADS))
    pairs = batch()
    scores = attribute(parts, [pairs], ["eap", "exact"])
    for method in ("eap", "exact"):
        top = [name for name, _ in scores[method].top(4)]
        assert sorted(top) == sorted(EDGES), (method, scores[method].top(6))
        values = np.sort(np.abs(scores[method].edges))[::-1]
        assert values[3] > 100 * values[4]  # nothing else carries the answer
    # the route's heads are the top nodes too
    nodes = np.array(parts.graph.senders)[np.argsort(-np.abs(scores["exact"].nodes))[:4]]
    assert set(nodes) == {"input", "a0.h1", "a1.h2", "a2.h0"}
    metric = AnswerMetric()
    ctx = BatchContext(parts, pair_batch(parts.model, pairs, metric), metric, Ablation())
    graph = parts.graph
    keep = np.zeros((3, graph.n_edges), dtype=bool)
    keep[0] = True  # the full model
    keep[1, [graph.edge_index(e) for e in EDGES]] = True  # the route alone
    got = evaluate(ctx, keep).double().mean(1).numpy()  # and the empty circuit
    with torch.no_grad():
        corrupt = parts.model(pairs["corrupt_ids"])[:, -1].double()
    rows = torch.arange(len(corrupt))
    corrupt = (corrupt[rows, pairs["answer"][:, 0]] - corrupt[rows, pairs["wrong"][:, 0]]).mean()
    clean = ctx.clean_metric.mean().item()
    assert clean > 0.1
    np.testing.assert_allclose(got, [clean, clean, corrupt.item()], rtol=1e-5, atol=1e-6)
    halves = [{k: v[i : i + 3] for k, v in pairs.items()} for i in (0, 3)]
    np.testing.assert_allclose(evaluate_dataset(parts, halves, keep), got, rtol=1e-6)


def test_the_docs_figures_script_builds_this_planted_model_and_these_pairs():
    """scripts/plot_docs.py draws docs/circuits.md's figures from a run on its own copy of this
    model and these pairs (scripts import nothing from the tests): the same weights, the same
    logits, the same pairs."""
    script = runpy.run_path(str(ROOT / "scripts" / "plot_docs.py"))
    theirs, ours = script["planted"](), planted()
    mine = dict(ours.named_parameters())
    copied = dict(theirs.named_parameters())
    assert sorted(copied) == sorted(mine)
    for name, value in mine.items():
        assert torch.equal(copied[name], value), name
    pairs, copied_pairs = batch(), script["planted_pairs"]()
    assert sorted(copied_pairs) == sorted(pairs)
    for key, value in pairs.items():
        assert torch.equal(copied_pairs[key], value), key
    with torch.no_grad():
        both = torch.cat([pairs["input_ids"], pairs["corrupt_ids"]])
        torch.testing.assert_close(theirs(both), ours(both), rtol=0, atol=0)
