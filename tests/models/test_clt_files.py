"""Cross-layer transcoders on disk (probe.models.clt_files): circuit-tracer 0.5's CLT files and
Gemma Scope 2's, written here from hand-made arrays, load through load_transcoders to a CLT whose
outputs equal the layout's formula in numpy (float64); what save_cross_layer writes loads back
the same and circuit-tracer's own load_clt reads it to the same outputs; bad files and CLTs that
do not fit the model are named."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml
from safetensors.numpy import save_file

from probe.errors import ConfigError
from probe.models.clt_files import save_cross_layer
from probe.models.cross_layer_transcoder import CrossLayerTranscoder
from probe.models.transcoder_files import check_transcoders, load_transcoders
from probe.testing.random_transcoders import random_cross_layer

D, D_TC, LAYERS = 8, 12, 3


def arrays(seed: int = 0, jump: bool = False) -> dict[str, np.ndarray]:
    """A CLT's arrays in circuit-tracer's file orientation, float64: per layer l, W_enc_l (d_tc,
    d_in), b_enc_l, b_dec_l, threshold_l and W_dec_l (d_tc, n_layers - l, d_out)."""
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(LAYERS):
        out[f"W_enc_{i}"] = rng.normal(size=(D_TC, D)) * 0.5
        out[f"b_enc_{i}"] = rng.normal(size=D_TC) * 0.2
        out[f"b_dec_{i}"] = rng.normal(size=D) * 0.2
        out[f"W_dec_{i}"] = rng.normal(size=(D_TC, LAYERS - i, D)) * 0.5
        if jump:
            out[f"threshold_{i}"] = rng.uniform(0, 0.4, size=D_TC)
    return out


def write_ct(folder, a: dict[str, np.ndarray], hook: str = "hook_resid_mid") -> None:
    """circuit-tracer's CLT folder: W_enc_<l> and W_dec_<l> files, config.yaml."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(LAYERS):
        enc = {
            k: a[k] for k in (f"W_enc_{i}", f"b_enc_{i}", f"b_dec_{i}", f"threshold_{i}") if k in a
        }
        save_file(enc, str(folder / f"W_enc_{i}.safetensors"))
        save_file({f"W_dec_{i}": a[f"W_dec_{i}"]}, str(folder / f"W_dec_{i}.safetensors"))
    config = {"model_kind": "cross_layer_transcoder", "feature_input_hook": hook,
              "feature_output_hook": "hook_mlp_out", "scan": "hand-made"}  # fmt: skip
    (folder / "config.yaml").write_text(yaml.safe_dump(config))


def numpy_clt(a: dict[str, np.ndarray], xs: list[np.ndarray], skip=None):
    """circuit-tracer's CLT on its file arrays: acts_l = relu or jumprelu of x_l W_enc_l^T +
    b_enc_l; out_l' = sum over l <= l' of acts_l W_dec_l[:, l' - l] + b_dec_l' (+ x_l' skip_l')."""
    acts = []
    for i, x in enumerate(xs):
        pre = x @ a[f"W_enc_{i}"].T + a[f"b_enc_{i}"]
        thr = a.get(f"threshold_{i}")
        acts.append(np.maximum(pre, 0) if thr is None else pre * (pre > thr))
    outs = []
    for t in range(LAYERS):
        out = a[f"b_dec_{t}"] + sum(acts[s] @ a[f"W_dec_{s}"][:, t - s] for s in range(t + 1))
        outs.append(out + (xs[t] @ skip[t] if skip is not None else 0))
    return acts, outs


def inputs(seed: int = 9) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(20, D)) for _ in range(LAYERS)]


def check(clt: CrossLayerTranscoder, xs, acts, outs) -> None:
    with torch.no_grad():
        xt = [torch.from_numpy(x) for x in xs]
        got = clt(xt)
        for i in range(LAYERS):
            a = clt.encode(i, xt[i]).double().numpy()
            assert (acts[i] > 0).any() and (acts[i] == 0).any()  # some features on, some off
            np.testing.assert_allclose(a, acts[i], rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(got[i].double().numpy(), outs[i], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("jump", [False, True])
def test_circuit_tracer_clt_files_load_to_its_formula_and_save_back(tmp_path, jump):
    a = arrays(jump=jump)
    write_ct(tmp_path / "ct", a)
    clt = load_transcoders(tmp_path / "ct")
    assert isinstance(clt, CrossLayerTranscoder)
    assert (clt.reads, clt.activation, clt.scan) == ("resid_mid", "jumprelu" if jump else "relu", "hand-made")  # fmt: skip
    xs = inputs()
    check(clt, xs, *numpy_clt(a, xs))
    save_cross_layer(clt, tmp_path / "again")
    check(load_transcoders(tmp_path / "again" / "config.yaml"), xs, *numpy_clt(a, xs))


def test_topk_round_trips_with_its_k(tmp_path):
    clt = random_cross_layer(D, LAYERS, activation="topk", reads="mlp_in", dtype=torch.float64)
    path = save_cross_layer(clt, tmp_path / "topk")
    assert yaml.safe_load(path.read_text())["feature_input_hook"] == "mlp.hook_in"
    back = load_transcoders(path)
    assert (back.activation, back.k, back.reads) == ("topk", 12, "mlp_in")
    x = [torch.randn(6, D, dtype=torch.float64) for _ in range(LAYERS)]
    with torch.no_grad():
        for mine, theirs in zip(clt(x), back(x), strict=True):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
        assert (clt.encode(0, x[0]) != 0).sum(-1).max() <= 12


def test_gemma_scope_2_clt_files(tmp_path):
    """Gemma Scope 2: one file per layer, w_dec (d_tc, n_layers, d_out) with the slots before
    the layer unused, affine_skip_connection (d_in, d_out) applied as x @ skip."""
    a = arrays(1, jump=True)
    rng = np.random.default_rng(3)
    skips = [rng.normal(size=(D, D)) * 0.3 for _ in range(LAYERS)]
    files = []
    for i in range(LAYERS):
        w_dec = np.concatenate([rng.normal(size=(D_TC, i, D)), a[f"W_dec_{i}"]], axis=1)
        save_file({"w_enc": a[f"W_enc_{i}"].T.copy(), "w_dec": w_dec, "b_enc": a[f"b_enc_{i}"],
                   "b_dec": a[f"b_dec_{i}"], "threshold": a[f"threshold_{i}"],
                   "affine_skip_connection": skips[i]}, str(tmp_path / f"clt_{i}.safetensors"))  # fmt: skip
        files.append(f"clt_{i}.safetensors")
    config = {"model_kind": "cross_layer_transcoder", "feature_input_hook": "ln2.hook_normalized",
              "feature_output_hook": "hook_mlp_out", "transcoders": files}  # fmt: skip
    (tmp_path / "gs2.yaml").write_text(yaml.safe_dump(config))
    clt = load_transcoders(tmp_path / "gs2.yaml")
    assert clt.reads == "mlp_normalized" and clt.W_skip is not None
    xs = inputs()
    check(clt, xs, *numpy_clt(a, xs, skip=skips))
    with pytest.raises(ConfigError, match="no skip matrix"):
        save_cross_layer(clt, tmp_path / "out")


def test_circuit_tracer_load_clt_reads_what_save_cross_layer_writes(tmp_path):
    from probe.testing.peers import circuit_tracer_source

    if circuit_tracer_source() is None:
        pytest.skip("circuit-tracer's source is not unpacked at $PROBE_CIRCUIT_TRACER_SRC")
    from circuit_tracer.transcoder.cross_layer_transcoder import load_clt

    for activation in ("relu", "jumprelu"):
        clt = random_cross_layer(D, LAYERS, activation=activation, dtype=torch.float64)
        folder = tmp_path / activation
        save_cross_layer(clt, folder)
        theirs = load_clt(str(folder), device=torch.device("cpu"), dtype=torch.float64,
                          lazy_decoder=False)  # fmt: skip
        x = torch.randn(LAYERS, 10, D, dtype=torch.float64)
        with torch.no_grad():
            acts = theirs.encode(x)
            assert (acts > 0).any() and (acts == 0).any()
            for layer in range(LAYERS):
                torch.testing.assert_close(acts[layer], clt.encode(layer, x[layer]), rtol=1e-12, atol=1e-12)  # fmt: skip
            torch.testing.assert_close(theirs(x), torch.stack(clt(list(x))), rtol=1e-12, atol=1e-12)  # fmt: skip


def test_bad_clt_files_are_named(tmp_path):
    a = arrays()
    write_ct(tmp_path / "ok", a)
    (tmp_path / "ok" / "W_dec_1.safetensors").unlink()
    with pytest.raises(ConfigError, match="no CLT file at .*W_dec_1.safetensors"):
        load_transcoders(tmp_path / "ok")
    bad = dict(a, W_dec_2=a["W_dec_2"][:, :, :5])
    write_ct(tmp_path / "shape", bad)
    with pytest.raises(ConfigError, match=r"W_dec_2 has shape \(12, 1, 5\), want \(12, 1, 8\)"):
        load_transcoders(tmp_path / "shape")
    write_ct(tmp_path / "gap", a)
    (tmp_path / "gap" / "W_enc_1.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"no W_enc file for layer\(s\) \[1\]"):
        load_transcoders(tmp_path / "gap")
    write_ct(tmp_path / "kind", a)
    config = yaml.safe_load((tmp_path / "kind" / "config.yaml").read_text())
    (tmp_path / "kind" / "config.yaml").write_text(yaml.safe_dump(config | {"model_kind": "sae"}))
    with pytest.raises(ConfigError, match="model_kind='sae'"):
        load_transcoders(tmp_path / "kind")


def test_a_clt_that_does_not_fit_the_model_is_named(tmp_path):
    from transformers import GPT2Config

    write_ct(tmp_path / "ct", arrays())
    clt = load_transcoders(tmp_path / "ct")
    check_transcoders(clt, GPT2Config(n_embd=D, n_layer=LAYERS, n_head=2))
    with pytest.raises(ConfigError, match=r"reads d_in=8 and writes d_out=8 .* hidden size 16"):
        check_transcoders(clt, GPT2Config(n_embd=16, n_layer=LAYERS, n_head=2))
    with pytest.raises(ConfigError, match=r"has 3 layers but .* has 4 blocks"):
        check_transcoders(clt, GPT2Config(n_embd=D, n_layer=4, n_head=2))
    with pytest.raises(ConfigError, match=r"W_dec\[0\] has shape \(12, 1, 8\), want \(12, 3, 8\)"):
        CrossLayerTranscoder(clt.W_enc.data, clt.b_enc.data,
                             [w.data[:, :1] for w in clt.W_dec], clt.b_dec.data)  # fmt: skip
