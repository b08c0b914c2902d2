"""Bad input to probe.watch: each a named error that says the bad value and the way out, raised
before the training runs where it can be, and no hook left on the model."""

from __future__ import annotations

import logging
import re

import h5py
import pytest
import torch
from torch import nn

import probe
from probe.errors import ConfigError, DataError, ModelError, ProbeError, SelectionError
from probe.testing.models import assert_no_hooks
from probe.testing.trainings import cnn, image_batches, image_loss, train

CONVS = {"convs": {"layers": ["*"], "types": ["Conv2d"], "capture": ["output"]}}
GRADS = {"convs": {"layers": ["conv1"], "capture": ["grad_output"]}}


@pytest.mark.parametrize("every", [0, -3, "sometimes", True, 2.5])
def test_every_must_be_a_positive_int_or_log(tmp_path, every):
    with pytest.raises(
        ConfigError, match=re.escape(f"every={every!r}: give an int >= 1") + ".*'log'"
    ):
        probe.watch(cnn(), CONVS, out=tmp_path, every=every)


@pytest.mark.parametrize(
    ("probes", "error", "says"),
    [
        ({"p": {"layers": ["block*"], "capture": ["output"]}}, SelectionError, "'block\\*' matches no module"),
        ({"p": {"layers": ["*"], "types": ["LSTM"], "capture": ["output"]}}, SelectionError,
         r"selects no module.*types \['LSTM'\]"),
        ({"p": {"layers": ["fc"], "capture": ["param_grad.gamma"]}}, ConfigError,
         "'param_grad.gamma' matches no trainable parameter.*weight, bias"),
        ({"p": {"layers": ["fc"], "capture": ["grad_x_output"]}}, ConfigError,
         "'grad_x_output' is not one a watched training records"),
        ({"p": {"layers": ["fc"], "capture": []}}, ConfigError, "capture is empty"),
        ({}, ConfigError, "no probes"),
    ],
)  # fmt: skip
def test_a_probe_that_selects_nothing_or_a_site_the_watch_does_not_know(
    tmp_path, probes, error, says
):
    with pytest.raises(error, match=says):
        probe.watch(cnn(), probes, out=tmp_path)


def test_convolutions_on_a_token_model_get_the_probes_own_message(tmp_path):
    """The user's own probe of convolutions on a Llama is named with its pattern and the
    model's first module names, as on an image model: not the command line's advice about
    its default probes (probes=none, probes=residual), which the user did not use."""
    from transformers import LlamaForCausalLM

    from probe.testing.tiny_lms import tiny_config

    model = LlamaForCausalLM(tiny_config("llama", 40))
    probes = {"x": {"layers": ["*"], "types": ["Conv2d"], "capture": ["output"]}}
    with pytest.raises(SelectionError) as llama:
        probe.watch(model, probes, out=tmp_path)
    said = str(llama.value)
    names = [n for n, _ in model.named_modules() if n][:8]
    assert said.startswith("probe 'x' selects no module of LlamaForCausalLM")
    assert "(layers ['*'], types ['Conv2d'], exclude [])" in said
    assert f"module names start: {', '.join(names)}" in said
    assert "probes=" not in said and "default probes" not in said
    with pytest.raises(SelectionError) as mlp:  # the message a model without embeddings gets
        probe.watch(nn.Sequential(nn.Linear(2, 2)), probes, out=tmp_path)
    assert (
        said.split("; module names")[0].replace("LlamaForCausalLM", "Sequential")
        == str(mlp.value).split("; module names")[0]
    )
    assert_no_hooks(model)


def test_an_optimizer_that_is_no_torch_optimizer(tmp_path):
    with pytest.raises(ConfigError, match="optimizer is a str, not a torch.optim.Optimizer"):
        probe.watch(cnn(), CONVS, out=tmp_path, optimizer="sgd")


def test_an_optimizer_over_another_models_parameters(tmp_path):
    """Its steps would count, its updates read 0 at every step: refused, the model unhooked."""
    model, other = cnn(), cnn()
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"optimizer= steps none of the watched SmallCNN's 11 "
                       r"parameters: its 11 parameters belong to another model"):  # fmt: skip
        probe.watch(model, CONVS, out=tmp_path, optimizer=opt)
    assert_no_hooks(model)
    some = torch.optim.SGD([*model.parameters()][:1] + [*other.parameters()][:1], lr=0.1)
    with probe.watch(model, CONVS, out=tmp_path / "some", optimizer=some):
        pass  # (one of the model's parameters is enough: a frozen part may be left out)


@pytest.mark.parametrize("flush_every", [0, -1, 1.5])
def test_flush_every_must_be_a_positive_int(tmp_path, flush_every):
    with pytest.raises(ConfigError, match=re.escape(f"flush_every={flush_every!r}: give an int")):
        probe.watch(cnn(), CONVS, out=tmp_path, flush_every=flush_every)


def test_an_edit_of_a_forward_site_is_refused(tmp_path):
    edits = {"off": {"layers": ["conv1"], "site": "output", "op": "zero"}}
    with pytest.raises(ConfigError, match="edit 'off': site 'output'.*edits gradients only"):
        probe.watch(cnn(), CONVS, out=tmp_path, edits=edits)


def test_a_probe_batch_that_does_not_fit_the_model(tmp_path):
    """Five channels where the model takes three: said at start, no hook left, and the
    training's model untouched (its train mode, its BatchNorm buffers)."""
    model = cnn()
    buffers = {k: v.clone() for k, v in model.state_dict().items()}
    w = probe.watch(model, CONVS, out=tmp_path, probe_batch=torch.randn(2, 5, 8, 8))
    with pytest.raises(ConfigError, match="probe_batch does not fit the model"):
        w.start()
    assert_no_hooks(model)
    assert model.training and all(m.training for m in model.modules())
    for k, v in model.state_dict().items():
        assert torch.equal(v, buffers[k]), k
    with pytest.raises(DataError):
        probe.watch(model, CONVS, out=tmp_path / "b", probe_batch="a batch")


def test_gradient_sites_in_a_step_without_backward(tmp_path):
    """The optimizer steps on no backward: said at that step, from optimizer.step()."""
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, _ = image_batches(1)[0]
    said = r"step 0: no gradient reached.*loss.backward\(\)"
    with pytest.raises(ConfigError, match=said), probe.watch(model, GRADS, out=tmp_path,
                                                             optimizer=opt):  # fmt: skip
        model(x).sum()
        opt.step()
    assert_no_hooks(model)


def test_gradient_sites_in_a_training_that_never_goes_backward(tmp_path):
    """Without optimizer= and without a step: said when the watch closes."""
    model = cnn()
    x, _ = image_batches(1)[0]
    said = "no gradient reached them in the whole training"
    with pytest.raises(ConfigError, match=said), probe.watch(model, GRADS, out=tmp_path):
        model(x)
    assert_no_hooks(model)


def test_overwrite_starts_a_new_log_and_a_refused_start_keeps_the_old(tmp_path):
    """probe.log is the log of the training probe.h5 holds: replaced with it, kept when the
    directory is refused (before, overwrite=True appended to the old training's lines)."""
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train(model, opt, image_batches(2), image_loss, {"probes": CONVS, "out": tmp_path})
    first = (tmp_path / "probe.log").read_text()
    assert first.count("watching ") == 1 and "2 steps, 2 recorded" in first
    with pytest.raises(ConfigError, match="already holds a run"):
        probe.watch(model, CONVS, out=tmp_path, optimizer=opt).start()
    assert (tmp_path / "probe.log").read_text() == first
    train(model, opt, image_batches(3), image_loss,
          {"probes": CONVS, "out": tmp_path, "overwrite": True})  # fmt: skip
    second = (tmp_path / "probe.log").read_text()
    assert second.count("watching ") == 1 and "3 steps, 3 recorded" in second
    assert "2 steps, 2 recorded" not in second


def test_a_run_directory_that_holds_a_run_and_calls_out_of_order(tmp_path):
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train(model, opt, image_batches(1), image_loss, {"probes": CONVS, "out": tmp_path})
    said = "already holds a run.*load_state_dict.*overwrite=True"
    with pytest.raises(ConfigError, match=said), probe.watch(model, CONVS, out=tmp_path):
        pass
    w = probe.watch(model, CONVS, out=tmp_path, optimizer=opt, overwrite=True)
    with w:
        with pytest.raises(ProbeError, match="before the watch starts"):
            w.load_state_dict({"step": 3})
        with pytest.raises(ProbeError, match=r"w.loss\(loss\)"):
            w.step()
    with pytest.raises(ProbeError, match="outside the watch"):
        w.step()
    with pytest.raises(ConfigError, match="give what w.state_dict"):
        probe.watch(model, CONVS, out=tmp_path / "c").load_state_dict({"epoch": 1})
    assert_no_hooks(model)


class Log(nn.Module):
    def forward(self, x):
        return torch.log(x)


class Blows(nn.Module):
    """An identity linear layer, then a log: NaN where an input is negative."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.log = Log()
        with torch.no_grad():
            self.fc.weight.copy_(torch.eye(4))
            self.fc.bias.zero_()

    def forward(self, x):
        return self.log(self.fc(x))


@pytest.mark.parametrize("fail", [False, True])
def test_a_non_finite_value_is_named_with_its_step_layer_and_site(tmp_path, caplog, fail):
    """From step 2 on the inputs make NaN: the log names step 2, the layer and the site once;
    with fail_on_nonfinite the training stops there, the two steps before it in the file."""
    model = Blows()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    probes = {"all": {"layers": ["fc", "log"], "capture": ["output", "grad_output"]}}
    inputs = [torch.full((3, 4), 1.0 if s < 2 else -1.0) for s in range(4)]
    caplog.set_level(logging.WARNING, logger="probe")
    w = probe.watch(model, probes, out=tmp_path, optimizer=opt, fail_on_nonfinite=fail)
    stopped = None
    try:
        with w:
            for x in inputs:
                opt.zero_grad()
                model(x).nan_to_num().sum().backward()
                opt.step()
    except ModelError as e:
        stopped = str(e)
    said = [r.getMessage() for r in caplog.records if "NaN" in r.getMessage()]
    assert said[0] == (
        "step 2: layer 'log' output has 12 NaN and 0 Inf values (the first of this site, and "
        "of the training)"
    )
    assert len({m.split(" has ")[0] for m in said}) == len(said)  # once per site
    with h5py.File(tmp_path / "probe.h5", "r", swmr=True) as f:
        steps = list(f["train/step"][: f["progress"][()]["steps"]])
    if fail:
        assert stopped is not None and "fail_on_nonfinite=True stops the training" in stopped
        assert said[0] in stopped
        assert steps == [0, 1]
    else:
        assert stopped is None and steps == [0, 1, 2, 3]
    assert "NaN" in (tmp_path / "probe.log").read_text()
