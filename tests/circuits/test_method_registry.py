"""Circuit scoring methods are a registry of name -> function: a method registered from here is
checked, ordered and scored by the same calls as the shipped ones."""

from __future__ import annotations

import numpy as np
import pytest

from probe.circuits import eap as gradient
from probe.circuits.parts import parts_of
from probe.circuits.scores import (
    METHODS,
    CircuitMethod,
    attribute,
    check_methods,
    node_sums,
    register_method,
)
from probe.errors import ConfigError
from tests.circuits.test_hand import build
from tests.circuits.toy import pairs


def halved_eap(ctx, options):
    """EAP's scores halved: per edge, and per sender the sum of its out-edges."""
    edges = gradient.eap(ctx, options.budget) / 2
    return edges, node_sums(ctx.parts.graph, edges)


def zero_only(kind: str) -> None:
    if kind != "zero":
        raise ConfigError(f"circuit.method=halved_eap needs circuit.ablation=zero (got {kind})")


@pytest.fixture
def registered():
    register_method("halved_eap", CircuitMethod(halved_eap, fits=zero_only))
    try:
        yield
    finally:
        METHODS.pop("halved_eap")


def test_a_registered_method_is_scored_beside_the_shipped_ones(registered):
    from probe.circuits.task import Ablation

    model = build("llama")
    parts = parts_of(model)
    batches = [pairs(50, n=3, seed=1), pairs(50, n=2, seed=2)]
    ablation = Ablation("zero")
    got = attribute(parts, batches, ["halved_eap", "eap"], ablation=ablation)
    assert list(got) == ["eap", "halved_eap"]  # the registry's order: eap's clean run first
    np.testing.assert_allclose(got["halved_eap"].edges, got["eap"].edges / 2, rtol=1e-12)
    np.testing.assert_allclose(got["halved_eap"].nodes, got["eap"].nodes / 2, rtol=1e-12)
    assert got["halved_eap"].count == 5
    assert "halved_eap" in str(pytest.raises(ConfigError, check_methods, ["nope"], "zero").value)
    with pytest.raises(ConfigError, match="needs circuit.ablation=zero"):
        check_methods(["halved_eap"], "mean")
