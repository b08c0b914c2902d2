"""The circuits engine as a user of the hook owner: for eap (the clean, corrupt and gradient runs)
and exact (the patched forwards), a registration refused (the first, a middle one, the last) or
the model raising inside a run leaves no hook on the model, and the scores computed afterwards
equal those of an untouched model."""

from __future__ import annotations

import numpy as np
import pytest

from probe.circuits.parts import parts_of
from probe.circuits.scores import attribute
from probe.errors import ModelError
from probe.testing.models import assert_no_hooks, registrations
from probe.testing.toy_circuits import pairs
from tests.circuits.test_hand import build

METHODS = ["eap", "exact"]


@pytest.fixture(scope="module")
def untouched():
    model = build("gpt2")
    batch = pairs(50)
    return batch, {m: attribute(parts_of(model), [batch], [m])[m].edges for m in METHODS}


def scores(model, batch, method) -> np.ndarray:
    return attribute(parts_of(model), [batch], [method])[method].edges


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("which", ["first", "middle", "last"])
def test_a_refused_registration_leaves_no_hook_and_the_next_scores_are_unchanged(
    untouched, method, which
):
    batch, want = untouched
    model = build("gpt2")
    with registrations() as calls:
        scores(model, batch, method)
    n = len(calls)
    assert n >= 3
    k = {"first": 1, "middle": n // 2, "last": n}[which]
    with registrations(refuse=k), pytest.raises(RuntimeError, match="refused"):
        scores(model, batch, method)
    assert_no_hooks(model)
    np.testing.assert_array_equal(scores(model, batch, method), want[method])


@pytest.mark.parametrize("method", METHODS)
def test_the_model_raising_inside_a_run_leaves_no_hook_and_the_next_scores_are_unchanged(
    untouched, method
):
    batch, want = untouched
    model = build("gpt2")
    last = model.transformer.h[-1]
    calls = []

    def raising(module, args):
        calls.append(None)
        if len(calls) == 2:  # (the second run of the block: hooks of the engine are in place)
            raise KeyError("inside the run")

    handle = last.register_forward_pre_hook(raising)  # (the test's own, removed below)
    try:
        with pytest.raises(ModelError, match="inside the run"):
            scores(model, batch, method)
    finally:
        handle.remove()
    assert_no_hooks(model)
    np.testing.assert_array_equal(scores(model, batch, method), want[method])
