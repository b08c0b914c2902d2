"""On a model linear in its residual stream (fixed attention patterns, identity norms, a linear
MLP), the metric logit_diff is affine in every receiver's input, so the gradient methods are
exact: EAP's edge and node scores equal exact edge and node patching to rounding, for every
ablation, and the integrated-gradient variants equal EAP at any number of steps."""

from __future__ import annotations

import numpy as np
import pytest

from probe.circuits.parts import parts_of
from probe.circuits.scores import attribute
from probe.circuits.states import mean_states
from probe.circuits.task import Ablation
from probe.testing.toy_circuits import Toy, overrides, pairs


@pytest.fixture(scope="module")
def linear():
    model = Toy(frozen=True)
    return parts_of(model, overrides(2)), pairs(12)


@pytest.mark.parametrize("kind", ["counterfactual", "mean", "zero"])
def test_eap_equals_exact_edge_and_node_patching(linear, kind):
    parts, batch = linear
    means = mean_states(parts, [pairs(12, n=6, seed=7)]) if kind == "mean" else None
    methods = ["eap", "exact", "eap_ig_activations"]
    if kind == "counterfactual":
        methods.append("eap_ig_inputs")
    got = attribute(parts, [batch], methods, ablation=Ablation(kind, means), steps=3)
    exact = got["exact"]
    assert np.abs(exact.edges).max() > 1e-2  # edges act
    for method in methods:
        np.testing.assert_allclose(got[method].edges, exact.edges, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(got[method].nodes, exact.nodes, rtol=1e-4, atol=1e-6)
    # fixed patterns: queries and keys carry nothing, patched or differentiated
    graph = parts.graph
    qk = np.array(["<q>" in e or "<k>" in e for e in graph.edges])
    assert np.abs(exact.edges[qk]).max() < 1e-6 and np.abs(got["eap"].edges[qk]).max() < 1e-6
