"""probe.models.transcoder_files: transcoder sets written in each layout from hand-made tensors
load to the same values, and encode/decode equal the layout's formula written in numpy (float64)
from the raw file arrays; circuit-tracer's own loaders (where importable) read what
save_transcoders writes to the same outputs; bad sets are named."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.numpy import load_file as load_numpy
from safetensors.torch import save_file

from probe.errors import ConfigError
from probe.models.set_files import parse_hf_uri
from probe.models.transcoder import Transcoder, TranscoderSet
from probe.models.transcoder_files import check_transcoders, load_transcoders, save_transcoders

D, D_TC, LAYERS = 8, 24, 2


def tensors(seed: int, skip: bool = False, jump: bool = False) -> dict[str, torch.Tensor]:
    """One transcoder's tensors in probe's orientation, float64."""
    g = torch.Generator().manual_seed(seed)
    out = {
        "W_enc": torch.randn(D, D_TC, generator=g, dtype=torch.float64) * 0.5,
        "b_enc": torch.randn(D_TC, generator=g, dtype=torch.float64) * 0.2,
        "W_dec": torch.randn(D_TC, D, generator=g, dtype=torch.float64) * 0.5,
        "b_dec": torch.randn(D, generator=g, dtype=torch.float64) * 0.2,
    }
    if skip:
        out["W_skip"] = torch.randn(D, D, generator=g, dtype=torch.float64) * 0.3
    if jump:
        out["threshold"] = torch.rand(D_TC, generator=g, dtype=torch.float64) * 0.4
    return out


def a_set(activation: str = "relu", skip: bool = False, reads: str = "mlp_in") -> TranscoderSet:
    found = {}
    for layer in range(LAYERS):
        t = tensors(layer, skip=skip, jump=activation == "jumprelu")
        found[layer] = Transcoder(**t, layer=layer, activation=activation,
                                  k=5 if activation == "topk" else None)  # fmt: skip
    return TranscoderSet(found, reads=reads, model_name="tiny", ids={0: "a", 1: "b"})


def inputs(seed: int = 9) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(30, D))


def check_outputs(t: Transcoder, x: np.ndarray, acts: np.ndarray, out: np.ndarray) -> None:
    with torch.no_grad():
        xt = torch.from_numpy(x).to(t.W_enc.dtype)
        got_acts = t.encode(xt).double().numpy()
        got_out = t(xt).double().numpy()
    assert (acts > 0).any() and (acts == 0).any()  # some features on, some off
    np.testing.assert_allclose(got_acts, acts, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got_out, out, rtol=1e-12, atol=1e-12)


def ct_numpy(arrays: dict[str, np.ndarray], x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """circuit-tracer 0.5's SingleLayerTranscoder on its safetensors keys: F.linear(x, W_enc,
    b_enc), relu or x * (x > threshold), acts @ W_dec + b_dec + x @ W_skip.T."""
    pre = x @ arrays["W_enc"].T + arrays["b_enc"]
    thr = arrays.get("activation_function.threshold")
    acts = np.maximum(pre, 0) if thr is None else pre * (pre > thr)
    out = acts @ arrays["W_dec"] + arrays["b_dec"]
    if "W_skip" in arrays:
        out = out + x @ arrays["W_skip"].T
    return acts, out


@pytest.mark.parametrize(
    ("activation", "skip"), [("relu", True), ("relu", False), ("jumprelu", False)]
)
def test_relu_skip_round_trip(tmp_path, activation, skip):
    """save -> load gives the same tensors, and the file's arrays computed as circuit-tracer
    does give the loaded set's encode and forward."""
    tset = a_set(activation, skip)
    yaml_path = save_transcoders(tset, tmp_path / "set")
    config = yaml.safe_load(yaml_path.read_text())
    assert config["feature_input_hook"] == "mlp.hook_in"
    assert [e["filepath"] for e in config["transcoders"]] == [
        "layer_0.safetensors",
        "layer_1.safetensors",
    ]
    back = load_transcoders(tmp_path / "set")  # the folder
    assert back.reads == "mlp_in" and back.model_name == "tiny" and back.ids == {0: "a", 1: "b"}
    x = inputs()
    for layer in range(LAYERS):
        want, got = tset[layer], back[layer]
        for name in ("W_enc", "b_enc", "W_dec", "b_dec", "threshold", "W_skip"):
            a, b = getattr(want, name), getattr(got, name)
            assert (a is None) == (b is None), name
            if a is not None:
                assert torch.equal(a, b), name
        arrays = load_numpy(tmp_path / "set" / f"layer_{layer}.safetensors")
        assert arrays["W_enc"].shape == (D_TC, D) and arrays["W_dec"].shape == (D_TC, D)
        check_outputs(got, x, *ct_numpy(arrays, x))


def test_gemma_scope_npz_round_trip(tmp_path):
    tset = a_set("jumprelu", reads="resid_mid")
    save_transcoders(tset, tmp_path / "set", layout="gemma_scope")
    back = load_transcoders(tmp_path / "set" / "config.yaml")
    assert back.reads == "resid_mid"
    x = inputs()
    for layer in range(LAYERS):
        with np.load(tmp_path / "set" / f"layer_{layer}.npz") as npz:
            a = {k: npz[k] for k in npz.files}
        assert a["W_enc"].shape == (D, D_TC) and a["W_dec"].shape == (D_TC, D)
        pre = x @ a["W_enc"] + a["b_enc"]
        acts = pre * (pre > a["threshold"])
        check_outputs(back[layer], x, acts, acts @ a["W_dec"] + a["b_dec"])


def test_topk_round_trip_keeps_k(tmp_path):
    tset = a_set("topk")
    save_transcoders(tset, tmp_path / "set")
    back = load_transcoders(tmp_path / "set")
    x = inputs()
    arrays = load_numpy(tmp_path / "set" / "layer_1.safetensors")
    pre = x @ arrays["W_enc"].T + arrays["b_enc"]
    acts = np.zeros_like(pre)
    top = np.argsort(-pre, axis=1)[:, :5]
    np.put_along_axis(acts, top, np.maximum(np.take_along_axis(pre, top, 1), 0), 1)
    assert back[1].activation == "topk" and back[1].k == 5
    check_outputs(back[1], x, acts, acts @ arrays["W_dec"] + arrays["b_dec"])


def write_yaml(folder: Path, files, **changes) -> Path:
    config = {"model_name": "tiny", "feature_input_hook": "hook_resid_mid",
              "feature_output_hook": "mlp.hook_out",
              "transcoders": [{"id": f"t{i}", "layer": i, "filepath": f} for i, f in enumerate(files)]}  # fmt: skip
    config.update(changes)
    config = {k: v for k, v in config.items() if v is not None}
    path = folder / "set.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def ct_file(path: Path, seed: int, first_release: bool = False, jump: bool = False) -> dict:
    """A skip transcoder in circuit-tracer's safetensors layout, written by hand: W_enc (d_tc,
    d_in), W_dec (d_tc, d_out) (its first release: (d_out, d_tc)), W_skip (d_out, d_in)."""
    t = tensors(seed, skip=True, jump=jump)
    raw = {"W_enc": t["W_enc"].T, "W_dec": t["W_dec"].T if first_release else t["W_dec"],
           "b_enc": t["b_enc"], "b_dec": t["b_dec"], "W_skip": t["W_skip"]}  # fmt: skip
    if jump:
        raw["activation_function.threshold"] = t["threshold"]
    save_file({k: v.contiguous() for k, v in raw.items()}, path)
    arrays = {k: v.numpy() for k, v in raw.items()}
    if first_release:
        arrays["W_dec"] = arrays["W_dec"].T
    return arrays


def test_circuit_tracer_files_load_to_its_math(tmp_path):
    """Hand-written files of both circuit-tracer releases (W_dec either way round), named by a
    YAML of the first release (dicts), of 0.5 (bare paths) and by a cache folder (no list)."""
    a0 = ct_file(tmp_path / "layer_0.safetensors", 0, jump=True)
    a1 = ct_file(tmp_path / "layer_1.safetensors", 1, first_release=True)
    x = inputs()
    dicts = load_transcoders(
        write_yaml(tmp_path, ["layer_0.safetensors", str(tmp_path / "layer_1.safetensors")])
    )
    assert dicts.reads == "resid_mid" and dicts.ids == {0: "t0", 1: "t1"}
    paths = yaml.safe_dump({"model_kind": "transcoder_set", "feature_input_hook": "hook_resid_mid",
                            "feature_output_hook": "hook_mlp_out",
                            "transcoders": ["layer_0.safetensors", "layer_1.safetensors"]})  # fmt: skip
    (tmp_path / "paths").mkdir()
    (tmp_path / "paths" / "p.yaml").write_text(paths)
    for name in ("layer_0.safetensors", "layer_1.safetensors"):
        (tmp_path / "paths" / name).symlink_to(tmp_path / name)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "config.yaml").write_text(yaml.safe_dump({"model_kind": "transcoder_set",
        "feature_input_hook": "hook_resid_mid", "feature_output_hook": "hook_mlp_out"}))  # fmt: skip
    for name in ("layer_0.safetensors", "layer_1.safetensors"):
        (cache / name).symlink_to(tmp_path / name)
    for tset in (dicts, load_transcoders(tmp_path / "paths"), load_transcoders(cache)):
        assert tset[0].activation == "jumprelu" and tset[1].activation == "relu"
        for layer, arrays in ((0, a0), (1, a1)):
            check_outputs(tset[layer], x, *ct_numpy(arrays, x))


def test_gemma_scope_2_and_saelens_layouts(tmp_path):
    """Gemma Scope 2's lower-case keys (affine_skip_connection (d_in, d_out)) and SAELens's
    transcoder folders, each computed with its own formula (SAELens's JumpReLU: relu(pre) *
    (pre > threshold), also for a negative threshold)."""
    t = tensors(0, skip=True, jump=True)
    save_file({"w_enc": t["W_enc"], "w_dec": t["W_dec"], "b_enc": t["b_enc"], "b_dec": t["b_dec"],
               "threshold": t["threshold"], "affine_skip_connection": t["W_skip"].T.contiguous()},
              tmp_path / "gs2.safetensors")  # fmt: skip
    files = ["gs2.safetensors"]
    arch = ["jumprelu_transcoder", "skip_transcoder"]
    for i, a in enumerate(arch, start=1):
        u = tensors(i, skip=True, jump=True)
        u["threshold"] = u["threshold"] - 0.2  # some below 0
        keep = {"W_enc", "b_enc", "W_dec", "b_dec"} | {"jumprelu_transcoder": {"threshold"},
                                                      "skip_transcoder": {"W_skip"}}[a]  # fmt: skip
        folder = tmp_path / a
        folder.mkdir()
        (folder / "cfg.json").write_text(json.dumps({"architecture": a, "d_in": D, "d_sae": D_TC,
            "d_out": D, "hook_name": "blocks.0.ln2.hook_normalized"}))  # fmt: skip
        save_file({k: v for k, v in u.items() if k in keep}, folder / "sae_weights.safetensors")
        files.append(a)
    tset = load_transcoders(write_yaml(tmp_path, files))
    x = inputs()
    pre = x @ t["W_enc"].numpy() + t["b_enc"].numpy()
    acts = pre * (pre > t["threshold"].numpy())
    out = acts @ t["W_dec"].numpy() + t["b_dec"].numpy() + x @ t["W_skip"].numpy().T
    check_outputs(tset[0], x, acts, out)
    for layer, a in enumerate(arch, start=1):
        u = load_numpy(tmp_path / a / "sae_weights.safetensors")
        pre = x @ u["W_enc"] + u["b_enc"]
        acts = np.maximum(pre, 0)
        if "threshold" in u:
            acts = acts * (pre > u["threshold"])
        out = acts @ u["W_dec"] + u["b_dec"] + (x @ u["W_skip"].T if "W_skip" in u else 0)
        check_outputs(tset[layer], x, acts, out)


def test_hf_uris_parse_and_go_through_hf_hub_download(tmp_path, monkeypatch):
    assert parse_hf_uri("hf://mntss/skip-transcoder-Llama-3.2-1B-131k-nobos/layer_0.safetensors"
                        "?revision=new-training") == (
        "mntss/skip-transcoder-Llama-3.2-1B-131k-nobos", "layer_0.safetensors", "new-training")  # fmt: skip
    assert parse_hf_uri("hf://google/gemma-scope-2b-pt-transcoders/layer_0/width_16k/"
                        "average_l0_76/params.npz") == (
        "google/gemma-scope-2b-pt-transcoders", "layer_0/width_16k/average_l0_76/params.npz", None)  # fmt: skip
    for bad in ("hf://onlyrepo", "hf://org/repo", "s3://org/repo/file"):
        with pytest.raises(ConfigError, match="hf://ORG/REPO"):
            parse_hf_uri(bad)
    ct_file(tmp_path / "layer_0.safetensors", 0)
    asked = []

    def download(repo_id, filename, revision=None):
        asked.append((repo_id, filename, revision))
        return str(tmp_path / "layer_0.safetensors")

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    tset = load_transcoders(
        write_yaml(tmp_path, ["hf://org/repo/sub/layer_0.safetensors?revision=v1"])
    )
    assert asked == [("org/repo", "sub/layer_0.safetensors", "v1")] and len(tset) == 1


@pytest.fixture
def saved(tmp_path) -> Path:
    save_transcoders(a_set("relu", skip=True), tmp_path / "set")
    return tmp_path / "set"


def rewrite(saved: Path, layer: int, change) -> None:
    path = saved / f"layer_{layer}.safetensors"
    found = {k: v for k, v in load_numpy(path).items()}
    change(found)
    from safetensors.numpy import save_file as save_numpy

    save_numpy({k: np.ascontiguousarray(v) for k, v in found.items()}, path)


def test_bad_files_are_named(saved):
    rewrite(saved, 1, lambda f: f.pop("b_dec"))
    with pytest.raises(ConfigError, match=r"layer_1.safetensors \(relu_skip layout\) has no b_dec"):
        load_transcoders(saved)
    rewrite(saved, 1, lambda f: f.update(b_dec=np.zeros(D)))
    rewrite(saved, 0, lambda f: f.update(W_enc=f["W_enc"].T))  # stored (d_in, d_tc)
    with pytest.raises(ConfigError, match=r"W_enc has shape \(8, 24\), want \(d_tc, d_in\) = "
                       r"\(24, 8\): the file is transposed"):  # fmt: skip
        load_transcoders(saved)
    rewrite(saved, 0, lambda f: f.update(W_enc=f["W_enc"].T, W_skip=np.zeros((D, D + 1))))
    with pytest.raises(ConfigError, match=r"W_skip has shape \(8, 9\), want \(d_out, d_in\)"):
        load_transcoders(saved)


def test_bad_sets_are_named(saved):
    config = yaml.safe_load((saved / "config.yaml").read_text())
    (saved / "config.yaml").write_text(
        yaml.safe_dump({**config, "transcoders": config["transcoders"][1:]})
    )
    with pytest.raises(ConfigError, match=r"no transcoder for layer\(s\) \[0\]"):
        load_transcoders(saved)
    (saved / "config.yaml").write_text(
        yaml.safe_dump({**config, "feature_input_hook": "hook_resid_pre"})
    )
    with pytest.raises(ConfigError, match="feature_input_hook='hook_resid_pre'"):
        load_transcoders(saved)
    bad = [*config["transcoders"], {"id": "x", "layer": 1, "filepath": "layer_1.safetensors"}]
    (saved / "config.yaml").write_text(yaml.safe_dump({**config, "transcoders": bad}))
    with pytest.raises(ConfigError, match="two transcoders for layer 1"):
        load_transcoders(saved)
    gone = [*config["transcoders"][:1], {"id": "x", "layer": 1, "filepath": "nowhere.safetensors"}]
    (saved / "config.yaml").write_text(yaml.safe_dump({**config, "transcoders": gone}))
    with pytest.raises(ConfigError, match="no transcoder file at .*nowhere.safetensors"):
        load_transcoders(saved)
    with pytest.raises(ConfigError, match="no transcoder set at"):
        load_transcoders(saved / "absent")


def test_check_against_the_model(saved):
    from transformers import GPT2Config

    tset = load_transcoders(saved)
    check_transcoders(tset, GPT2Config(n_embd=D, n_layer=LAYERS, n_head=2))
    with pytest.raises(ConfigError, match=r"reads d_in=8 and writes d_out=8 .* has hidden size 16"):
        check_transcoders(tset, GPT2Config(n_embd=16, n_layer=LAYERS, n_head=2))
    with pytest.raises(ConfigError, match=r"has 2 transcoders \(layers 0..1\) but .* has 3 blocks"):
        check_transcoders(tset, GPT2Config(n_embd=D, n_layer=3, n_head=2))


def test_circuit_tracer_reads_what_save_transcoders_writes(tmp_path):
    """circuit-tracer 0.5's own loaders (load_relu_transcoder, load_gemma_scope_transcoder) on
    the saved files give the set's encode and forward."""
    from probe.testing.peers import circuit_tracer_source

    circuit_tracer_source()  # (on sys.path where .ci/run unpacked it)
    pytest.importorskip("circuit_tracer")
    from circuit_tracer.transcoder.single_layer_transcoder import (
        load_gemma_scope_transcoder,
        load_relu_transcoder,
    )

    x = torch.from_numpy(inputs())
    for activation, layout, loader in (("relu", "relu_skip", load_relu_transcoder),
                                       ("jumprelu", "relu_skip", load_relu_transcoder),
                                       ("jumprelu", "gemma_scope", load_gemma_scope_transcoder)):  # fmt: skip
        tset = a_set(activation, skip=layout == "relu_skip")
        save_transcoders(tset, tmp_path / layout / activation, layout=layout)
        suffix = "npz" if layout == "gemma_scope" else "safetensors"
        for layer in range(LAYERS):
            file = str(tmp_path / layout / activation / f"layer_{layer}.{suffix}")
            kw = {} if layout == "gemma_scope" else {"lazy_encoder": False, "lazy_decoder": False}
            theirs = loader(file, layer, device=torch.device("cpu"), dtype=torch.float64, **kw)
            with torch.no_grad():
                np.testing.assert_allclose(
                    theirs.encode(x), tset[layer].encode(x), rtol=1e-12, atol=1e-12
                )
                np.testing.assert_allclose(theirs(x), tset[layer](x), rtol=1e-12, atol=1e-12)


def test_each_reading_place_round_trips_under_transformer_lens_hook_name(tmp_path):
    """ln2.hook_normalized is the norm's output before its weight and bias (mlp_normalized),
    mlp.hook_in the MLP's input (mlp_in), hook_resid_mid the norm's input (resid_mid)."""
    hooks = {"mlp_normalized": "ln2.hook_normalized", "mlp_in": "mlp.hook_in",
             "resid_mid": "hook_resid_mid"}  # fmt: skip
    for reads, hook in hooks.items():
        path = save_transcoders(a_set(reads=reads), tmp_path / reads)
        assert yaml.safe_load(path.read_text())["feature_input_hook"] == hook
        assert load_transcoders(path).reads == reads
