"""The watch as a user of the hook owner: a registration refused on start (its first, a middle one
and its last: module, parameter and optimizer hooks) or an exception inside the watched training
leaves no hook on the model, its parameters or its optimizer, and a watched training of the same
model afterwards writes what a training of an untouched copy writes."""

from __future__ import annotations

import copy

import pandas as pd
import pytest
import torch

import probe
from probe.testing.models import EVERY_REGISTRATION, assert_no_hooks, registrations
from probe.testing.trainings import EVERY_SITE, cnn, image_batches, image_loss, one_thread, train

PROBES = {"blocks": {"layers": ["layer1", "layer2"], "capture": EVERY_SITE}}


def no_optimizer_hooks(optimizer: torch.optim.Optimizer) -> None:
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks


def watched_csv(model, out) -> pd.DataFrame:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train(model, opt, image_batches(3), image_loss, watch={"probes": PROBES, "out": out})
    no_optimizer_hooks(opt)
    return pd.read_csv(out / "train.csv")


def start_registrations(out) -> int:
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with registrations(kinds=EVERY_REGISTRATION) as calls:
        w = probe.watch(model, PROBES, out=out, optimizer=opt)
        w.start()
        counted = len(calls)
        w.close()
    return counted


@pytest.fixture(scope="module")
def untouched(tmp_path_factory):
    with one_thread():
        return watched_csv(cnn(), tmp_path_factory.mktemp("untouched"))


@pytest.mark.parametrize("which", ["first", "middle", "last"])
def test_a_refused_registration_leaves_no_hook_and_the_next_training_is_unchanged(
    tmp_path, untouched, which
):
    n = start_registrations(tmp_path / "counted")
    assert n >= 3  # modules, parameters and the optimizer's step hooks
    k = {"first": 1, "middle": n // 2, "last": n}[which]
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with (
        registrations(refuse=k, kinds=EVERY_REGISTRATION),
        pytest.raises(RuntimeError, match="refused"),
    ):
        probe.watch(model, PROBES, out=tmp_path / "refused", optimizer=opt).start()
    assert_no_hooks(model)
    no_optimizer_hooks(opt)
    with one_thread():
        got = watched_csv(model, tmp_path / "after")
    pd.testing.assert_frame_equal(got, untouched)


def test_an_exception_in_the_training_leaves_no_hook_and_the_next_training_is_unchanged(
    tmp_path, untouched
):
    model = cnn()
    state = copy.deepcopy(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = image_batches(1)[0]
    watched = probe.watch(model, PROBES, out=tmp_path / "raised", optimizer=opt)
    with pytest.raises(KeyError, match="mid-step"), watched:
        image_loss(model, (x, y)).backward()
        raise KeyError("mid-step")
    assert_no_hooks(model)
    no_optimizer_hooks(opt)
    model.load_state_dict(state)  # (the raise came before any step: the weights are the same)
    with one_thread():
        got = watched_csv(model, tmp_path / "after")
    pd.testing.assert_frame_equal(got, untouched)
