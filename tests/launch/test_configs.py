"""Every shipped config composes and builds; the real loaders work on data the tests make."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image

from probe.config import config_dir
from probe.data.batches import build_batches
from probe.errors import SelectionError
from probe.hooks.module_select import select_modules
from probe.models.build import build_model
from probe.plan import parse
from probe.testing.compose import make_cfg
from tests.helpers import run_probe

CONF = Path(config_dir())
MODELS = sorted(
    p.stem for p in (CONF / "model").glob("*.yaml") if p.stem not in ("custom", "torchvision")
)
NAMED_BY_USER = ("hf", "timm")  # name: ??? (tests/models/test_hub_models.py builds them)
TOKEN_MODELS = {"gpt2": 12, "bert-base-uncased": 12, "smollm2-135m": 30}  # their blocks
IMAGE_MODELS = [m for m in MODELS if m not in TOKEN_MODELS and m not in NAMED_BY_USER]
PROBES = sorted(p.stem for p in (CONF / "probes").glob("*.yaml"))
TOKEN_PROBES = ("residual", "attn_mlp", "mlp_io")  # the blocks of a transformer's stack
CONV_PROBES = ("all_convs", "grads_all_convs")
NO_CONVS = ("mlp",)  # (a conv probe file refuses it by name: tested below)


@pytest.mark.parametrize("model", IMAGE_MODELS)
def test_every_model_config_builds_and_every_probe_file_selects(model):
    cfg = make_cfg(f"model={model}")
    net = build_model(parse(cfg).model, cfg.seed)
    assert not net.training
    x = torch.randn(1, *cfg.model.input_shape)
    with torch.no_grad():
        assert net(x).shape == (1, cfg.model.num_classes)
    for probes in PROBES:
        if probes in TOKEN_PROBES or (model in NO_CONVS and probes in CONV_PROBES):
            continue
        selections = select_modules(
            net, parse(make_cfg(f"model={model}", f"probes={probes}")).probes
        )
        for sel in selections:
            assert dict(net.named_modules())[sel.name] is sel.module


@pytest.mark.parametrize("probes", CONV_PROBES)
def test_a_conv_probe_file_on_a_model_without_convolutions_names_it(probes):
    net = build_model(parse(make_cfg("model=mlp")).model, 0)
    with pytest.raises(SelectionError, match="selects no module of MLP.*Conv2d"):
        select_modules(net, parse(make_cfg("model=mlp", f"probes={probes}")).probes)


@pytest.mark.parametrize("model", sorted(TOKEN_MODELS))
def test_every_token_model_config_builds_and_its_probes_select_each_block(model):
    """The shipped language models build offline (model.pretrained=false, random init) and the
    transformer probes select each block once (residual) and its attention and MLP (attn_mlp)."""
    cfg = make_cfg(f"model={model}", "model.pretrained=false")
    net = build_model(parse(cfg).model, cfg.seed)
    with torch.no_grad():
        logits = net(input_ids=torch.tensor([[5, 6, 7]])).logits
    assert logits.shape == (1, 3, net.config.vocab_size)
    blocks = TOKEN_MODELS[model]
    for probes, per_block in (("residual", 1), ("attn_mlp", 2), ("all_linear", None)):
        chosen = select_modules(net, parse(make_cfg(f"model={model}", f"probes={probes}")).probes)
        assert per_block is None or len(chosen) == per_block * blocks
        assert chosen and all(dict(net.named_modules())[s.name] is s.module for s in chosen)


def test_seeded_init_is_reproducible_and_seed_dependent():
    a = build_model(parse(make_cfg()).model, 0).conv1.weight
    b = build_model(parse(make_cfg()).model, 0).conv1.weight
    c = build_model(parse(make_cfg()).model, 1).conv1.weight
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_torchvision_weights_pass_through(tmp_path, monkeypatch):
    """weights=DEFAULT goes through torchvision's own loader (served here from its cache folder)."""
    reference = torchvision.models.resnet18()
    torch.nn.init.constant_(reference.fc.bias, 0.25)
    cache = tmp_path / "hub" / "checkpoints"
    cache.mkdir(parents=True)
    name = Path(torchvision.models.ResNet18_Weights.DEFAULT.url).name
    torch.save(reference.state_dict(), cache / name)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    model = build_model(parse(make_cfg("model.weights=DEFAULT")).model, seed=0)
    for k, v in reference.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


def test_other_torchvision_model_by_name(tmp_path):
    _, f = run_probe(
        tmp_path,
        "model=torchvision",
        "model.name=squeezenet1_0",
        "model.num_classes=10",
        "dataset.image_size=64",
        "dataset.num_samples=2",
        "probes=all_convs",
        "probes.convs.layers=[features.0]",
    )
    cfg = make_cfg(
        "model=torchvision",
        "model.name=squeezenet1_0",
        "model.num_classes=10",
        "dataset.image_size=64",
        "dataset.num_samples=2",
    )
    net = build_model(parse(cfg).model, cfg.seed)
    x = torch.cat([b.inputs for b in build_batches(parse(cfg).data, parse(cfg).model, cfg.seed)])
    with torch.no_grad():
        np.testing.assert_allclose(
            f["layers/features.0/output"][:], net.features[0](x).numpy(), rtol=1e-5, atol=1e-5
        )
    np.testing.assert_allclose(f["model/output"][:], net(x).detach().numpy(), rtol=1e-4, atol=1e-5)


def test_lenet_runs_on_its_own_input_shape(tmp_path):
    _, f = run_probe(tmp_path, "model=lenet", "probes=all_linear", "dataset.num_samples=3")
    assert f["layers/fc1/output"].shape == (3, 120) and f["model/output"].shape == (3, 10)
    assert f["samples/target"][:].max() < 10


def _image_folder(root: Path, per_class: int = 3) -> Path:
    rng = np.random.default_rng(0)
    for cls in ("cat", "dog"):
        (root / cls).mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / cls / f"{i}.png")
    return root


def test_imagefolder_loads_resizes_and_normalises_in_order(tmp_path):
    root = _image_folder(tmp_path / "images")
    over = [
        "dataset=imagefolder",
        f"dataset.root={root}",
        "dataset.resize=36",
        "dataset.crop=32",
        "dataset.batch_size=4",
        "probes=all_convs",
        "probes.convs.layers=[conv1]",
    ]
    _, f = run_probe(tmp_path / "run", *over)
    np.testing.assert_array_equal(f["samples/target"][:], [0, 0, 0, 1, 1, 1])
    tf = torchvision.transforms.Compose(
        [
            torchvision.transforms.Resize(36),
            torchvision.transforms.CenterCrop(32),
            torchvision.transforms.ToTensor(),
            torchvision.transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
        ]
    )
    first = tf(Image.open(root / "cat" / "0.png").convert("RGB"))[None]
    net = build_model(parse(make_cfg()).model, 0)
    with torch.no_grad():
        np.testing.assert_allclose(
            f["layers/conv1/output"][0:1], net.conv1(first).numpy(), rtol=1e-5, atol=1e-5
        )


def test_fakedata_and_tensors_datasets(tmp_path):
    cfg = make_cfg(
        "dataset=fakedata", "dataset.image_size=16", "dataset.num_samples=5", "dataset.batch_size=2"
    )
    batches = list(build_batches(parse(cfg).data, parse(cfg).model, cfg.seed))
    fake = torchvision.datasets.FakeData(
        5, (3, 16, 16), 1000, torchvision.transforms.ToTensor(), random_offset=0
    )
    np.testing.assert_array_equal(batches[2].inputs[0].numpy(), fake[4][0].numpy())
    assert [b.start for b in batches] == [0, 2, 4]
    x, y = torch.randn(5, 3, 8, 8), torch.arange(5)
    torch.save({"inputs": x, "targets": y}, tmp_path / "xy.pt")
    cfg = make_cfg(
        "dataset=tensors",
        f"dataset.path={tmp_path / 'xy.pt'}",
        "dataset.batch_size=2",
        "dataset.num_samples=3",
    )
    batches = list(build_batches(parse(cfg).data, parse(cfg).model, cfg.seed))
    assert torch.equal(torch.cat([b.inputs for b in batches]), x[:3])
    assert torch.equal(torch.cat([b.targets for b in batches]), y[:3])


def test_missing_custom_target_is_a_message(tmp_path, cli_in_process):
    out = cli_in_process("model=custom", f"hydra.run.dir={tmp_path}")
    text = out.stdout + out.stderr
    assert out.returncode == 2 and "Traceback" not in text and "model._target_" in text
