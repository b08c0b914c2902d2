"""probe.models.sae: tiny SAEs written in the SAELens layout (cfg.json + sae_weights.safetensors),
checked against SAELens's formulas written again in numpy (float64) from the same weights and
against SAELens's own reading of the same folders (its encode and decode, recorded in
sae_lens_values.npz by record_sae_lens.py, and run live where sae_lens is installed), and each
load error."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from probe.errors import ConfigError
from probe.models.sae import SAE, check_width, load_sae

D_IN, D_SAE, K = 16, 64, 8
ARCHITECTURES = ["standard", "topk", "jumprelu"]


def weights(arch: str, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    found = {
        "W_enc": torch.randn(D_IN, D_SAE, generator=g) * 0.3,
        "b_enc": torch.randn(D_SAE, generator=g) * 0.1,
        "W_dec": torch.randn(D_SAE, D_IN, generator=g) * 0.3,
        "b_dec": torch.randn(D_IN, generator=g) * 0.5,
    }
    if arch == "jumprelu":
        found["threshold"] = torch.rand(D_SAE, generator=g) * 0.3
    return found


def write_sae(folder, arch="standard", tensors=None, **cfg_changes) -> dict[str, torch.Tensor]:
    """Writes an SAE to `folder`; cfg_changes set keys of cfg.json (None removes one)."""
    tensors = weights(arch) if tensors is None else tensors
    cfg = {
        "architecture": arch,
        "d_in": D_IN,
        "d_sae": D_SAE,
        "apply_b_dec_to_input": True,
        "normalize_activations": "none",
        "dtype": "float32",
        "device": "cpu",
        "metadata": {"hook_name": "blocks.0.hook_resid_post", "sae_lens_version": "6.0.0"},
    }
    if arch == "topk":
        cfg["k"] = K
    cfg.update(cfg_changes)
    cfg = {key: value for key, value in cfg.items() if value is not None}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cfg.json").write_text(json.dumps(cfg))
    save_file({n: t.contiguous() for n, t in tensors.items()}, folder / "sae_weights.safetensors")
    return tensors


def reference(tensors, x, arch, apply_b_dec=True, k=K, rescale=False):
    """SAELens's encode and decode in float64 numpy: latents and reconstruction."""
    w = {name: t.double().numpy() for name, t in tensors.items()}
    x = np.asarray(x, dtype=np.float64)
    pre = (x - w["b_dec"] if apply_b_dec else x) @ w["W_enc"] + w["b_enc"]
    norms = np.linalg.norm(w["W_dec"], axis=-1)
    if arch == "standard":
        z = np.maximum(pre, 0.0)
    elif arch == "topk":  # the k largest pre-activations, ReLU of those, the rest 0
        pre = pre * norms if rescale else pre
        top = np.argsort(-pre, axis=-1)[..., :k]
        z = np.zeros_like(pre)
        np.put_along_axis(z, top, np.maximum(np.take_along_axis(pre, top, -1), 0.0), -1)
    else:  # jumprelu: relu(pre) where pre > threshold, else 0
        z = np.where(pre > w["threshold"], np.maximum(pre, 0.0), 0.0)
    return z, (z / norms if rescale else z) @ w["W_dec"] + w["b_dec"]


def inputs(shape=(3, 5), seed=1) -> torch.Tensor:
    return torch.randn(*shape, D_IN, generator=torch.Generator().manual_seed(seed))


def close(got: torch.Tensor, want: np.ndarray, rtol=1e-5, atol=1e-5):
    np.testing.assert_allclose(got.double().numpy(), want, rtol=rtol, atol=atol)


# --- what it computes -------------------------------------------------------------------------


@pytest.mark.parametrize("apply_b_dec", [True, False])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_encode_and_decode_match_numpy(tmp_path, arch, apply_b_dec):
    tensors = write_sae(tmp_path, arch, apply_b_dec_to_input=apply_b_dec)
    sae = load_sae(tmp_path)
    assert (sae.architecture, sae.d_in, sae.d_sae, sae.dtype) == (arch, D_IN, D_SAE, torch.float32)
    assert sae.apply_b_dec_to_input is apply_b_dec
    assert sae.k == (K if arch == "topk" else None)
    assert (sae.threshold is not None) == (arch == "jumprelu")
    assert sae.hook_name == "blocks.0.hook_resid_post"
    x = inputs()
    z = sae.encode(x)
    want_z, want_recon = reference(tensors, x, arch, apply_b_dec)
    assert z.shape == (3, 5, D_SAE) and z.dtype == torch.float32
    close(z, want_z)
    assert 0 < (want_z > 0).sum() < want_z.size  # the test sees both active and inactive latents
    recon = sae.decode(z)
    assert recon.shape == (3, 5, D_IN)
    close(recon, want_recon)


def test_to_returns_a_new_sae_in_the_dtype(tmp_path):
    tensors = write_sae(tmp_path, "jumprelu")
    sae = load_sae(tmp_path)
    wide = sae.to("cpu", torch.float64)
    assert wide is not sae and sae.dtype == torch.float32 and sae.threshold.dtype == torch.float32
    assert all(t.dtype == torch.float64 for t in (wide.W_enc, wide.b_dec, wide.threshold))
    x = inputs().double()
    want_z, want_recon = reference(tensors, x, "jumprelu")
    close(wide.encode(x), want_z, rtol=1e-12, atol=1e-12)
    close(wide.decode(wide.encode(x)), want_recon, rtol=1e-12, atol=1e-12)


def test_topk_rows_have_at_most_k_and_exactly_k_where_the_top_k_are_positive(tmp_path):
    tensors = weights("topk")
    planted = torch.tensor([3, 10, 17, 20, 33, 41, 50, 63])
    tensors["b_enc"] = torch.full((D_SAE,), -0.5)
    tensors["b_enc"][planted] = 20.0  # these k pre-activations are the largest, and positive
    write_sae(tmp_path / "planted", "topk", tensors)
    z = load_sae(tmp_path / "planted").encode(inputs((40,)))
    assert ((z != 0).sum(-1) == K).all()
    assert (z[:, planted] > 0).all()
    write_sae(tmp_path / "random", "topk")
    z = load_sae(tmp_path / "random").encode(inputs((40,)) * 3)
    assert ((z != 0).sum(-1) <= K).all() and (z >= 0).all()
    # SAELens takes the top k of the pre-activations, then ReLU: negative ones among them are 0
    tensors["b_enc"] = torch.full((D_SAE,), -50.0)
    write_sae(tmp_path / "negative", "topk", tensors)
    assert (load_sae(tmp_path / "negative").encode(inputs((40,))) == 0).all()


def test_jumprelu_respects_the_threshold(tmp_path):
    tensors = weights("jumprelu")
    tensors["W_enc"][:, :2] = 0.0  # pre-activations of latents 0 and 1 are their b_enc
    tensors["threshold"][:2] = 0.25
    tensors["b_enc"][0] = 0.25  # at the threshold: off
    tensors["b_enc"][1] = 0.25 + 1e-4  # just above: on, with its pre-activation as value
    write_sae(tmp_path, "jumprelu", tensors)
    sae = load_sae(tmp_path)
    x = inputs((50,)) * 2
    z = sae.encode(x)
    assert (z[:, 0] == 0).all()
    assert torch.allclose(z[:, 1], torch.tensor(0.25 + 1e-4))
    pre = (x - tensors["b_dec"]) @ tensors["W_enc"] + tensors["b_enc"]
    active = z != 0
    assert active.any() and (~active).any()
    assert (pre[active] > tensors["threshold"].expand_as(pre)[active]).all()
    assert torch.equal(z[active], pre[active])


def test_apply_b_dec_to_input_subtracts_b_dec_before_the_encoder(tmp_path):
    tensors = weights("standard")
    tensors["b_enc"] = torch.full((D_SAE,), 30.0)  # every latent active: relu is the identity
    write_sae(tmp_path / "on", "standard", tensors)
    write_sae(tmp_path / "off", "standard", tensors, apply_b_dec_to_input=False)
    write_sae(tmp_path / "default", "standard", tensors, apply_b_dec_to_input=None)
    on, off = load_sae(tmp_path / "on"), load_sae(tmp_path / "off")
    assert load_sae(tmp_path / "default").apply_b_dec_to_input is True  # SAELens's default
    x = inputs()
    shift = tensors["b_dec"] @ tensors["W_enc"]
    assert torch.allclose(off.encode(x) - on.encode(x), shift.expand(3, 5, D_SAE), atol=1e-4)
    b_dec = tensors["b_dec"]
    assert torch.allclose(on.encode(b_dec), tensors["b_enc"])  # the input b_dec is centred to 0
    assert torch.allclose(off.encode(b_dec), shift + tensors["b_enc"], atol=1e-5)


def test_older_sae_lens_configs(tmp_path):
    """SAELens < 6: no architecture key, hook_point, activation_fn_str=topk with its k in
    activation_fn_kwargs, normalize_activations=false, log_threshold for jumprelu."""
    tensors = write_sae(
        tmp_path / "topk",
        "standard",
        architecture=None,
        metadata=None,
        hook_point="blocks.2.hook_resid_pre",
        activation_fn_str="topk",
        activation_fn_kwargs={"k": 5},
        normalize_activations=False,
    )
    sae = load_sae(tmp_path / "topk")
    assert (sae.architecture, sae.k, sae.hook_name) == ("topk", 5, "blocks.2.hook_resid_pre")
    close(sae.encode(inputs()), reference(tensors, inputs(), "topk", k=5)[0])
    assert load_sae(tmp_path / "topk").cfg["activation_fn_kwargs"] == {"k": 5}
    tensors = weights("jumprelu")
    tensors["log_threshold"] = tensors.pop("threshold").log()
    write_sae(tmp_path / "jumprelu", "jumprelu", tensors)
    sae = load_sae(tmp_path / "jumprelu")
    assert torch.allclose(sae.threshold, tensors["log_threshold"].exp())


def test_topk_rescaled_by_decoder_norm(tmp_path):
    tensors = write_sae(tmp_path, "topk", rescale_acts_by_decoder_norm=True)
    sae = load_sae(tmp_path)
    z = sae.encode(inputs())
    want_z, want_recon = reference(tensors, inputs(), "topk", rescale=True)
    close(z, want_z)
    close(sae.decode(z), want_recon)


def test_check_width(tmp_path):
    write_sae(tmp_path, "standard")
    sae = load_sae(tmp_path)
    check_width(sae, D_IN, "probe.sae")
    with pytest.raises(ConfigError) as caught:
        check_width(sae, 512, "probe.sae")
    message = str(caught.value)
    for words in ["probe.sae", str(tmp_path), f"d_in={D_IN}", "512 wide", "trained on this layer"]:
        assert words in message


@pytest.mark.parametrize("apply_b_dec", [True, False])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_sae_lens_reads_the_same_folder_the_same_way(tmp_path, arch, apply_b_dec):
    """probe's encode and decode equal SAELens's on the same folder: the values SAELens gave
    (sae_lens_values.npz), and where sae_lens is installed, what it gives now."""
    recorded = np.load(Path(__file__).with_name("sae_lens_values.npz"))
    tensors = {
        name.split("/")[1]: torch.from_numpy(recorded[name])
        for name in recorded.files
        if name.startswith(f"{arch}/") and name.count("/") == 1
    }
    write_sae(tmp_path, arch, tensors, apply_b_dec_to_input=apply_b_dec)
    x = torch.from_numpy(recorded["inputs"])
    z, recon = (torch.from_numpy(recorded[f"{arch}/{apply_b_dec}/{v}"]) for v in ("z", "recon"))
    if importlib.util.find_spec("sae_lens") is not None:
        from tests.models.record_sae_lens import sae_lens_reads

        live_z, live_recon = sae_lens_reads(tmp_path, x)
        torch.testing.assert_close(torch.from_numpy(live_z), z, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.from_numpy(live_recon), recon, rtol=1e-5, atol=1e-6)
    ours = load_sae(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(ours.encode(x), z, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours.decode(z), recon, rtol=1e-5, atol=1e-6)
    assert 0 < (z > 0).sum() < z.numel()  # both active and inactive latents


# --- errors -----------------------------------------------------------------------------------


def bad_json(folder):
    write_sae(folder)
    (folder / "cfg.json").write_text('{"d_in": 16,')


def replace_tensor(name, tensor, arch="standard"):
    def change(folder):
        tensors = weights(arch)
        tensors[name] = tensor
        write_sae(folder, arch, tensors)

    return change


def without_tensor(name, arch="standard"):
    def change(folder):
        tensors = weights(arch)
        del tensors[name]
        write_sae(folder, arch, tensors)

    return change


ERRORS = {
    "no folder": (lambda folder: None, ["no SAE folder", "cfg.json", "sae_weights.safetensors"]),
    "no cfg.json": (
        lambda folder: (write_sae(folder), (folder / "cfg.json").unlink()),
        ["has no cfg.json", "SAELens"],
    ),
    "cfg.json not JSON": (bad_json, ["cfg.json is not JSON", "Expecting", "line 1"]),
    "cfg.json a list": (
        lambda folder: (write_sae(folder), (folder / "cfg.json").write_text("[1]")),
        ["cfg.json holds a list"],
    ),
    "no weights": (
        lambda folder: (write_sae(folder), (folder / "sae_weights.safetensors").unlink()),
        ["has no sae_weights.safetensors", "save_model"],
    ),
    "weights not safetensors": (
        lambda folder: (write_sae(folder), (folder / "sae_weights.safetensors").write_text("x")),
        ["sae_weights.safetensors is not a safetensors file"],
    ),
    "no b_enc": (without_tensor("b_enc"), ["no b_enc tensor", "found: W_dec, W_enc, b_dec"]),
    "unknown architecture": (
        lambda folder: write_sae(folder, architecture="gated"),
        ["architecture='gated'", "known: standard, topk, jumprelu"],
    ),
    "W_enc against cfg": (
        replace_tensor("W_enc", torch.zeros(32, 128)),
        ["W_enc is (32, 128)", "cfg.json says d_in=16, d_sae=64", "(d_in, d_sae) = (16, 64)"],
    ),
    "W_dec against W_enc": (
        replace_tensor("W_dec", torch.zeros(D_SAE, 8)),
        ["W_dec is (64, 8)", "d_sae=64, d_in=16", "(d_sae, d_in) = (64, 16)"],
    ),
    "b_dec against cfg": (
        replace_tensor("b_dec", torch.zeros(D_IN + 1)),
        ["b_dec is (17,)", "says d_in=16", "disagree"],
    ),
    "threshold's size": (
        replace_tensor("threshold", torch.zeros(D_SAE - 1), "jumprelu"),
        ["threshold is (63,)", "d_sae=64"],
    ),
    "d_in missing": (lambda folder: write_sae(folder, d_in=None), ["d_in=None", "positive"]),
    "jumprelu without threshold": (
        without_tensor("threshold", "jumprelu"),
        ["no threshold tensor", "jumprelu", "found: W_dec, W_enc, b_dec, b_enc"],
    ),
    "topk without k": (
        lambda folder: write_sae(folder, "topk", k=None),
        ["topk SAE needs k in 1..d_sae=64", "k=None"],
    ),
    "topk k=0": (lambda folder: write_sae(folder, "topk", k=0), ["k=0", "1..d_sae=64"]),
    "topk k>d_sae": (lambda folder: write_sae(folder, "topk", k=65), ["k=65", "1..d_sae=64"]),
    "normalize_activations": (
        lambda folder: write_sae(folder, normalize_activations="layer_norm"),
        ["normalize_activations='layer_norm' is not supported", "fold"],
    ),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_load_errors_name_the_bad_value_and_the_way_out(tmp_path, case):
    make, words = ERRORS[case]
    folder = tmp_path / "sae"
    make(folder)
    with pytest.raises(ConfigError) as caught:
        load_sae(folder)
    message = str(caught.value)
    assert str(folder) in message
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


def test_sae_is_a_plain_class_not_a_module(tmp_path):
    write_sae(tmp_path, "topk")
    sae = load_sae(str(tmp_path))
    assert isinstance(sae, SAE) and not isinstance(sae, torch.nn.Module)
    assert repr(sae) == f"SAE(topk, d_in=16, d_sae=64, path={str(tmp_path)!r})"
