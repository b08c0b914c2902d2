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
    extra = ["--k", "8"] if activation == "topk" else ["--l0-target", "8"]
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
    """A topk CLT fit killed at its 25th step of 30 and resumed from its 20th step's checkpoint
    equals the fit never stopped, file for file, with the schedule (a warm-up over 9 steps, a
    decay over the last 6, crossed by the cut) and AuxK (k 1: features idle for a batch count
    dead) in play."""
    from probe.analysis.fit.trainer_base import ramp

    args = [str(lm_run), "--kind", "clt", "--activation", "topk", "--k", "1", "--steps", "30",
            "--checkpoint-every", "10", "--no-losses", "--lr-warmup", "0.3", "--dead-rows", "1",
            *FAST]  # fmt: skip
    assert main([*args, "--out", str(tmp_path / "whole")]) == 0
    calls, real = {"n": 0}, clt_fit.TrainingCLT.after_step

    def dies(self, rows):
        calls["n"] += 1
        if calls["n"] == 25:  # the 25th step, in the second epoch: its checkpoint is step 20's
            raise KeyboardInterrupt
        return real(self, rows)

    monkeypatch.setattr(clt_fit.TrainingCLT, "after_step", dies)
    with pytest.raises(KeyboardInterrupt):
        main([*args, "--out", str(tmp_path / "cut")])
    monkeypatch.setattr(clt_fit.TrainingCLT, "after_step", real)
    state = torch.load(tmp_path / "cut" / "checkpoint.pt", weights_only=False)
    assert state["step"] == 20 and int(state["model"]["step"]) == 20
    assert (state["model"]["since_fired"] > 1).any()  # AuxK has dead features to revive
    group = state["optimizer"]["param_groups"][0]  # the learning rate of step 20 (index 19)
    assert np.isclose(group["lr"], 3e-3 * ramp(19, 30, 0.3, 0.2)) and group["initial_lr"] == 3e-3
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
    whole, cut = (pd.read_csv(tmp_path / d / "fit_curve.csv") for d in ("whole", "cut"))
    pd.testing.assert_frame_equal(whole, cut)
    assert main([*args, "--out", str(tmp_path / "cut"), "--resume", "--lr", "1e-2"]) == 2
    assert "other options than checkpoint.pt was fitted with: lr=0.003 (now 0.01)" in (
        capsys.readouterr().err
    )
    assert main([*args, "--out", str(tmp_path / "none"), "--resume"]) == 2
    assert "holds no CLT fit (checkpoint.pt) to continue" in capsys.readouterr().err
    del state["loss_form"]  # a checkpoint of the trainer before the per-layer penalties
    torch.save(state, tmp_path / "cut" / "checkpoint.pt")
    assert main([*args, "--out", str(tmp_path / "cut"), "--resume"]) == 2
    assert "trained under another form of the loss (1; this version's is 2)" in (
        capsys.readouterr().err
    )


def test_bad_clt_input_exits_2_by_name(lm_run, tmp_path, capsys, monkeypatch):
    def refused(*args) -> str:
        assert main([str(lm_run), "--kind", "clt", "--out", str(tmp_path / "bad"), *args]) == 2
        return capsys.readouterr().err

    assert "--kind 'xlt'; choose plt" in refused("--kind", "xlt")
    assert "--layers [1] with --kind clt" in refused("--layers", "1")
    assert "--skip with --kind clt" in refused("--skip")
    assert "--activation 'gelu'; choose relu, jumprelu, topk, batchtopk" in refused(
        "--activation", "gelu"
    )
    assert "the run holds no mlp_in pairs" in refused("--mlp", "attn")
    jumprelu = ["--activation", "jumprelu"]  # an L0 target per encoder layer, at most its width
    assert "--l0-target 200.5 (jumprelu's L0 target) is above --width 128: give --l0-target <= 128" in refused(*jumprelu, "--l0-target", "200.5", "--width", "128")  # fmt: skip
    assert (
        "--k 300 (jumprelu's L0 target) is above the default width 256 (8 x the input's 32): give "
        "--k <= 256, or a --width of 300 or more" in refused(*jumprelu, "--k", "300")
    )
    topk = ["--activation", "topk"]
    assert "--k 200 is above --width 128: give --k <= 128" in refused(*topk, "--k", "200", "--width", "128")  # fmt: skip
    assert (  # no --width: 8 x the run's d_model, 32
        "--k 300 is above the default width 256 (8 x the input's 32): give --k <= 256, or a "
        "--width of 300 or more" in refused("--activation", "batchtopk", "--k", "300")
    )
    assert not (tmp_path / "bad").exists()
    found = clt_fit.find_sites
    monkeypatch.setattr(clt_fit, "find_sites", lambda *a: {1: found(*a)[1]})  # block 0 missing
    err = refused()
    assert "no MLP input and MLP output rows of block(s) [0]: run with probes=mlp_io" in err


def test_a_jumprelu_clt_starts_from_zero_decoders_and_the_default_threshold():
    """A default jumprelu CLT starts as the per-layer trainer does: W_dec 0 for every source
    layer, W_enc uniform in +-1/sqrt(d_in) (its spread that of the uniform, 1/sqrt(3 d_in)),
    b_enc 0 and thresholds exp(log_threshold) = FitOptions.threshold, 0.001."""
    from probe.analysis.fit.options import FitOptions

    n, d, width = 3, 6, 40
    model = clt_fit.TrainingCLT(n, d, d, FitOptions(activation="jumprelu", width=width), seed=0)
    assert len(model.W_dec) == n and all((w == 0).all() for w in model.W_dec)
    assert [tuple(w.shape) for w in model.W_dec] == [(width, n - s, d) for s in range(n)]
    assert model.W_enc.shape == (n, d, width) and model.W_enc.abs().max() <= d**-0.5
    np.testing.assert_allclose(float(model.W_enc.detach().std()), (3 * d) ** -0.5, rtol=0.1)
    assert (model.b_enc == 0).all()
    assert FitOptions().threshold == 0.001
    torch.testing.assert_close(model.log_threshold.exp(), torch.full((n, width), 0.001))


def _hand_codes(pre: torch.Tensor, activation: str, k: int) -> torch.Tensor:
    """topk: each row's k largest pre-activations; batchtopk: the batch's k x rows largest
    (ReLU'd; the rest 0), densely."""
    if activation == "topk":
        top = pre.topk(k, dim=1)
        return torch.zeros_like(pre).scatter(1, top.indices, top.values.clamp_min(0))
    top = pre.flatten().topk(k * len(pre))
    return torch.zeros(pre.numel()).scatter(0, top.indices, top.values.clamp_min(0)).view_as(pre)


@pytest.mark.parametrize("activation", ["topk", "batchtopk"])
def test_a_clts_loss_with_auxk_and_its_schedule_are_the_hand_computation(activation):
    """Three train_steps of a 2-layer CLT equal a hand loop: rows centred and scaled per site by
    the first batch's spread; W_dec 0 and W_enc uniform in +-1/sqrt(d_in) at the start; loss =
    sum over output layers of the MSE + 1/32 x AuxK, where each source layer's dead features
    (counted per feature over rows) take each row's top aux_k among them and fit the detached
    errors of every layer they write to through their whole decoders (squared error over the
    errors' variance x min(dead / aux_k, 1)), computed densely; Adam at the warmed-up and
    decayed learning rate; dead counters and batchtopk's per-layer thresholds moved on; the
    saved CLT computes the same on raw rows."""
    from probe.analysis.fit.options import FitOptions
    from probe.analysis.fit.trainer_base import train_step

    n, d, width, k, aux_k, rows = 2, 5, 12, 3, 4, 40
    g = torch.Generator().manual_seed(4)
    batches = [([torch.randn(rows, d, generator=g) + 1 for _ in range(n)],
                [torch.randn(rows, d, generator=g) * 2 - 1 for _ in range(n)])
               for _ in range(3)]  # fmt: skip
    options = FitOptions(activation=activation, width=width, k=k, aux_k=aux_k, dead_rows=100,
                         lr=1e-2, lr_warmup=0.4, lr_decay=0.4)  # fmt: skip
    model = clt_fit.TrainingCLT(n, d, d, options, seed=0, total_steps=3)
    model.start(*batches[0])
    dead = [torch.tensor([0, 3, 5, 7, 11]), torch.tensor([2, 4])]  # 5 >= aux_k and 2 < aux_k
    for layer, features in enumerate(dead):
        model.since_fired[layer, features] = 101
    model.since_fired[0, 1] = 100  # not yet dead
    hand = {name: p.detach().clone().requires_grad_() for name, p in model.named_parameters()}
    assert all(not hand[f"W_dec.{i}"].any() for i in range(n))
    assert hand["W_enc"].abs().max() <= d**-0.5 and hand["W_enc"].std() > 0.5 * (3 * d) ** -0.5
    x0, y0 = batches[0]
    a = [(d / (x - x.mean(0)).pow(2).sum(1).mean()) ** 0.5 for x in x0]
    c = [(d / (y - y.mean(0)).pow(2).sum(1).mean()) ** 0.5 for y in y0]
    means = [a[i] * x0[i].mean(0) for i in range(n)]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    hand_opt = torch.optim.Adam(list(hand.values()), lr=1e-2)
    since, thresholds = model.since_fired.clone(), [None] * n
    for step, ((xs, ys), factor) in enumerate(zip(batches, [0.5, 1, 0.5], strict=True)):
        scaled_y = [c[i] * ys[i] for i in range(n)]
        pres = [(a[i] * xs[i] - means[i]) @ hand["W_enc"][i] + hand["b_enc"][i] for i in range(n)]
        acts = [_hand_codes(pre, activation, k) for pre in pres]
        preds = [hand["b_dec"][t] + sum(acts[s] @ hand[f"W_dec.{s}"][:, t - s]
                                        for s in range(t + 1)) for t in range(n)]  # fmt: skip
        errors = [(scaled_y[t] - preds[t]).detach() for t in range(n)]
        aux = torch.zeros(())
        for s in range(n):
            is_dead = since[s] > 100
            count = int(is_dead.sum())
            masked = torch.where(is_dead, pres[s], torch.tensor(-float("inf")))
            top = masked.topk(min(aux_k, count), dim=1)
            dead_acts = torch.zeros_like(pres[s]).scatter(1, top.indices, top.values.clamp_min(0))
            fit = dead_acts @ hand[f"W_dec.{s}"].reshape(width, -1)
            error = torch.cat(errors[s:], dim=1)
            variance = (error - error.mean(0)).pow(2).sum()
            aux = aux + min(count / aux_k, 1) * (fit - error).pow(2).sum() / variance
        mse = sum((preds[t] - scaled_y[t]).pow(2).mean() for t in range(n))
        loss = mse + aux / 32
        if step == 0:
            got, parts = model.loss(xs, ys)
            torch.testing.assert_close(got, loss, rtol=1e-5, atol=1e-7)
            assert (
                np.isclose(parts["auxk"], float(aux.detach()), rtol=1e-5)
                and float(aux.detach()) > 0
            )
        hand_opt.param_groups[0]["lr"] = 1e-2 * factor
        hand_opt.zero_grad()
        loss.backward()
        hand_opt.step()
        with torch.no_grad():
            for s in range(n):
                since[s] = torch.where((acts[s] > 0).any(0), 0, since[s] + rows)
                smallest = float(acts[s][acts[s] > 0].min())
                t = thresholds[s]
                thresholds[s] = smallest if t is None else 0.99 * t + 0.01 * smallest
        train_step(model, opt, xs, ys)
        assert np.isclose(opt.param_groups[0]["lr"], 1e-2 * factor)
        assert model.since_fired.tolist() == since.tolist()
    assert int(model.step) == 3
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, hand[name], rtol=1e-5, atol=1e-6)
    clt = model.cross_layer("mlp_in", None, "test")
    xs, _ = batches[1]
    with torch.no_grad():
        pres = [(a[i] * xs[i] - means[i]) @ hand["W_enc"][i] + hand["b_enc"][i] for i in range(n)]
        if activation == "batchtopk":  # saved as a jumprelu of each layer's threshold
            assert clt.activation == "jumprelu"
            want_t = torch.tensor(thresholds, dtype=torch.float32)[:, None].expand(n, width)
            torch.testing.assert_close(clt.threshold, want_t, rtol=1e-6, atol=0)
            acts = [pre * (pre > thresholds[i]) for i, pre in enumerate(pres)]
        else:
            assert clt.activation == "topk" and clt.k == k
            acts = [_hand_codes(pre, "topk", k) for pre in pres]
        for t, out in enumerate(clt(xs)):
            want = hand["b_dec"][t] + sum(acts[s] @ hand[f"W_dec.{s}"][:, t - s]
                                          for s in range(t + 1))  # fmt: skip
            torch.testing.assert_close(out, want / c[t], rtol=1e-4, atol=1e-5)


def planted_cross_layer(seed: int, n=2, d=12, planted=12, k=2):
    """A planted cross-layer dictionary: each layer's `planted` features (orthonormal encoder
    directions, so each is its own encoder; each with a unit write into its layer and every
    later one); a batch draws k
    active features a row per layer, values in [1, 2]; x_l = codes_l @ directions_l + 0.5,
    y_t = sum over s <= t of codes_s @ writes_s[:, t - s] + 1. Returns (directions, batch(rows,
    generator))."""
    g = torch.Generator().manual_seed(seed)
    directions = [torch.linalg.qr(torch.randn(d, planted, generator=g))[0].T for _ in range(n)]
    writes = [F.normalize(torch.randn(planted, n - s, d, generator=g), dim=2) for s in range(n)]

    def batch(rows: int, gen: torch.Generator):
        codes = []
        for _ in range(n):
            active = torch.rand(rows, planted, generator=gen).argsort(1)[:, :k]
            values = 1 + torch.rand(rows, k, generator=gen)
            codes.append(torch.zeros(rows, planted).scatter(1, active, values))
        xs = [codes[s] @ directions[s] + 0.5 for s in range(n)]
        ys = [sum(codes[s] @ writes[s][:, t - s] for s in range(t + 1)) + 1 for t in range(n)]
        return xs, ys

    return directions, batch


def test_a_topk_clt_recovers_a_planted_cross_layer_dictionary():
    """The trainer's defaults for topk (W_dec 0, free rows, AuxK, warm-up and decay) at `k` the
    planted L0, 16 features a layer for 12 planted, 200 steps of 256 rows: held-out FVU <= 0.02
    per output layer (clt.evaluate, float64; measured 0.004-0.008) and at most 2 of the 16
    features dead (the spares)."""
    from probe.analysis.fit.options import FitOptions
    from probe.analysis.fit.trainer_base import train_step

    _, batch = planted_cross_layer(0)
    options = FitOptions(activation="topk", k=2, width=16, lr=2e-2, dead_rows=1000)
    model = clt_fit.TrainingCLT(2, 12, 12, options, seed=0, total_steps=200)
    opt = torch.optim.Adam(model.parameters(), lr=clt_fit.clt_learning_rate(options, 16))
    g = torch.Generator().manual_seed(1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for step in range(200):
            xs, ys = batch(256, g)
            if step == 0:
                model.start(xs, ys)
            train_step(model, opt, xs, ys)
    finally:
        torch.set_num_threads(threads)
    clt = model.cross_layer("mlp_in", None, "planted")
    measured = clt_fit.evaluate(clt, [batch(2048, torch.Generator().manual_seed(2))])
    for layer, m in enumerate(measured):
        assert m["fvu"] <= 0.02 and m["dead"] <= 2 / 16, (layer, m)


def test_a_jumprelu_clts_l0_target_is_the_per_layer_penalty_of_each_encoder_layer():
    """A jumprelu CLT steers each encoder layer's L0 to the target (`l0_target`, else `k`) as
    the per-layer trainer does: loss = sum over output layers of the MSE + `sparsity` (default
    1) x sum over source layers of (L0_l / target - 1)^2, L0_l the batch's mean count of layer
    l's features above their thresholds; the thresholds' gradient (through the log) is the
    rectangle kernel's: for feature j of layer l, -(1 / bw) x sum over rows in the kernel of
    (theta x dMSE/dact + dPenalty/dL0_l / rows), x theta. Computed by hand with plain torch."""
    from probe.analysis.fit.options import FitOptions

    n, d, width, target, bw, rows = 2, 5, 12, 3.0, 0.5, 40
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(rows, d, generator=g) + 1 for _ in range(n)]
    ys = [torch.randn(rows, d, generator=g) * 2 - 1 for _ in range(n)]
    options = FitOptions(activation="jumprelu", width=width, l0_target=target, k=7,
                         bandwidth=bw, sparsity_warmup=0.0)  # fmt: skip
    model = clt_fit.TrainingCLT(n, d, d, options, seed=0, total_steps=10)
    model.start(xs, ys)
    with torch.no_grad():  # thresholds spread around the pre-activations, decoders nonzero
        model.log_threshold.copy_(torch.rand(n, width, generator=g).mul(0.6).add(0.05).log())
        for w in model.W_dec:
            w.copy_(torch.randn(w.shape, generator=g) * 0.3)
    loss, parts = model.loss(xs, ys)
    loss.backward()

    p = {name: q.detach() for name, q in model.named_parameters()}
    theta = p["log_threshold"].exp()
    x_scaled = [x * model.x_scale[i] - model.x_mean[i] for i, x in enumerate(xs)]
    y_scaled = [y * model.y_scale[i] for i, y in enumerate(ys)]
    pres = [x_scaled[i] @ p["W_enc"][i] + p["b_enc"][i] for i in range(n)]
    acts = [(pre * (pre > theta[i])).requires_grad_() for i, pre in enumerate(pres)]
    preds = [p["b_dec"][t] + sum(acts[s] @ p[f"W_dec.{s}"][:, t - s] for s in range(t + 1))
             for t in range(n)]  # fmt: skip
    mse = sum((preds[t] - y_scaled[t]).pow(2).mean() for t in range(n))
    l0 = [float((pre > theta[i]).sum(1).double().mean()) for i, pre in enumerate(pres)]
    penalty = sum((v / target - 1) ** 2 for v in l0)
    torch.testing.assert_close(loss.detach(), mse.detach() + penalty, rtol=1e-5, atol=1e-7)
    assert np.isclose(parts["penalty"], penalty, rtol=1e-5) and penalty > 0.1
    d_acts = torch.autograd.grad(mse, acts)
    for i in range(n):
        kernel = ((pres[i] - theta[i]).abs() < bw / 2).double()
        assert kernel.sum() > 10  # rows in the kernel: the gradient is not trivially 0
        d_penalty_d_l0 = 2 * (l0[i] / target - 1) / target
        d_theta = -(1 / bw) * (kernel * (theta[i] * d_acts[i] + d_penalty_d_l0 / rows)).sum(0)
        torch.testing.assert_close(model.log_threshold.grad[i].double(), d_theta * theta[i],
                                   rtol=1e-4, atol=1e-7)  # fmt: skip


def test_a_relu_clts_penalty_is_the_per_layer_trainers_over_whole_decoders():
    """relu: `sparsity` (default 0.03, the per-layer trainer's) x the sum over source layers of
    the rows' mean of sum over features of activation x the norm of the feature's whole decoder
    (every layer it writes to) / sqrt(d_out), by hand; a 1-layer CLT with a per-layer
    transcoder's parameters has that transcoder's loss and gradients."""
    from probe.analysis.fit.options import FitOptions
    from probe.analysis.fit.transcoder_trainer import TrainingTranscoder

    n, d, width, rows = 2, 6, 10, 30
    g = torch.Generator().manual_seed(6)
    xs = [torch.randn(rows, d, generator=g) + 1 for _ in range(n)]
    ys = [torch.randn(rows, d, generator=g) * 2 - 1 for _ in range(n)]
    options = FitOptions(activation="relu", width=width, sparsity_warmup=0.0)
    model = clt_fit.TrainingCLT(n, d, d, options, seed=0, total_steps=10)
    model.start(xs, ys)
    loss, parts = model.loss(xs, ys)
    p = {name: q.detach() for name, q in model.named_parameters()}
    acts = [torch.relu((xs[i] * model.x_scale[i] - model.x_mean[i]) @ p["W_enc"][i] + p["b_enc"][i])
            for i in range(n)]  # fmt: skip
    preds = [p["b_dec"][t] + sum(acts[s] @ p[f"W_dec.{s}"][:, t - s] for s in range(t + 1))
             for t in range(n)]  # fmt: skip
    mse = sum((preds[t] - ys[t] * model.y_scale[t]).pow(2).mean() for t in range(n))
    norms = [p[f"W_dec.{s}"].pow(2).sum((1, 2)).sqrt() for s in range(n)]
    penalty = sum((acts[s] * norms[s]).sum(1).mean() / d**0.5 for s in range(n))
    assert np.isclose(parts["penalty"], float(penalty), rtol=1e-5)
    torch.testing.assert_close(loss.detach(), mse + 0.03 * penalty, rtol=1e-5, atol=1e-7)

    one = clt_fit.TrainingCLT(1, d, d, options, seed=1, total_steps=10)
    one.start(xs[:1], ys[:1])
    plain = TrainingTranscoder(d, d, options, seed=1, total_steps=10)
    plain.start(xs[0], ys[0])
    with torch.no_grad():
        for name in ("W_enc", "b_enc", "b_dec"):
            getattr(plain, name).copy_(getattr(one, name)[0])
        plain.W_dec.copy_(one.W_dec[0][:, 0])
    torch.testing.assert_close(plain.x_mean, one.x_mean[0])
    (got, got_parts), (want, want_parts) = one.loss(xs[:1], ys[:1]), plain.loss(xs[0], ys[0])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-8)
    assert np.isclose(got_parts["penalty"], want_parts["penalty"], rtol=1e-6)
    got.backward()
    want.backward()
    torch.testing.assert_close(one.W_dec[0].grad[:, 0], plain.W_dec.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(one.W_enc.grad[0], plain.W_enc.grad, rtol=1e-5, atol=1e-7)
