"""torch.compile and the watch, on torch 2.14.1: compiled code skips module hooks (those added
after it compiled; after a graph break, such as each of the watch's hooks makes, those of the
next modules: measured in docs/training.md), so the watch refuses compiled models with a
ConfigError naming the way out (watch and train the model uncompiled): a compiled model given
to probe.watch, a watched model compiled afterwards (at its first compiled forward, before any
step), a model compiled before the watch was made (at its first forward, or the first step's
end). The way out then works on the same model. The backend is aot_eager: torch.compile's graph capture and AOT
autograd, as inductor's, without its code generation (minutes on this machine)."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

import probe
from probe.errors import ConfigError
from probe.testing.trainings import (
    EVERY_SITE,
    cnn,
    image_batches,
    image_loss,
    one_thread,
)

PROBES = {
    "net": {"layers": ["conv1", "relu", "layer1", "layer2.conv", "fc"], "capture": EVERY_SITE}
}
STEPS = 3


@pytest.fixture(autouse=True)
def fresh_compiler():
    torch.compiler.reset()
    yield
    torch.compiler.reset()


def train(model, opt, run, out, steps=range(STEPS), **watch):
    """A watched training of `model` whose forwards go through `run` (the model, or compiled)."""
    batches = image_batches(STEPS)
    with probe.watch(model, PROBES, out=out, optimizer=opt, **watch) as w:
        for step in steps:
            opt.zero_grad()
            loss = image_loss(run, batches[step])
            loss.backward()
            w.loss(loss)
            opt.step()


WAY_OUT = "watch and train the model uncompiled"


def test_a_compiled_model_is_refused(tmp_path):
    model = cnn()
    with pytest.raises(ConfigError, match="got a torch.compile'd model") as e:
        probe.watch(torch.compile(model, backend="aot_eager"), PROBES, out=tmp_path / "w")
    assert WAY_OUT in str(e.value)


def test_a_watched_model_compiled_afterwards_is_refused_at_its_first_forward(tmp_path):
    with one_thread():
        model = cnn()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        with pytest.raises(ConfigError, match="runs compiled") as e:
            train(model, opt, torch.compile(model, backend="aot_eager"), tmp_path / "w")
    assert WAY_OUT in str(e.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # no step ran
    assert probe.open_run(tmp_path / "w").train().empty
    hooks = [m._forward_hooks or m._forward_pre_hooks for m in model.modules()]
    assert not any(hooks)  # the watch took its hooks along


def test_a_watch_after_the_compiled_model_ran_is_refused_and_the_eager_model_works(tmp_path):
    with one_thread():
        model = cnn()
        compiled = torch.compile(model, backend="aot_eager")
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        x, y = image_batches(1)[0]
        image_loss(compiled, (x, y)).backward()  # compiled without hooks
        opt.step()
        # refused: at the compiled forward where it recompiles with the hooks, or at the step's
        # end where the compiled code ran without them
        with pytest.raises(ConfigError, match="runs compiled|no forward of SmallCNN passed") as e:
            train(model, opt, compiled, tmp_path / "late")
        assert WAY_OUT in str(e.value)
        # the way out: the same model, uncompiled, watched (the compiled one untouched)
        train(model, opt, model, tmp_path / "eager", steps=range(1, STEPS))
    got = pd.read_csv(tmp_path / "eager" / "train.csv")
    assert sorted(set(got.step)) == [0, 1]
    assert len(got[(got.layer == "layer2.conv") & (got.site == "output")]) == 2
