"""Circuit scoring methods are a registry of name -> function: a method registered from here is
checked, ordered and scored by the same calls as the shipped ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch

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
from probe.testing.toy_circuits import pairs
from tests.circuits.test_hand import build
from tests.helpers import make_cfg


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


def test_a_registered_method_reaches_the_command_line_from_the_registry_alone(
    registered, tmp_path, monkeypatch
):
    """circuit.method=[halved_eap,eap] through the config's parse and a run: circuit.csv holds
    halved EAP's scores beside EAP's; an unknown name is refused with the registry's names
    before any model is built."""
    import pandas as pd

    from probe.launch import run as run_module
    from tests.circuits.test_circuit_runs import args_of

    root = tmp_path / "lm"
    build("llama").save_pretrained(root / "llama")
    p = pairs(50, n=3, length=6, seed=4)
    torch.save({"clean_ids": p["input_ids"], "corrupt_ids": p["corrupt_ids"],
                "answer": p["answer"][:, 0], "wrong": p["wrong"][:, 0]}, root / "pairs.pt")  # fmt: skip
    args = args_of(root, "llama", "circuit.ablation=zero", "circuit.sizes=[]")
    run_module.run(make_cfg(*args, "circuit.method=[halved_eap,eap]"), run_dir=tmp_path / "run")
    table = pd.read_csv(tmp_path / "run" / "circuit.csv").set_index(["method", "edge"])["score"]
    np.testing.assert_allclose(table["halved_eap"], table["eap"] / 2, rtol=1e-12)

    def no_model(*a, **k):
        raise AssertionError("the model was built before the method's name was checked")

    monkeypatch.setattr(run_module, "build_model", no_model)
    with pytest.raises(ConfigError, match="circuit.method='nope' is unknown.*halved_eap"):
        run_module.run(make_cfg(*args, "circuit.method=[nope]"), run_dir=tmp_path / "bad")
