"""Attribution on token layouts and HuggingFace outputs: a timm ViT's CAMs through cam_grid
against pytorch-grad-cam with its reshape transform, grad x output of every block against
Captum, a sequence classifier's tuple outputs; and the named errors of bad attribution input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from probe.data.batches import build_batches
from probe.models.build import build_model
from probe.plan import parse
from probe.testing.compose import make_cfg
from probe.testing.tiny_lms import tiny_config
from tests.helpers import run_probe

captum_attr = pytest.importorskip("captum.attr")
pytest.importorskip("pytorch_grad_cam")
pytest.importorskip("timm")

VIT = [
    "model=timm", "model.name=vit_tiny_patch16_224", "model.num_classes=10",
    "+model.kwargs.img_size=64", "model.input_shape=[3,64,64]", "dataset.num_samples=4",
    "dataset.batch_size=2", "objective=logit", "objective.index=predicted",
]  # fmt: skip


def model_and_inputs(args):
    cfg = make_cfg(*args)
    model = build_model(parse(cfg).model, cfg.seed).eval()
    x = torch.cat(
        [b.inputs for b in build_batches(parse(cfg).data, parse(cfg).model, cfg.seed, model)]
    )
    return model, x


def vit_grid(t: torch.Tensor) -> torch.Tensor:
    """pytorch-grad-cam's ViT reshape transform: drop the class token, tokens to a 4x4 grid."""
    return t[:, 1:].reshape(t.size(0), 4, 4, t.size(2)).permute(0, 3, 1, 2)


def test_vit_cams_through_cam_grid_equal_pytorch_grad_cam(tmp_path):
    from pytorch_grad_cam import GradCAM, LayerCAM
    from pytorch_grad_cam.utils.image import scale_cam_image
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    args = [*VIT, "+probes.cam.layers=[blocks.11.norm1]", "+probes.cam.capture=[gradcam,layercam]",
            "+probes.cam.cam_grid=[4,4]", "+probes.cam.cam_skip_tokens=1", "probes=none"]  # fmt: skip
    _, f = run_probe(tmp_path, *args)
    model, x = model_and_inputs(args)
    with torch.no_grad():
        predicted = model(x).argmax(1).tolist()
    for site, kind in (("gradcam", GradCAM), ("layercam", LayerCAM)):
        ours = f[f"layers/blocks.11.norm1/{site}"][:]
        assert ours.shape == (4, 4, 4)
        with kind(model, [model.blocks[-1].norm1], reshape_transform=vit_grid) as cam:
            theirs = cam(input_tensor=x, targets=[ClassifierOutputTarget(k) for k in predicted])
        scaled = scale_cam_image(scale_cam_image(np.maximum(ours, 0), (64, 64)))
        np.testing.assert_allclose(scaled, theirs, rtol=1e-4, atol=1e-5, err_msg=site)


def test_vit_grad_x_output_of_every_block_equals_captum(tmp_path):
    args = [*VIT, "+probes.blocks.layers=[@blocks]", "+probes.blocks.capture=[grad_x_output]",
            "probes=none", "objective.index=7"]  # fmt: skip
    _, f = run_probe(tmp_path, *args)
    model, x = model_and_inputs(args)
    assert len(f["layers"]) == 12
    for i in range(12):
        ref = captum_attr.LayerGradientXActivation(model, model.blocks[i]).attribute(x, target=7)
        got = f[f"layers/blocks.{i}/grad_x_output"][:]
        np.testing.assert_allclose(got, ref.detach().numpy(), rtol=1e-4, atol=1e-6)


def test_a_sequence_classifiers_tuple_outputs_are_attributed(tmp_path):
    """BERT's layers return tuples and the model a ModelOutput: grad x output of each layer at
    objective=logit (label 1) equals Captum's over a forward that returns the logits."""
    from transformers import BertForSequenceClassification

    config = tiny_config("bert", 40)
    config.num_labels = 2
    with torch.random.fork_rng():
        torch.manual_seed(0)
        BertForSequenceClassification(config).save_pretrained(tmp_path / "bert")
    ids = torch.randint(3, 40, (4, 7), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, 5:] = 0
    torch.save({"input_ids": ids, "attention_mask": mask}, tmp_path / "ids.pt")
    args = ["model=hf", f"model.name={tmp_path / 'bert'}", "model.task=sequence_classification",
            "dataset=tokens", f"dataset.path={tmp_path / 'ids.pt'}", "dataset.batch_size=2",
            "+probes.layers.layers=[bert.encoder.layer.*]", "+probes.layers.leaves_only=false",
            "+probes.layers.exclude=[bert.encoder.layer.*.*]", "probes=none",
            "+probes.layers.capture=[grad_x_output]", "objective=logit", "objective.index=1"]  # fmt: skip
    _, f = run_probe(tmp_path / "run", *args)
    model = BertForSequenceClassification.from_pretrained(tmp_path / "bert").eval()
    for i in range(2):
        layer = model.bert.encoder.layer[i]
        gxa = captum_attr.LayerGradientXActivation(
            lambda x, m: model(input_ids=x, attention_mask=m).logits, layer
        )
        ref = gxa.attribute(ids, target=1, additional_forward_args=(mask,))
        ref = ref[0] if isinstance(ref, tuple) else ref
        group = f[f"layers/bert.encoder.layer.{i}"]
        name = next(n for n in group if n.startswith("grad_x_output") and "." not in n[13:])
        np.testing.assert_allclose(group[name][:], ref.detach().numpy(), rtol=1e-4, atol=1e-6)


R = ["model=resnet18", "dataset.image_size=32", "dataset.num_samples=2", "dataset.batch_size=2"]


@pytest.mark.parametrize(
    "args, words",
    [
        ([*R, "probes=all_linear", "probes.linear.capture=[gradcam]",
          "objective=logit", "objective.index=1"], "a CAM needs a (N, C, H, W) layout"),
        ([*VIT, "+probes.cam.layers=[blocks.11.norm1]", "+probes.cam.capture=[gradcam]",
          "+probes.cam.cam_grid=[3,3]", "+probes.cam.cam_skip_tokens=1", "probes=none"],
         "cam_grid=[3, 3] holds 9 tokens but the layer has 17 tokens"),
        ([*R, "probes=all_convs", "probes.convs.capture=[gradcam]",
          "objective=logit", "objective.index=target", "dataset=tensors",
          "dataset.path=@NOTARGETS"], "objective=logit objective.index=target needs targets"),
        ([*R, "probes=all_convs", "probes.convs.capture=[gradcam]",
          "objective=logit", "objective.index=1", "train_mode=true"],
         "BatchNorm layer 'bn1' normalises over the batch in train mode"),
        ([*R, "probes=all_convs", "probes.convs.capture=[ig_output]",
          "objective=logit", "objective.index=1", "attribution.steps=1"],
         "attribution.steps=1 must be at least 2"),
        ([*R, "probes=all_convs", "probes.convs.capture=[gradcam]",
          "objective=logit", "objective.index=ten"], "objective.index='ten' is neither"),
    ],
)  # fmt: skip
def test_bad_attribution_input_is_a_named_error(tmp_path, args, words, cli_in_process):
    plain = tmp_path / "x.pt"
    torch.save(torch.randn(2, 3, 32, 32), plain)
    args = [a.replace("@NOTARGETS", str(plain)) for a in args]
    out = cli_in_process(*args, f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode == 2, out.stderr[-3000:]
    assert words in out.stderr and "Traceback" not in out.stderr
