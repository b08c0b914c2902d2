"""Gradient edits while training: a watched training with declared edits on gradient sites ends
bitwise equal to the same training with the edits hooked by hand, at every step (recorded or
not), and the file and the log say which edits were active."""

from __future__ import annotations

import json

import h5py
import pytest
import torch

from probe.testing.trainings import (
    assert_bitwise_equal,
    cnn,
    image_batches,
    image_loss,
    one_thread,
    state_of,
    train,
)

EDITS = {
    "zero": ({"layers": ["layer1.*"], "site": "grad_output", "op": "zero"},
             ["layer1.conv", "layer1.bn", "layer1.relu"], "grad_output", torch.zeros_like),
    "scale": ({"layers": ["layer2.conv"], "site": "grad_input", "op": "scale", "factor": 0.5},
              ["layer2.conv"], "grad_input", lambda g: g * 0.5),
}  # fmt: skip


def hand_hooked(model, names, site, fn) -> list:
    """The edit by hand: a tensor hook on each module's output (or on its own copy of its
    input) replacing the gradient with fn(gradient)."""
    handles = []
    for name in names:
        m = model.get_submodule(name)
        if site == "grad_output":

            def after(module, args, output):
                output.register_hook(fn)

            handles.append(m.register_forward_hook(after))
        else:

            def before(module, args):
                x = args[0].clone()
                x.register_hook(fn)
                return (x,)

            handles.append(m.register_forward_pre_hook(before))
    return handles


@pytest.mark.parametrize("edit", list(EDITS))
def test_a_gradient_edit_while_watched_equals_the_same_edit_hooked_by_hand(tmp_path, edit):
    """6 steps of SGD with momentum, recorded every 4th step: the edit acts at all of them."""
    spec, names, site, fn = EDITS[edit]
    data = image_batches(6)
    with one_thread():
        model = cnn()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        hand_hooked(model, names, site, fn)
        train(model, opt, data, image_loss)
        by_hand = state_of(model, opt)

        model = cnn()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        train(model, opt, data, image_loss)
        assert not torch.equal(
            state_of(model, opt)["model.conv1.weight"], by_hand["model.conv1.weight"]
        )  # (the edit changes the training)

        model = cnn()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        watch = {
            "probes": {"fc": {"layers": ["fc"], "capture": ["output", "param_grad"]}},
            "out": tmp_path / "run",
            "every": 4,
            "edits": {edit: spec},
        }
        train(model, opt, data, image_loss, watch)
        assert_bitwise_equal(state_of(model, opt), by_hand)
    with h5py.File(tmp_path / "run" / "probe.h5") as f:
        active = json.loads(f.attrs["edits"])
    assert {(e["edit"], e["layer"], e["site"], e["op"]) for e in active} == {
        (edit, name, site, spec["op"]) for name in names
    }
    assert "gradient edits active" in (tmp_path / "run" / "probe.log").read_text()


def test_a_recorded_gradient_site_holds_the_edited_gradient(tmp_path):
    """Edits act first, then the statistics: a zeroed grad_output is recorded as zeros."""
    import probe

    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probes = {"bn": {"layers": ["layer1.bn", "layer2.bn"], "capture": ["grad_output"]}}
    edits = {"freeze": {"layers": ["layer1.bn"], "site": "grad_output", "op": "zero"}}
    train(model, opt, image_batches(1), image_loss,
          {"probes": probes, "out": tmp_path / "run", "edits": edits})  # fmt: skip
    with probe.open_run(tmp_path / "run") as run:
        table = run.train().set_index("layer")
    assert table.loc["layer1.bn", "frac_zero"] == 1.0
    assert table.loc["layer2.bn", "frac_zero"] < 1.0
