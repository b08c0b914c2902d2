"""Attribution computed where the tensors live: a GPU run stores the CPU run's maps (apart from
the Captum and pytorch-grad-cam comparisons, so it runs where those libraries are absent)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers import run_probe

RESNET = [
    "model=resnet18", "model.num_classes=10", "dataset.image_size=64", "dataset.num_samples=5",
    "dataset.batch_size=3", "probes=all_convs", "probes.convs.types=[]",
    "probes.convs.layers=[layer3,layer4]", "objective=logit", "objective.index=3",
]  # fmt: skip


def stored(f, layer: str, site: str) -> np.ndarray:
    return f[f"layers/{layer}/{site}"][:]


@pytest.mark.cuda
def test_attributions_on_the_gpu_equal_the_cpus(tmp_path, monkeypatch):
    """TF32 off: a GPU run stores the CPU run's maps."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    args = [*RESNET, "probes.convs.capture=[grad_x_output,gradcam,gradcam_pp,ig_output]",
            "attribution.steps=4"]  # fmt: skip
    _, gpu = run_probe(tmp_path / "gpu", *args, "device=cuda")
    _, cpu = run_probe(tmp_path / "cpu", *args)
    for layer in ("layer3", "layer4"):
        for site in ("grad_x_output", "gradcam", "gradcam_pp", "ig_output", "ig_output.gap"):
            np.testing.assert_allclose(
                stored(gpu, layer, site), stored(cpu, layer, site), rtol=1e-4, atol=1e-5,
                err_msg=f"{layer} {site}",
            )  # fmt: skip
