"""Stored gradients equal autograd's, module by module, including under in-place ops."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from probe.data.batches import build_batches
from probe.models.build import build_model
from probe.plan import parse
from probe.testing.compose import make_cfg
from tests.helpers import run_probe

SMALL = ["model=resnet18", "dataset.image_size=32", "dataset.num_samples=7"]
ALL_SITES = [
    "probes=all_convs",
    "probes.convs.types=[Conv2d,BatchNorm2d,ReLU]",
    "probes.convs.capture=[output,grad_output]",
]


def _reference_grads(cfg):
    """retain_grad on every conv/norm/relu output of an inplace=False copy, one call at a time."""
    model = copy.deepcopy(build_model(parse(cfg).model, cfg.seed))
    for m in model.modules():
        if isinstance(m, nn.ReLU):
            m.inplace = False
    batches = build_batches(parse(cfg).data, parse(cfg).model, cfg.seed)
    inputs = torch.cat([b.inputs for b in batches])
    targets = torch.cat([b.targets for b in batches])
    outs: dict[str, list[torch.Tensor]] = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Conv2d | nn.BatchNorm2d | nn.ReLU):

            def keep(mod, a, out, name=name):
                out.retain_grad()
                outs.setdefault(name, []).append(out)

            m.register_forward_hook(keep)
    F.cross_entropy(model(inputs), targets, reduction="sum").backward()
    return {
        f"layers/{name}/grad_output" + ("" if k == 0 else f"@{k}"): t.grad.numpy()
        for name, ts in outs.items()
        for k, t in enumerate(ts)
    }


def test_grad_output_of_every_conv_norm_and_relu_equals_autograd(tmp_path):
    """bn1 (then an in-place ReLU), layerX.Y.bn2 (then `out += identity`), the shared relu."""
    _, f3 = run_probe(tmp_path / "b3", *SMALL, "dataset.batch_size=3", *ALL_SITES)
    _, f4 = run_probe(tmp_path / "b4", *SMALL, "dataset.batch_size=4", *ALL_SITES)
    reference = _reference_grads(make_cfg(*SMALL))
    assert {
        "layers/bn1/grad_output",
        "layers/layer1.0.bn2/grad_output",
        "layers/relu/grad_output",
        "layers/layer1.0.relu/grad_output@1",
    } <= set(reference)
    for name, expected in reference.items():
        scale = np.abs(expected).max() + 1e-12
        for f in (f3, f4):
            got = f[name][:]
            assert got.shape == expected.shape
            np.testing.assert_allclose(
                got / scale, expected / scale, rtol=1e-5, atol=1e-5, err_msg=name
            )
        np.testing.assert_allclose(
            f3[name][:], f4[name][:], rtol=1e-5, atol=1e-6 * scale, err_msg=name
        )
    for name in f3["layers"]:  # forward values are captured in the same pass, unchanged
        np.testing.assert_allclose(
            f3[f"layers/{name}/output"][:], f4[f"layers/{name}/output"][:], rtol=1e-5, atol=1e-5
        )


class Combine(nn.Module):
    """2*x + 3*y: the two-input module whose old-style backward hook gives the wrong grad_input."""

    def forward(self, x, y):
        return 2 * x + 3 * y


class TwoInputModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.combine = Combine()

    def forward(self, pair):
        return self.combine(pair[:, 0], pair[:, 1])


def squared_error_mean(output, target):
    """Per-sample mean squared error: summed over a batch of one it is nn.MSELoss()."""
    return ((output - target) ** 2).reshape(len(output), -1).mean(dim=1)


def test_grad_input_of_a_two_input_module_is_with_respect_to_each_input(tmp_path):
    """The worked example: x=[2,3], y=[6,4], target [14,12]: dl/dx=[16,12], dl/dy=[24,18]."""
    torch.save(
        {
            "inputs": torch.tensor([[[2.0, 3.0], [6.0, 4.0]]]),
            "targets": torch.tensor([[14.0, 12.0]]),
        },
        tmp_path / "xy.pt",
    )
    _, f = run_probe(
        tmp_path,
        "model=custom",
        "model._target_=tests.hooks.test_gradients.TwoInputModel",
        "dataset=tensors",
        f"dataset.path={tmp_path / 'xy.pt'}",
        "objective=custom",
        "objective._target_=tests.hooks.test_gradients.squared_error_mean",
        "probes=all_convs",
        "probes.convs.types=[]",
        "probes.convs.layers=[combine]",
        "probes.convs.capture=[grad_input,grad_output]",
    )
    np.testing.assert_allclose(f["layers/combine/grad_input.0"][:], [[16.0, 12.0]])
    np.testing.assert_allclose(f["layers/combine/grad_input.1"][:], [[24.0, 18.0]])
    np.testing.assert_allclose(f["layers/combine/grad_output"][:], [[8.0, 6.0]])
    x = torch.tensor([[2.0, 3.0]], requires_grad=True)
    y = torch.tensor([[6.0, 4.0]], requires_grad=True)
    nn.MSELoss()(Combine()(x, y), torch.tensor([[14.0, 12.0]])).backward()
    np.testing.assert_allclose(f["layers/combine/grad_input.0"][:], x.grad.numpy())
    np.testing.assert_allclose(f["layers/combine/grad_input.1"][:], y.grad.numpy())


class LinearWeightTwo(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(1, 1, bias=False)
        nn.init.constant_(self.fc.weight, 2.0)

    def forward(self, x):
        return self.fc(x)


def half_squared_error(output, target):
    """(y_p - y)^2 / 2 per sample: over the example's two samples it sums to nn.MSELoss()."""
    return ((output - target) ** 2).squeeze(1) / 2


def test_single_linear_worked_example(tmp_path):
    """Linear(1, 1) with weight 2, x=[[1],[2]], y=[[1],[1]], MSE: dl/dy_p=[1,3], dl/dx=[2,6], dW=7."""
    torch.save(
        {"inputs": torch.tensor([[1.0], [2.0]]), "targets": torch.tensor([[1.0], [1.0]])},
        tmp_path / "xy.pt",
    )
    _, f = run_probe(
        tmp_path,
        "model=custom",
        "model._target_=tests.hooks.test_gradients.LinearWeightTwo",
        "dataset=tensors",
        f"dataset.path={tmp_path / 'xy.pt'}",
        "dataset.batch_size=2",
        "objective=custom",
        "objective._target_=tests.hooks.test_gradients.half_squared_error",
        "probes=all_linear",
        "probes.linear.capture=[output,grad_output,grad_input,param_grad]",
    )
    np.testing.assert_allclose(f["layers/fc/output"][:], [[2.0], [4.0]])
    np.testing.assert_allclose(f["layers/fc/grad_output"][:], [[1.0], [3.0]])
    np.testing.assert_allclose(f["layers/fc/grad_input"][:], [[2.0], [6.0]])
    np.testing.assert_allclose(f["layers/fc/param_grad.weight"][:], [[[7.0]]])


def test_param_grad_of_every_conv_equals_plain_backward(tmp_path):
    over = [*SMALL, "dataset.batch_size=4", "probes=param_grads"]
    _, f = run_probe(tmp_path, *over)
    cfg = make_cfg(*over)
    model = build_model(parse(cfg).model, cfg.seed)
    batches = list(build_batches(parse(cfg).data, parse(cfg).model, cfg.seed))
    convs = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Conv2d | nn.Linear)]
    for i, batch in enumerate(batches):
        model.zero_grad()
        F.cross_entropy(model(batch.inputs), batch.targets, reduction="sum").backward()
        for name, m in convs:
            got = f[f"layers/{name}/param_grad.weight"]
            assert got.shape[0] == len(batches)
            expected = m.weight.grad.numpy()
            scale = np.abs(expected).max()
            np.testing.assert_allclose(
                got[i] / scale, expected / scale, rtol=1e-5, atol=1e-5, err_msg=name
            )
    np.testing.assert_allclose(
        f["layers/fc/param_grad.bias"][1], model.fc.bias.grad.numpy(), rtol=1e-5, atol=1e-6
    )


def test_train_mode_is_recorded_and_leaves_the_model_unchanged(tmp_path, monkeypatch):
    import probe.launch.run as run_mod

    built = {}
    real = run_mod.build_model

    def keep(cfg, seed):
        built["model"] = real(cfg, seed)
        built["before"] = copy.deepcopy(built["model"].state_dict())
        return built["model"]

    monkeypatch.setattr(run_mod, "build_model", keep)
    _, f = run_probe(tmp_path, *SMALL, "train_mode=true", "probes=grads_all_convs")
    assert f.attrs["train_mode"]
    after = built["model"].state_dict()
    for k, v in built["before"].items():
        assert torch.equal(v, after[k]), k
    # train mode really ran: BatchNorm used batch statistics, so bn1 outputs have zero mean per channel
    _, g = run_probe(
        tmp_path / "bn", *SMALL, "train_mode=true", "probes=all_norms", "probes.norms.layers=[bn1]"
    )
    np.testing.assert_allclose(g["layers/bn1/output"][:].mean(axis=(0, 2, 3)), 0.0, atol=1e-5)


def test_logit_objective_is_a_saliency(tmp_path):
    over = [
        *SMALL,
        "dataset.batch_size=4",
        "objective=logit",
        "objective.index=3",
        "probes=all_linear",
        "probes.linear.capture=[grad_output]",
    ]
    _, f = run_probe(tmp_path, *over)
    expected = np.zeros((7, 1000), dtype=np.float32)
    expected[:, 3] = 1.0
    np.testing.assert_array_equal(f["layers/fc/grad_output"][:], expected)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["objective.name=hinge"], ["hinge", "cross_entropy"]),
        (["objective=nonesuch"], ["objective/nonesuch", "logit"]),
        (["objective=logit", "objective.index=1000"], ["index=1000", "out of range"]),
        (["dataset=tensors", "dataset.path={x}"], ["needs targets", "output_sum"]),
    ],
)
def test_bad_objective_inputs(tmp_path, args, words, cli_in_process):
    torch.save(torch.randn(2, 3, 32, 32), tmp_path / "x.pt")
    args = [a.replace("{x}", str(tmp_path / "x.pt")) for a in args]
    out = cli_in_process(
        *SMALL, "probes=grads_all_convs", *args, f"hydra.run.dir={tmp_path / 'run'}"
    )
    text = out.stdout + out.stderr
    assert out.returncode != 0 and "Traceback" not in text
    for w in words:
        assert w in text, text
