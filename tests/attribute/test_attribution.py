"""Attribution sites against the libraries users would otherwise call: Captum's
LayerGradientXActivation, LayerGradCam and LayerIntegratedGradients, and pytorch-grad-cam's CAMs
(ours through its own ReLU, min-max, resize and the min-max of its layers' mean), on a seeded resnet18 and a timm ViT; and the
exact identities that hold whatever the weights."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

from probe.data.batches import build_batches
from probe.launch.run import run
from probe.models.build import build_model
from probe.plan import parse
from probe.testing.compose import make_cfg
from tests.helpers import run_interrupted, run_probe

captum_attr = pytest.importorskip("captum.attr")
grad_cam = pytest.importorskip("pytorch_grad_cam")

CLASS = 3
CAMS = ["gradcam", "hirescam", "gradcam_pp", "layercam", "xgradcam"]
RESNET = [
    "model=resnet18", "model.num_classes=10", "dataset.image_size=64", "dataset.num_samples=5",
    "dataset.batch_size=3", "probes=all_convs", "probes.convs.types=[]",
    "probes.convs.layers=[layer3,layer4]", "objective=logit", f"objective.index={CLASS}",
]  # fmt: skip


def inputs_of(args) -> tuple[torch.nn.Module, torch.Tensor]:
    """The run's model (rebuilt from the same seed) and all its inputs as one tensor."""
    cfg = make_cfg(*args)
    model = build_model(parse(cfg).model, cfg.seed).eval()
    x = torch.cat(
        [b.inputs for b in build_batches(parse(cfg).data, parse(cfg).model, cfg.seed, model)]
    )
    return model, x


@pytest.fixture(scope="module")
def resnet_run(tmp_path_factory):
    """One run of every output attribution site on layer3 and layer4 of resnet18."""
    sites = ",".join(["grad_x_output", *CAMS])
    _, f = run_probe(tmp_path_factory.mktemp("cams"), *RESNET, f"probes.convs.capture=[{sites}]")
    model, x = inputs_of(RESNET)
    return f, model, x


def stored(f: h5py.File, layer: str, site: str) -> np.ndarray:
    return f[f"layers/{layer}/{site}"][:]


@pytest.mark.parametrize("layer", ["layer3", "layer4"])
def test_grad_x_output_equals_captums_layer_gradient_x_activation(resnet_run, layer):
    f, model, x = resnet_run
    want = captum_attr.LayerGradientXActivation(model, model.get_submodule(layer))
    ref = want.attribute(x, target=CLASS).detach().numpy()
    np.testing.assert_allclose(stored(f, layer, "grad_x_output"), ref, rtol=1e-5, atol=1e-7)


def test_gradcam_equals_captums_layer_gradcam_raw_and_signed(resnet_run):
    f, model, x = resnet_run
    for layer in ("layer3", "layer4"):
        gc = captum_attr.LayerGradCam(model, model.get_submodule(layer))
        ref = gc.attribute(x, target=CLASS, relu_attributions=False).detach()[:, 0].numpy()
        np.testing.assert_allclose(stored(f, layer, "gradcam"), ref, rtol=1e-5, atol=1e-7)
    signed = [stored(f, layer, site).min() for layer in ("layer3", "layer4") for site in CAMS]
    assert min(signed) < 0  # kept signed, as the layer gives them (no ReLU, no min-max)


@pytest.mark.parametrize("site", ["gradcam", "hirescam", "gradcam_pp", "layercam", "xgradcam"])
def test_cams_equal_pytorch_grad_cam_after_its_relu_minmax_and_resize(resnet_run, site):
    from pytorch_grad_cam import GradCAM, GradCAMPlusPlus, HiResCAM, LayerCAM, XGradCAM
    from pytorch_grad_cam.utils.image import scale_cam_image
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    kind = {"gradcam": GradCAM, "hirescam": HiResCAM, "gradcam_pp": GradCAMPlusPlus,
            "layercam": LayerCAM, "xgradcam": XGradCAM}[site]  # fmt: skip
    f, model, x = resnet_run
    for layer in ("layer3", "layer4"):
        with kind(model=model, target_layers=[model.get_submodule(layer)]) as cam:
            theirs = cam(input_tensor=x, targets=[ClassifierOutputTarget(CLASS)] * len(x))
        resized = scale_cam_image(np.maximum(stored(f, layer, site), 0), (x.shape[-1], x.shape[-2]))
        ours = scale_cam_image(resized)  # (its one layer's maps, scaled once more)
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5, err_msg=f"{site} {layer}")


def test_exact_identities_on_resnet18(resnet_run):
    """layer4 feeds global average pooling and fc: the sum of grad x output is the logit minus
    fc's bias; HiResCAM is grad x output summed over channels; where the gradient is spatially
    constant (layer4) GradCAM equals HiResCAM."""
    f, model, x = resnet_run
    with torch.no_grad():
        logit = model(x)[:, CLASS] - model.fc.bias[CLASS]
    np.testing.assert_allclose(stored(f, "layer4", "grad_x_output.sum"), logit, rtol=1e-5)
    for layer in ("layer3", "layer4"):
        summed = stored(f, layer, "grad_x_output").sum(1)
        np.testing.assert_allclose(stored(f, layer, "hirescam"), summed, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(
        stored(f, "layer4", "gradcam"), stored(f, "layer4", "hirescam"), rtol=1e-5, atol=1e-7
    )
    units = np.abs(stored(f, "layer3", "grad_x_output")).sum((2, 3))
    np.testing.assert_allclose(stored(f, "layer3", "grad_x_output.units"), units, rtol=1e-5)


@pytest.mark.parametrize("method", ["riemann_trapezoid", "gausslegendre"])
def test_ig_output_equals_captums_layer_integrated_gradients(tmp_path, method):
    """Captum integrates between the layer's values at an input baseline and at the input: a
    run over that baseline image gives the same layer baseline (attribution.baseline=DIR).
    Captum's trapezoid spaces its n points 1/n apart where they are 1/(n-1) apart, so its
    weights sum to (n-1)/n: its attributions are (n-1)/n of the rule's (docs/attribution.md)."""
    zero = tmp_path / "zero.pt"
    torch.save(torch.zeros(1, 3, 64, 64), zero)
    at_zero = ["dataset=tensors", f"dataset.path={zero}", "probes.convs.capture=[output]"]
    run_probe(tmp_path / "baseline", *RESNET, *at_zero)
    args = [*RESNET, "probes.convs.layers=[layer3]", "probes.convs.capture=[ig_output]",
            "attribution.steps=16", f"attribution.method={method}",
            f"attribution.baseline={tmp_path / 'baseline'}"]  # fmt: skip
    _, f = run_probe(tmp_path / "ig", *args)
    model, x = inputs_of(args)
    lig = captum_attr.LayerIntegratedGradients(model, model.layer3)
    ref, delta = lig.attribute(
        x, baselines=torch.zeros_like(x), target=CLASS, n_steps=16, method=method,
        return_convergence_delta=True,
    )  # fmt: skip
    scale = 16 / 15 if method == "riemann_trapezoid" else 1.0
    got = stored(f, "layer3", "ig_output")
    np.testing.assert_allclose(got, ref.detach() * scale, rtol=1e-4, atol=1e-6)
    if method == "gausslegendre":  # (the same weights: the same completeness gap)
        np.testing.assert_allclose(stored(f, "layer3", "ig_output.gap"), delta.detach(), atol=1e-4)


@pytest.mark.parametrize("method", ["riemann_trapezoid", "gausslegendre"])
def test_the_completeness_gap_shrinks_with_more_steps(tmp_path, method):
    """On a model curved along the path (tanh), |gap| / |F(x) - F(x')| is below 1e-3 at 64
    steps and grows as the steps shrink. (A random-init resnet is positively homogeneous from a
    zero baseline, so any step count is exact there.)"""
    gaps = {}
    for steps in (4, 64):
        args = ["model=custom", "model._target_=probe.testing.models.SmoothNet",
                "model.input_shape=[3,8,8]", "model.num_classes=10", "dataset.num_samples=6",
                "dataset.batch_size=3", "probes=all_convs", "probes.convs.layers=[conv1]",
                "probes.convs.capture=[ig_output]", "objective=logit", "objective.index=3",
                f"attribution.steps={steps}", f"attribution.method={method}"]  # fmt: skip
        _, f = run_probe(tmp_path / str(steps), *args)
        total, gap = stored(f, "conv1", "ig_output.sum"), stored(f, "conv1", "ig_output.gap")
        gaps[steps] = np.abs(gap / (total - gap))
    assert gaps[64].max() < 1e-3 and gaps[4].max() > 100 * gaps[64].max()


def test_attributions_do_not_depend_on_the_batch(tmp_path):
    sites = "[grad_x_output,gradcam,ig_output]"
    runs = {}
    for size in (1, 5):
        args = [*RESNET, f"dataset.batch_size={size}", f"probes.convs.capture={sites}",
                "attribution.steps=4"]  # fmt: skip
        runs[size] = run_probe(tmp_path / str(size), *args)[1]
    for name in ("grad_x_output", "gradcam", "ig_output", "ig_output.gap"):
        np.testing.assert_allclose(
            stored(runs[1], "layer4", name), stored(runs[5], "layer4", name), rtol=1e-5, atol=1e-6
        )


def test_a_resumed_attribution_run_equals_an_uninterrupted_one(tmp_path):
    from tests.helpers import assert_same_arrays

    args = [
        "model=custom", "model._target_=probe.testing.models.SignalsItself",
        "model.input_shape=[3,8,8]", "model.num_classes=10", "dataset.num_samples=10",
        "dataset.batch_size=3", "probes=all_convs", "probes.convs.capture=[gradcam,ig_output]",
        "objective=logit", "objective.index=predicted", "attribution.steps=4",
    ]  # fmt: skip
    reference = run(make_cfg(*args), run_dir=tmp_path / "reference")
    run_interrupted(tmp_path / "run", 7, *args)  # the 2nd batch's integrated gradients
    resumed = run(make_cfg(*args, "resume=true"), run_dir=tmp_path / "run")
    assert assert_same_arrays(reference.h5_path, resumed.h5_path) >= 8
