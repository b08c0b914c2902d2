"""Scores do not depend on how the work is cut: chunks of one token give the scores of one chunk,
batches merge exactly, runs repeat bit for bit, and a right-padded batch gives each pair the
scores it has alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from probe.circuits.context import BatchContext
from probe.circuits.parts import parts_of
from probe.circuits.scores import attribute, score_batch
from probe.circuits.task import Ablation, AnswerMetric, pair_batch
from probe.testing.toy_circuits import pairs
from tests.circuits.test_hand import build


@pytest.fixture(scope="module")
def llama():
    return parts_of(build("llama"))


def test_chunks_batches_and_repeats(llama):
    b1, b2 = pairs(50, n=3, seed=1), pairs(50, n=2, seed=2)
    methods = ["eap", "exact"]
    whole = attribute(llama, [b1, b2], methods)
    tiny = attribute(llama, [b1, b2], methods, budget=1, per_forward=1)
    again = attribute(llama, [b1, b2], methods)
    apart = [attribute(llama, [b], methods) for b in (b1, b2)]
    for m in methods:
        assert whole[m].count == 5
        np.testing.assert_allclose(tiny[m].edges, whole[m].edges, rtol=1e-5, atol=1e-6)
        assert np.array_equal(again[m].edges, whole[m].edges)
        merged = apart[0][m].merge(apart[1][m])
        assert np.array_equal(merged.edge_sum, whole[m].edge_sum)
        assert np.array_equal(merged.node_sumsq, whole[m].node_sumsq)


def test_a_padded_batch_scores_each_pair_as_alone(llama):
    metric = AnswerMetric()
    long, short = pairs(50, n=1, length=6, seed=4), pairs(50, n=1, length=4, seed=5)
    padded = {}
    for key in long:
        if key in ("answer", "wrong"):
            padded[key] = torch.cat([long[key], short[key]])
            continue
        pad = torch.zeros(1, 2, dtype=long[key].dtype)
        padded[key] = torch.cat([long[key], torch.cat([short[key], pad], 1)])
    for method in ("eap", "exact"):
        rows = []
        for b in (padded, long, short):
            ctx = BatchContext(llama, pair_batch(llama.model, b, metric), metric, Ablation())
            rows.append(score_batch(ctx, method)[0].cpu().numpy())
        np.testing.assert_allclose(rows[0], np.concatenate(rows[1:]), rtol=1e-4, atol=1e-6)
