"""transformers and timm models built from the config: real tiny models saved with save_pretrained
into tmp_path, real timm architectures; nothing is downloaded."""

from __future__ import annotations

import time

import pytest
import torch

from probe.errors import CheckpointError, ConfigError
from probe.models.build import build_model
from probe.models.hub import pad_token_id, vocab_size
from probe.plan import parse
from probe.testing.compose import make_cfg
from probe.testing.tiny_lms import tiny_config
from tests.helpers import cli

transformers = pytest.importorskip("transformers")
timm = pytest.importorskip("timm")

LAYER = {
    "gpt2": "transformer.h.0",
    "bert-base-uncased": "bert.encoder.layer.0",
    "smollm2-135m": "model.layers.0",
}
TASK_CLASS = {
    "causal_lm": transformers.AutoModelForCausalLM,
    "masked_lm": transformers.AutoModelForMaskedLM,
    "base": transformers.AutoModel,
}


@pytest.fixture
def hub_online(monkeypatch):
    """The hub as the machine reaches it (the tests run it offline otherwise): these tests are
    about a name it does not answer for, on a machine with or without network."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # (and the CLI runs it starts)


def saved(tmp_path, model_type: str, task: str, seed: int = 1):
    """A tiny model with seeded weights, saved into tmp_path; returns (dir, the model)."""
    torch.manual_seed(seed)
    config = tiny_config(model_type, 100)
    model = TASK_CLASS[task].from_config(config).eval()
    path = tmp_path / model_type
    model.save_pretrained(path)
    return path, model


def ids(n: int = 2, t: int = 7) -> torch.Tensor:
    return torch.randint(1, 100, (n, t), generator=torch.Generator().manual_seed(0))


def hf_model(*overrides: str, seed: int = 0):
    cfg = make_cfg("model=hf", *overrides)
    return build_model(parse(cfg).model, seed)


@pytest.mark.parametrize(
    ("model_type", "task"), [("gpt2", "causal_lm"), ("bert", "masked_lm"), ("llama", "causal_lm")]
)
def test_saved_folder_loads_with_its_weights(tmp_path, model_type, task):
    path, reference = saved(tmp_path, model_type, task)
    model = hf_model(f"model.name={path}", f"model.task={task}")
    assert type(model) is type(reference) and not model.training
    assert model.config.use_cache is False
    x = ids()
    with torch.no_grad():
        out = model(x)
        torch.testing.assert_close(out.logits, reference(x).logits, rtol=0, atol=0)
    assert getattr(out, "past_key_values", None) is None
    assert vocab_size(model) == 100


def test_pretrained_false_is_a_seeded_random_init_of_the_same_architecture(tmp_path):
    path, reference = saved(tmp_path, "gpt2", "causal_lm")
    args = (f"model.name={path}", "model.task=causal_lm", "model.pretrained=false")
    a, b, c = hf_model(*args, seed=0), hf_model(*args, seed=0), hf_model(*args, seed=5)
    shapes = {k: v.shape for k, v in reference.state_dict().items()}
    assert {k: v.shape for k, v in a.state_dict().items()} == shapes
    w = "transformer.h.0.attn.c_attn.weight"
    assert torch.equal(a.state_dict()[w], b.state_dict()[w])
    assert not torch.equal(a.state_dict()[w], c.state_dict()[w])
    assert not torch.equal(a.state_dict()[w], reference.state_dict()[w])


def test_config_overrides_apply_to_a_saved_folder(tmp_path):
    path, _ = saved(tmp_path, "llama", "causal_lm")
    model = hf_model(f"model.name={path}", "model.task=base", "+model.config.rope_theta=500000.0")
    assert model.config.rope_parameters["rope_theta"] == 500000.0
    assert pad_token_id(model) == 0
    with pytest.raises(ConfigError, match="n_layer"):
        hf_model(f"model.name={path}", "+model.config.n_layer=3")


def test_pretrained_false_from_model_type_alone_needs_no_folder_nor_network(hub_online):
    start = time.monotonic()
    model = hf_model(
        "model.name=nowhere/tiny-gpt2",
        "model.task=causal_lm",
        "model.pretrained=false",
        "+model.config.model_type=gpt2",
        "+model.config.n_layer=1",
        "+model.config.n_embd=16",
        "+model.config.n_head=2",
        "+model.config.vocab_size=50",
    )
    assert time.monotonic() - start < 10
    assert type(model).__name__ == "GPT2LMHeadModel" and len(model.transformer.h) == 1
    assert vocab_size(model) == 50 and model.lm_head.out_features == 50
    with torch.no_grad():
        assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 50)


@pytest.mark.parametrize(
    ("model", "layers", "layer_key", "total"),
    [
        ("gpt2", 12, "n_layer", 124_439_808),
        ("bert-base-uncased", 12, "num_hidden_layers", 109_514_298),
        ("smollm2-135m", 30, "num_hidden_layers", 134_515_008),
    ],
)
def test_shipped_configs_build_offline_with_the_real_architecture(model, layers, layer_key, total):
    """model.pretrained=false builds the real model's architecture from the shipped config (its
    parameter count; built with one layer, as the layers are alike, to stay quick)."""
    cfg = make_cfg(f"model={model}", "model.pretrained=false", f"model.config.{layer_key}=1")
    net = build_model(parse(cfg).model, 0)
    assert not net.training and net.config.use_cache is False
    layer = sum(p.numel() for p in net.get_submodule(LAYER[model]).parameters())
    assert sum(p.numel() for p in net.parameters()) + (layers - 1) * layer == total


@pytest.mark.parametrize("task", ["sequence_classification", "token_classification"])
def test_classification_heads_take_num_classes_only_when_set(tmp_path, task):
    path, _ = saved(tmp_path, "bert", "base")
    args = (f"model.name={path}", f"model.task={task}")
    assert hf_model(*args).config.num_labels == 2  # the config's own
    assert hf_model(*args, "model.num_classes=5").config.num_labels == 5
    assert hf_model(*args, "model.num_classes=5", "+model.config.num_labels=3").num_labels == 3


def test_user_errors_name_the_value(tmp_path):
    with pytest.raises(ConfigError, match="model.task='generate'.*causal_lm"):
        hf_model("model.name=gpt2", "model.task=generate")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="without config.json"):
        hf_model(f"model.name={empty}")
    with pytest.raises(ConfigError, match="is not a directory"):
        hf_model(f"model.name={tmp_path / 'missing'}")
    with pytest.raises(ConfigError, match="model_type='gtp2'.*gpt2"):
        hf_model("model.name=x", "model.pretrained=false", "+model.config.model_type=gtp2")
    with pytest.raises(ConfigError, match="model.library='keras'.*hf"):
        build_model(parse(make_cfg("model=hf", "model.name=x", "model.library=keras")).model, 0)


def test_an_unreachable_hub_name_fails_fast_with_the_way_out(hub_online):
    """No network here (or an unknown name where there is one): one try, no retries."""
    start = time.monotonic()
    with pytest.raises(ConfigError, match="no-such-org/no-such-model.*model.pretrained=false"):
        hf_model("model.name=no-such-org/no-such-model")
    assert time.monotonic() - start < 15


def test_cli_unknown_hf_name_exits_2_with_one_line(hub_online):
    out = cli("model=hf", "model.name=no-such-org/no-such-model", timeout=120)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("probe: error")]
    assert len(lines) == 1 and "no-such-org/no-such-model" in lines[0]


def test_timm_model_equals_a_plain_create_model_with_the_same_seed():
    model = build_model(
        parse(make_cfg("model=timm", "model.name=resnet18", "model.num_classes=10")).model, 3
    )
    torch.manual_seed(3)
    plain = timm.create_model("resnet18", pretrained=False, num_classes=10).eval()
    x = torch.randn(2, 3, 64, 64)
    assert not model.training and vocab_size(model) is None and pad_token_id(model) is None
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x), rtol=0, atol=0)


def test_timm_unknown_name_gives_close_matches():
    with pytest.raises(ConfigError, match="resnet18"):
        build_model(parse(make_cfg("model=timm", "model.name=resnet_18")).model, 0)
