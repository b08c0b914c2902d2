"""python -m probe.fit RUN --kind clt: a cross-layer transcoder trained on a tiny GPT-2's captured
MLP inputs and outputs explains most of each layer's held-out variance; fit.csv's FVU, L0 and
dead share equal a plain-torch recomputation from the written files (circuit-tracer's CLT
layout, read here with safetensors alone); its loss columns equal plain forward hooks that splice
the files' CLT into transformers' model by hand; bad input exits 2 by name."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file

import probe
from probe.analysis.fit import clt as clt_fit
from probe.analysis.fit.fit_sites import held_out
from probe.fit import main

WIDTH, LAYERS = 32, 2  # the tiny GPT-2's hidden size and blocks
FAST = ["--width", "128", "--batch-size", "256", "--lr", "3e-3"]


def recompute(run_dir, out, test_fraction=0.1, seed=0) -> pd.DataFrame:
    """Per layer over the held-out rows but those of position 0 and of the tokenizer's special
    tokens, float64, from the files' tensors: acts_l of layer l's
    MLP input (W_enc_l (d_tc, d_in), b_enc_l, threshold_l or config.yaml's k), out_l' = sum over
    l <= l' of acts_l W_dec_l[:, l' - l] + b_dec_l'; FVU of out_l', L0 and dead of acts_l."""
    from transformers import AutoTokenizer

    config = yaml.safe_load((out / "config.yaml").read_text())
    enc = [load_file(out / f"W_enc_{i}.safetensors") for i in range(LAYERS)]
    dec = [load_file(out / f"W_dec_{i}.safetensors")[f"W_dec_{i}"].double() for i in range(LAYERS)]
    with probe.open_run(run_dir) as run:
        tokens = run.tokens()
        held = held_out(tokens["sample"].to_numpy(), run.num_samples, test_fraction, seed)
        specials = AutoTokenizer.from_pretrained(run.config["model"]["name"]).all_special_ids
        special = (tokens["position"] == 0) | tokens["id"].isin(specials)
        assert 0 < special.sum() < len(tokens) and (tokens["position"] > 0)[special].any()
        held &= ~special.to_numpy()
        acts, ys = [], []
        for i in range(LAYERS):
            x = torch.from_numpy(run.array(f"transformer.h.{i}.mlp", "input")[:][held]).double()
            ys.append(torch.from_numpy(run.array(f"transformer.h.{i}.mlp", "output")[:][held]).double())  # fmt: skip
            pre = x @ enc[i][f"W_enc_{i}"].double().T + enc[i][f"b_enc_{i}"].double()
            if f"threshold_{i}" in enc[i]:
                acts.append(pre * (pre > enc[i][f"threshold_{i}"].double()))
            else:
                top = pre.topk(config["k"], dim=1)
                acts.append(torch.zeros_like(pre).scatter(1, top.indices, top.values.clamp_min(0)))
    rows = []
    for t in range(LAYERS):
        pred = enc[t][f"b_dec_{t}"].double() + sum(acts[s] @ dec[s][:, t - s] for s in range(t + 1))
        y = ys[t]
        rows.append({"layer": t, "fvu": float((y - pred).pow(2).sum() / (y - y.mean(0)).pow(2).sum()),
                     "l0": float((acts[t] != 0).sum(1).double().mean()),
                     "dead": float(((acts[t] != 0).sum(0) == 0).double().mean()),
                     "held_out_rows": int(held.sum()), "left_out_rows": int(special.sum())})  # fmt: skip
    return pd.DataFrame(rows)


@pytest.mark.parametrize("activation", ["jumprelu", "topk"])
def test_a_fitted_clt_explains_every_layer_and_fit_csv_is_what_the_files_give(lm_run, tmp_path, activation):  # fmt: skip
    out = tmp_path / activation
    extra = ["--k", "8"] if activation == "topk" else ["--sparsity", "1e-3"]
    args = [str(lm_run), "--kind", "clt", "--activation", activation, "--steps", "100"]
    assert main([*args, "--out", str(out), *FAST, *extra]) == 0
    table = pd.read_csv(out / "fit.csv")
    assert table["layer"].astype(str).tolist() == ["0", "1", "all"]
    assert (table["kind"] == "clt").all()
    fit = table.iloc[:LAYERS].reset_index(drop=True)
    assert (fit["fvu"] < 0.5).all(), fit  # predicting the mean: 1.0
    again = recompute(lm_run, out)
    np.testing.assert_allclose(fit["fvu"], again["fvu"], rtol=1e-6)
    np.testing.assert_allclose(fit["l0"], again["l0"], rtol=1e-9)
    np.testing.assert_allclose(fit["dead"], again["dead"], atol=1e-12)
    assert fit["held_out_rows"].tolist() == again["held_out_rows"].tolist()
    assert fit["left_out_rows"].tolist() == again["left_out_rows"].tolist()
    clt = probe.models.transcoder_files.load_transcoders(out)
    assert len(clt) == LAYERS and clt.d_tc == 128 and clt.activation == activation
    if activation == "topk":
        check_losses(lm_run, out, table)
        csv = tmp_path / "evaluated.csv"  # --evaluate of the written CLT: fit.csv's numbers
        assert main(["--evaluate", str(out), str(lm_run), "--out", str(csv)]) == 0
        got = pd.read_csv(csv)
        same = [c for c in got.columns if c in table.columns]
        assert len(same) == 15, same
        pd.testing.assert_frame_equal(got[same], table[same], rtol=1e-9)


def hand_ce(model, ids, out, replaced: list[int], zero: bool = False) -> tuple[float, float]:
    """(mean next-token CE, mean KL(clean || spliced)) with the MLP outputs of `replaced`
    swapped by plain forward hooks for what the CLT in `out` writes there (b_dec, and every
    block s <= l's features of its own MLP input through W_dec_s[:, l - s]), or for zeros."""
    config = yaml.safe_load((out / "config.yaml").read_text())
    enc = [load_file(out / f"W_enc_{i}.safetensors") for i in range(LAYERS)]
    dec = [load_file(out / f"W_dec_{i}.safetensors")[f"W_dec_{i}"] for i in range(LAYERS)]
    blocks, seen, handles = model.transformer.h, {}, []

    def acts(i):
        pre = seen[i] @ enc[i][f"W_enc_{i}"].T + enc[i][f"b_enc_{i}"]
        top = pre.topk(config["k"], dim=-1)
        return torch.zeros_like(pre).scatter(-1, top.indices, top.values.clamp_min(0))

    def swap(layer):
        def hook(module, args, output):
            if zero:
                return torch.zeros_like(output)
            new = enc[layer][f"b_dec_{layer}"]
            return new + sum(acts(s) @ dec[s][:, layer - s] for s in range(layer + 1))

        return hook

    for i in range(LAYERS):
        handles.append(blocks[i].mlp.register_forward_pre_hook(
            lambda m, a, i=i: seen.__setitem__(i, a[0])))  # fmt: skip
    handles += [blocks[layer].mlp.register_forward_hook(swap(layer)) for layer in replaced]
    try:
        with torch.no_grad():
            spliced = model(ids).logits[:, :-1].double()
    finally:
        for h in handles:
            h.remove()
    with torch.no_grad():
        clean = model(ids).logits[:, :-1].double()
    vocab = clean.shape[-1]
    ce = F.cross_entropy(spliced.reshape(-1, vocab), ids[:, 1:].reshape(-1))
    kl = F.kl_div(spliced.reshape(-1, vocab).log_softmax(-1),
                  clean.reshape(-1, vocab).log_softmax(-1), log_target=True,
                  reduction="batchmean")  # fmt: skip
    return float(ce), float(kl)


def check_losses(run_dir, out, table: pd.DataFrame) -> None:
    """fit.csv's loss columns (each layer replaced alone, and `all`) against hand_ce over the
    held-out samples that held_out.csv lists."""
    from transformers import AutoModelForCausalLM

    with probe.open_run(run_dir) as run:
        tokens = run.tokens()
        samples = np.unique(tokens["sample"])
        held = samples[held_out(samples, run.num_samples, 0.1, 0)]
        rows = tokens[tokens["sample"].isin(held)].sort_values(["sample", "position"])
        model = AutoModelForCausalLM.from_pretrained(run.config["model"]["name"]).float().eval()
    assert pd.read_csv(out / "held_out.csv")["sample"].tolist() == held.tolist()
    ids = torch.from_numpy(rows["id"].to_numpy().copy().reshape(len(held), -1))
    ce_clean, _ = hand_ce(model, ids, out, [])
    for key, layers in (("0", [0]), ("1", [1]), ("all", [0, 1])):
        row = table[table["layer"].astype(str) == key].iloc[0]
        ce_spliced, kl = hand_ce(model, ids, out, layers)
        ce_zero, _ = hand_ce(model, ids, out, layers, zero=True)
        np.testing.assert_allclose(row["ce_clean"], ce_clean, rtol=1e-9)
        np.testing.assert_allclose(row["ce_spliced"], ce_spliced, rtol=1e-6)
        np.testing.assert_allclose(row["kl"], kl, rtol=1e-4, atol=1e-10)
        np.testing.assert_allclose(row["ce_zero"], ce_zero, rtol=1e-7)
        recovered = (ce_zero - ce_spliced) / (ce_zero - ce_clean)
        np.testing.assert_allclose(row["ce_recovered"], recovered, rtol=1e-5)
        assert kl > 0 and ce_zero != ce_clean  # the splice and the ablation change the model


def test_a_resumed_clt_fit_gives_the_uninterrupted_files(lm_run, tmp_path, monkeypatch, capsys):
    args = [str(lm_run), "--kind", "clt", "--activation", "topk", "--k", "8", "--steps", "30",
            "--checkpoint-every", "10", "--no-losses", *FAST]  # fmt: skip
    assert main([*args, "--out", str(tmp_path / "whole")]) == 0
    calls, real = {"n": 0}, clt_fit.TrainingCLT.after_step

    def dies(self):
        calls["n"] += 1
        if calls["n"] == 25:  # the 25th step, in the second epoch: its checkpoint is step 20's
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(clt_fit.TrainingCLT, "after_step", dies)
    with pytest.raises(KeyboardInterrupt):
        main([*args, "--out", str(tmp_path / "cut")])
    monkeypatch.setattr(clt_fit.TrainingCLT, "after_step", real)
    assert torch.load(tmp_path / "cut" / "checkpoint.pt", weights_only=False)["step"] == 20
    assert main([*args, "--out", str(tmp_path / "cut")]) == 2  # not without --resume
    assert "already holds a fit: --resume continues it" in capsys.readouterr().err
    assert main([*args, "--out", str(tmp_path / "cut"), "--resume"]) == 0
    for name in ("W_enc_0", "W_enc_1", "W_dec_0", "W_dec_1"):
        whole, cut = (tmp_path / d / f"{name}.safetensors" for d in ("whole", "cut"))
        assert whole.read_bytes() == cut.read_bytes(), name
    whole, cut = (
        pd.read_csv(tmp_path / d / "fit.csv").drop(columns="seconds") for d in ("whole", "cut")
    )
    pd.testing.assert_frame_equal(whole, cut)
    assert main([*args, "--out", str(tmp_path / "cut"), "--resume", "--lr", "1e-2"]) == 2
    assert "other options than checkpoint.pt was fitted with: lr=0.003 (now 0.01)" in (
        capsys.readouterr().err
    )
    assert main([*args, "--out", str(tmp_path / "none"), "--resume"]) == 2
    assert "holds no CLT fit (checkpoint.pt) to continue" in capsys.readouterr().err


def test_bad_clt_input_exits_2_by_name(lm_run, tmp_path, capsys, monkeypatch):
    def refused(*args) -> str:
        assert main([str(lm_run), "--kind", "clt", "--out", str(tmp_path / "bad"), *args]) == 2
        return capsys.readouterr().err

    assert "--kind 'xlt'; choose plt" in refused("--kind", "xlt")
    assert "--layers [1] with --kind clt" in refused("--layers", "1")
    assert "--skip with --kind clt" in refused("--skip")
    assert "--activation batchtopk with --kind clt: a CLT trains relu, jumprelu, topk" in refused(
        "--activation", "batchtopk"
    )
    assert "the run holds no mlp_in pairs" in refused("--mlp", "attn")
    found = clt_fit.find_sites
    monkeypatch.setattr(clt_fit, "find_sites", lambda *a: {1: found(*a)[1]})  # block 0 missing
    err = refused()
    assert "no MLP input and MLP output rows of block(s) [0]: run with probes=mlp_io" in err
