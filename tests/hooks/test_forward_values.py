"""Stored forward captures equal the same values computed independently."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torchvision.models.feature_extraction import create_feature_extractor

from probe.data.batches import build_batches
from probe.hooks.capture import Capture
from probe.hooks.module_select import select_modules
from probe.models.build import build_model
from probe.plan import parse
from probe.testing.compose import make_cfg
from tests.helpers import run_probe


def _model_and_inputs(cfg):
    model = build_model(parse(cfg).model, cfg.seed)
    batches = build_batches(parse(cfg).data, parse(cfg).model, cfg.seed)
    inputs = torch.cat([b.inputs for b in batches])
    return model, inputs, batches


def test_all_convs_equal_torchvision_feature_extractor(tmp_path, small_resnet):
    result, f = run_probe(tmp_path, *small_resnet, "probes=all_convs")
    model, inputs, _ = _model_and_inputs(make_cfg(*small_resnet))
    convs = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == 20 and "conv1" in convs
    assert sorted(f["layers"]) == sorted(convs)
    extractor = create_feature_extractor(model, return_nodes={n: n for n in convs})
    with torch.no_grad():
        ref = extractor(inputs)
    for name in convs:
        stored = f[f"layers/{name}/output"]
        assert stored.shape[0] == 7 and stored.chunks[0] >= 1 and stored.maxshape[0] is None
        np.testing.assert_allclose(stored[:], ref[name].numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(f["samples/index"][:], np.arange(7))
    assert f.attrs["complete"] and f.attrs["num_samples"] == 7


def test_rows_follow_dataset_order_with_short_last_batch(tmp_path, small_resnet):
    """Batch 3 over 7 samples (3, 3, 1) stores each row exactly as a one-sample forward gives it."""
    _, f = run_probe(
        tmp_path, *small_resnet, "probes=all_convs", "probes.convs.layers=[layer4.1.*]"
    )
    model, inputs, batches = _model_and_inputs(make_cfg(*small_resnet))
    assert [len(b.inputs) for b in batches] == [3, 3, 1]
    assert sorted(f["layers"]) == ["layer4.1.conv1", "layer4.1.conv2"]
    ref = create_feature_extractor(model, return_nodes=["layer4.1.conv2"])
    with torch.no_grad():
        for i in range(7):
            one = ref(inputs[i : i + 1])["layer4.1.conv2"][0].numpy()
            np.testing.assert_allclose(
                f["layers/layer4.1.conv2/output"][i], one, rtol=1e-4, atol=1e-5
            )
    np.testing.assert_array_equal(
        f["samples/target"][:], [int(b) for b in torch.cat([b.targets for b in batches])]
    )


def test_bn1_is_not_rectified_by_the_inplace_relu(tmp_path, small_resnet):
    _, f = run_probe(tmp_path, *small_resnet, "probes=all_norms")
    model, inputs, _ = _model_and_inputs(make_cfg(*small_resnet))
    reference = copy.deepcopy(model)
    for m in reference.modules():
        if isinstance(m, torch.nn.ReLU):
            m.inplace = False
    kept = {}
    reference.bn1.register_forward_hook(
        lambda m, a, out: kept.__setitem__("bn1", out.detach().clone())
    )
    with torch.no_grad():
        reference(inputs)
    stored = f["layers/bn1/output"][:]
    assert stored.min() < 0
    np.testing.assert_allclose(stored, kept["bn1"].numpy(), rtol=1e-5, atol=1e-5)
    # layerX.Y.bn2 is followed by `out += identity`: its stored value must be the pre-sum one
    kept2 = {}
    reference.layer1[0].bn2.register_forward_hook(
        lambda m, a, o: kept2.__setitem__("v", o.detach().clone())
    )
    with torch.no_grad():
        reference(inputs)
    np.testing.assert_allclose(
        f["layers/layer1.0.bn2/output"][:], kept2["v"].numpy(), rtol=1e-5, atol=1e-5
    )


def test_shared_relu_keeps_every_call(tmp_path, small_resnet):
    _, f = run_probe(tmp_path, *small_resnet, "probes=all_activations")
    model, inputs, _ = _model_and_inputs(make_cfg(*small_resnet))
    calls: dict[str, list] = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.ReLU):
            m.register_forward_hook(
                lambda mod, a, o, n=name: calls.setdefault(n, []).append(o.detach().clone())
            )
    with torch.no_grad():
        model(inputs)
    assert len(calls["layer1.0.relu"]) == 2
    for name, outs in calls.items():
        for k, out in enumerate(outs):
            ds = f"layers/{name}/output" + ("" if k == 0 else f"@{k}")
            np.testing.assert_allclose(f[ds][:], out.numpy(), rtol=1e-5, atol=1e-5)


class TwoHeads(torch.nn.Module):
    """Returns a tuple and a dict, so captures must be flattened under stable names."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(4, 3)
        self.split = Split()

    def forward(self, x):
        return self.split(self.body(x))["pair"][0]


class Split(torch.nn.Module):
    def forward(self, h):
        return {"pair": (h * 2, h - 1), "scale": h.abs()}


def _run_two_heads(tmp_path, x: torch.Tensor, *overrides: str):
    """TwoHeads over the inputs x saved as a tensors file, every module captured as float32."""
    torch.save(x, tmp_path / "x.pt")
    _, f = run_probe(
        tmp_path,
        "model=custom",
        "model._target_=tests.hooks.test_forward_values.TwoHeads",
        "dataset=tensors",
        f"dataset.path={tmp_path / 'x.pt'}",
        "dataset.batch_size=2",
        "probes=everything",
        "probes.everything.dtype=float32",
        *overrides,
    )
    return f


def test_nested_outputs_and_inputs_are_flattened(tmp_path):
    x = torch.randn(5, 4)
    f = _run_two_heads(tmp_path, x, "probes.everything.leaves_only=false")
    torch.manual_seed(0)
    model = TwoHeads().eval()
    h = model.body(x).detach()
    np.testing.assert_allclose(f["layers/split/output.pair.0"][:], (h * 2).numpy(), rtol=1e-6)
    np.testing.assert_allclose(f["layers/split/output.pair.1"][:], (h - 1).numpy(), rtol=1e-6)
    np.testing.assert_allclose(f["layers/split/output.scale"][:], h.abs().numpy(), rtol=1e-6)
    np.testing.assert_allclose(f["layers/split/input"][:], h.numpy(), rtol=1e-6)
    np.testing.assert_allclose(f["layers/body/input"][:], x.numpy(), rtol=1e-6)
    assert "samples/target" not in f


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_tensors_of_another_float_dtype_feed_the_model_in_its_own(tmp_path, dtype):
    """A float64 file (numpy's default) runs a float32 model, as after `.float()` in PyTorch."""
    x = torch.randn(5, 4, dtype=dtype)
    f = _run_two_heads(tmp_path, x)
    torch.manual_seed(0)
    model = TwoHeads().eval()
    with torch.no_grad():
        h = model.body(x.float())
    np.testing.assert_array_equal(f["layers/body/input"][:], x.float().numpy())
    np.testing.assert_allclose(f["layers/body/output"][:], h.numpy(), rtol=1e-6)
    np.testing.assert_allclose(f["model/output"][:], (h * 2).numpy(), rtol=1e-6)


def test_spatial_mean_and_float16(tmp_path, small_resnet):
    _, f = run_probe(
        tmp_path,
        *small_resnet,
        "probes=all_convs",
        "probes.convs.reduce=spatial_mean",
        "probes.convs.dtype=float16",
    )
    model, inputs, _ = _model_and_inputs(make_cfg(*small_resnet))
    with torch.no_grad():
        ref = create_feature_extractor(model, return_nodes=["layer2.0.conv1"])(inputs)[
            "layer2.0.conv1"
        ]
    stored = f["layers/layer2.0.conv1/output"]
    assert stored.dtype == np.float16 and stored.shape == (7, 128)
    np.testing.assert_allclose(
        stored[:].astype(np.float64), ref.mean(dim=(2, 3)).numpy(), rtol=2e-3, atol=2e-3
    )


class Boom(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)

    def forward(self, x):
        self.conv(x)
        raise RuntimeError("kaboom")


def test_hooks_are_removed_after_a_forward_that_raises(tmp_path):
    model = Boom()
    cfg = make_cfg("probes=all_convs")
    selections = select_modules(model, parse(cfg).probes)
    with pytest.raises(RuntimeError, match="kaboom"), Capture(selections) as capture:
        capture.begin(2)
        assert model.conv._forward_hooks
        model(torch.randn(2, 3, 8, 8))
    assert not model.conv._forward_hooks and not model.conv._forward_pre_hooks


def test_run_that_raises_leaves_no_hooks_and_marks_file_incomplete(tmp_path, monkeypatch):
    import h5py

    import probe.launch.run as run_mod
    from probe.errors import ModelError

    built = {}
    real_build = run_mod.build_model

    def build_and_keep(cfg, seed):
        built["model"] = real_build(cfg, seed)
        return built["model"]

    monkeypatch.setattr(run_mod, "build_model", build_and_keep)
    with pytest.raises(ModelError, match="kaboom"):
        run_mod.run(
            make_cfg(
                "model=custom",
                "model._target_=tests.hooks.test_forward_values.Boom",
                "dataset.image_size=8",
            ),
            run_dir=tmp_path,
        )
    model = built["model"]
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    with h5py.File(tmp_path / "probe.h5") as f:
        assert not f.attrs["complete"]
