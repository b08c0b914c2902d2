"""python -m probe.fit: transcoders trained on a tiny GPT-2's captured MLP inputs and outputs
explain most of the held-out variance (FVU well under predicting the mean's 1.0); fit.csv's FVU
and L0 equal a plain-torch recomputation from the saved files over the run's rows; an
interrupted fit resumed gives the uninterrupted one's files bit for bit; the trainer equals a
hand loop of its loss; the paired stream pairs rows of the same token; bad input exits 2."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

import probe
from probe.analysis.fit import fitting
from probe.analysis.fit.fit_sites import held_out
from probe.analysis.fit.options import FitOptions
from probe.analysis.fit.transcoder_trainer import TrainingTranscoder, train_step
from probe.fit import main
from probe.models.transcoder_files import load_transcoders

WIDTH = 32  # the tiny GPT-2's hidden size
FAST = ["--width", "128", "--batch-size", "256", "--lr", "3e-3"]


def per_layer(out) -> pd.DataFrame:
    """fit.csv's per-layer rows (without the `all` row of the loss measures)."""
    return per_layer_of(pd.read_csv(out / "fit.csv"))


def per_layer_of(table: pd.DataFrame) -> pd.DataFrame:
    """A fit.csv-like table's per-layer rows (without the row `all`)."""
    rows = table[table["layer"].astype(str) != "all"]
    return rows.astype({"layer": int}).reset_index(drop=True)


def recompute(run_dir, out, reads="mlp_in", test_fraction=0.1, seed=0, keep_special=False):
    """FVU and L0 of the saved set over the run's held-out rows, float64 plain torch; without
    `keep_special`, rows of position 0 and of the tokenizer's special tokens left out."""
    from transformers import AutoTokenizer

    tset = load_transcoders(out)
    rows = []
    with probe.open_run(run_dir) as run:
        tokens = run.tokens()
        held = held_out(tokens["sample"].to_numpy(), run.num_samples, test_fraction, seed)
        specials = AutoTokenizer.from_pretrained(run.config["model"]["name"]).all_special_ids
        special = (tokens["position"] == 0) | tokens["id"].isin(specials)
        assert 0 < special.sum() < len(tokens) and (tokens["position"] > 0)[special].any()
        if not keep_special:
            held &= ~special.to_numpy()
        for layer, t in tset.transcoders.items():
            source = (
                f"transformer.h.{layer}.mlp" if reads == "mlp_in" else f"transformer.h.{layer}.ln_2"
            )
            x = torch.from_numpy(run.array(source, "input")[:][held]).double()
            y = torch.from_numpy(
                run.array(f"transformer.h.{layer}.mlp", "output")[:][held]
            ).double()
            W_enc, b_enc, W_dec, b_dec = (
                getattr(t, n).detach().double() for n in ("W_enc", "b_enc", "W_dec", "b_dec")
            )
            pre = x @ W_enc + b_enc
            if t.activation == "relu":
                acts = pre.clamp_min(0)
            elif t.activation == "jumprelu":
                acts = pre * (pre > t.threshold.detach().double())
            else:
                top = pre.topk(t.k, dim=1)
                acts = torch.zeros_like(pre).scatter(1, top.indices, top.values.clamp_min(0))
            pred = acts @ W_dec + b_dec
            if t.W_skip is not None:
                pred = pred + x @ t.W_skip.detach().double().T
            fvu = float((y - pred).pow(2).sum() / (y - y.mean(0)).pow(2).sum())
            rows.append({"layer": layer, "fvu": fvu, "l0": float((acts != 0).sum(1).double().mean()),
                         "held_out_rows": int(held.sum())})  # fmt: skip
    return pd.DataFrame(rows)


def test_fitted_transcoders_explain_the_mlp_and_fit_csv_is_what_the_files_give(lm_run, tmp_path):
    out = tmp_path / "tc"
    assert main([str(lm_run), "--steps", "150", "--out", str(out), *FAST]) == 0
    fit = per_layer(out)
    assert fit["layer"].tolist() == [0, 1] and (fit["width"] == 4 * WIDTH).all()
    assert (fit["fvu"] < 0.5).all(), fit  # predicting the mean: 1.0
    assert (fit["l0"] < 128).all() and (fit["steps"] == 150).all()
    again = recompute(lm_run, out)
    np.testing.assert_allclose(fit["fvu"], again["fvu"], rtol=1e-9)
    with probe.open_run(lm_run) as run:
        tokens = run.tokens()
    left_out = ((tokens["position"] == 0) | (tokens["id"] <= 3)).sum()
    assert (fit["left_out_rows"] == left_out).all() and left_out > 128  # some inside the rows
    np.testing.assert_allclose(fit["l0"], again["l0"], rtol=1e-12)
    assert fit["held_out_rows"].tolist() == again["held_out_rows"].tolist()
    curve = pd.read_csv(out / "fit_curve.csv")
    for _, c in curve.groupby("layer"):
        assert c["fvu"].iloc[-10:].mean() < 0.5 * c["fvu"].iloc[:10].mean()  # it learnt


@pytest.mark.parametrize(("activation", "extra"), [
    ("jumprelu", ["--reads", "resid_mid", "--skip"]),
    ("topk", ["--k", "8", "--keep-special"]),
    ("batchtopk", ["--k", "8", "--no-losses"]),
])  # fmt: skip
def test_other_activations_and_reads(lm_run, tmp_path, activation, extra):
    out = tmp_path / activation
    assert main([str(lm_run), "--steps", "60", "--activation", activation, "--out", str(out),
                 *FAST, *extra]) == 0  # fmt: skip
    fit = per_layer(out)
    reads = "resid_mid" if "resid_mid" in extra else "mlp_in"
    tset = load_transcoders(out)
    saved = "jumprelu" if activation == "batchtopk" else activation  # (its learnt threshold)
    assert tset.reads == reads and tset[0].activation == saved
    assert (tset[0].W_skip is not None) == ("--skip" in extra)
    again = recompute(lm_run, out, reads, keep_special="--keep-special" in extra)
    np.testing.assert_allclose(fit["fvu"], again["fvu"], rtol=1e-9)
    np.testing.assert_allclose(fit["l0"], again["l0"], rtol=1e-12)
    assert (fit["fvu"] < 1).all()
    if activation == "topk":
        assert (fit["l0"] <= 8).all()
        assert (fit["k"] == 8).all()  # the k the saved set computes with
    else:  # no k at inference: fit.csv's `k` is empty, as --evaluate of the saved set says
        assert fit["k"].isna().all() and all(t.k is None for t in tset.transcoders.values())
    if activation == "batchtopk":  # --evaluate of the saved set: fit.csv's k, FVU, L0, dead
        csv = tmp_path / "evaluated.csv"
        assert main(["--evaluate", str(out), str(lm_run), "--out", str(csv)]) == 0
        got = per_layer_of(pd.read_csv(csv))
        assert got["k"].isna().all() and (got["activation"] == "jumprelu").all()
        same = ["layer", "width", "k", "held_out_rows", "left_out_rows", "fvu", "l0", "dead"]
        pd.testing.assert_frame_equal(got[same], fit[same], rtol=1e-9, check_dtype=False)


def test_a_resumed_fit_gives_the_uninterrupted_files(lm_run, tmp_path, monkeypatch, capsys):
    args = ["--steps", "30", "--checkpoint-every", "10", *FAST]
    assert main([str(lm_run), "--out", str(tmp_path / "whole"), *args]) == 0
    calls = {"n": 0}
    real = fitting.train_step

    def dies(*a):
        calls["n"] += 1
        if calls["n"] == 45:  # layer 1's 15th step: its checkpoint is step 10's
            raise KeyboardInterrupt
        return real(*a)

    monkeypatch.setattr(fitting, "train_step", dies)
    with pytest.raises(KeyboardInterrupt):
        main([str(lm_run), "--out", str(tmp_path / "cut"), *args])
    monkeypatch.setattr(fitting, "train_step", real)
    assert main([str(lm_run), "--out", str(tmp_path / "cut"), *args]) == 2  # not without --resume
    assert (
        "already holds a fit (2 layer checkpoints): --resume continues it"
        in capsys.readouterr().err
    )
    assert main([str(lm_run), "--out", str(tmp_path / "cut"), "--resume", *args]) == 0
    for layer in (0, 1):
        name = f"layer_{layer}.safetensors"
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "cut" / name).read_bytes()
    whole, cut = (
        pd.read_csv(tmp_path / d / "fit.csv").drop(columns="seconds") for d in ("whole", "cut")
    )
    pd.testing.assert_frame_equal(whole, cut)
    assert (
        main([str(lm_run), "--out", str(tmp_path / "cut"), "--resume", *args, "--lr", "1e-2"]) == 2
    )
    assert (
        "other options than layer_0.pt was fitted with: lr=0.003 (now 0.01);"
        in capsys.readouterr().err
    )
    checkpoint = torch.load(tmp_path / "cut" / "checkpoints" / "layer_0.pt", weights_only=False)
    assert checkpoint["loss_form"] == fitting.LOSS_FORM == 1
    monkeypatch.setattr(fitting, "LOSS_FORM", 2)  # a version whose trainer's loss changed
    assert main([str(lm_run), "--out", str(tmp_path / "cut"), "--resume", *args]) == 2
    assert "was trained under another form of the loss (1; this version's is 2)" in (
        capsys.readouterr().err
    )


def test_layers_fitted_in_worker_processes_equal_one_process(lm_run, tmp_path, capsys):
    """--workers 2 trains the two layers in two spawned processes: the same set as one process
    (up to the threads' float order)."""
    args = ["--steps", "10", *FAST]
    assert main([str(lm_run), "--out", str(tmp_path / "one"), "--workers", "1", *args]) == 0
    assert main([str(lm_run), "--out", str(tmp_path / "two"), "--workers", "2", *args]) == 0
    one, two = (load_transcoders(tmp_path / d) for d in ("one", "two"))
    for layer in (0, 1):
        for name in ("W_enc", "b_enc", "W_dec", "b_dec"):
            torch.testing.assert_close(getattr(two[layer], name), getattr(one[layer], name),
                                       rtol=1e-4, atol=1e-6)  # fmt: skip
    a, b = (pd.read_csv(tmp_path / d / "fit.csv").drop(columns="seconds") for d in ("one", "two"))
    pd.testing.assert_frame_equal(a, b, rtol=1e-4)
    assert main([str(lm_run), "--out", str(tmp_path / "bad"), "--workers", "0", *args]) == 2
    assert "--workers 0: give 1 or more processes" in capsys.readouterr().err


def test_the_trainer_is_its_loss_under_adam():
    """Five steps of train_step equal a hand loop: rows centred and scaled by the first batch's
    spread, mse + the warmed-up sparsity x sum of acts x decoder row norms / sqrt(d_out) (relu),
    Adam at the warmed-up and decayed learning rate."""
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(64, 6, generator=g) + 2, torch.randn(64, 6, generator=g) * 3 - 1)
        for _ in range(5)
    ]
    options = FitOptions(width=12, lr=1e-2, sparsity=0.05, lr_warmup=0.4, lr_decay=0.4,
                         sparsity_warmup=0.6)  # fmt: skip
    model = TrainingTranscoder(6, 6, options, seed=3, total_steps=5)
    model.start(*batches[0])
    hand = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    a, c = float(model.x_scale), float(model.y_scale)
    x0, y0 = batches[0]
    assert np.isclose(a, (6 / (x0 - x0.mean(0)).pow(2).sum(1).mean()) ** 0.5) and np.isclose(
        c, (6 / (y0 - y0.mean(0)).pow(2).sum(1).mean()) ** 0.5
    )
    torch.testing.assert_close(hand["b_dec"], (c * y0).mean(0))
    torch.testing.assert_close(hand["W_enc"], hand["W_dec"].T)  # tied at init
    x_mean = a * x0.mean(0)
    lr_factors = [0.5, 1, 1, 1, 0.5]  # warm-up ceil(0.4 x 5) = 2 steps, decay the last 2
    sparsity_factors = [1 / 3, 2 / 3, 1, 1, 1]  # warm-up ceil(0.6 x 5) = 3 steps
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    hand_opt = torch.optim.Adam(list(hand.values()), lr=1e-2)
    for (x, y), lr, sp in zip(batches, lr_factors, sparsity_factors, strict=True):
        train_step(model, opt, x, y)
        hand_opt.param_groups[0]["lr"] = 1e-2 * lr
        hand_opt.zero_grad()
        acts = torch.relu((a * x - x_mean) @ hand["W_enc"] + hand["b_enc"])
        pred = acts @ hand["W_dec"] + hand["b_dec"]
        penalty = (acts * hand["W_dec"].norm(dim=1)).sum(1).mean() / 6**0.5
        loss = (pred - c * y).pow(2).mean() + 0.05 * sp * penalty
        loss.backward()
        hand_opt.step()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p, hand[n], rtol=1e-5, atol=1e-6)
    assert int(model.step) == 5
    # the saved transcoder computes the same on raw rows (scales and mean folded in)
    x, _ = batches[1]
    with torch.no_grad():
        pre = (a * x - x_mean) @ hand["W_enc"] + hand["b_enc"]
        want = (torch.relu(pre) @ hand["W_dec"] + hand["b_dec"]) / c
    torch.testing.assert_close(model.transcoder(0)(x), want, rtol=1e-4, atol=1e-5)


def _hand_scaled(model, x, y):
    a, c = float(model.x_scale), float(model.y_scale)
    return a * x - model.x_mean, c * y


@pytest.mark.parametrize("activation", ["topk", "batchtopk"])
def test_topk_and_batchtopk_losses_with_auxk_are_the_hand_computation(activation):
    """The loss and its gradients: mse of the (per-row or whole-batch) top-k reconstruction +
    1/32 x AuxK (the dead features' top aux_k pre-activations fit the detached error: squared error
    over the error's variance x min(dead / aux_k, 1)), computed densely here; decoder rows free,
    starting at 0 with W_enc uniform in +-1/sqrt(d_in); dead counters (rows since a feature fired)
    moved on; batchtopk's threshold the running mean of each batch's smallest selected activation,
    saved as a jumprelu."""
    g = torch.Generator().manual_seed(4)
    batches = [(torch.randn(40, 6, generator=g), torch.randn(40, 5, generator=g)) for _ in range(3)]
    options = FitOptions(activation=activation, width=16, k=3, aux_k=4, dead_rows=100, lr=1e-2,
                         lr_warmup=0, lr_decay=0)  # fmt: skip
    model = TrainingTranscoder(6, 5, options, seed=0, total_steps=3)
    model.start(*batches[0])
    dead = torch.tensor([0, 3, 5, 7, 11, 12])
    model.since_fired[dead] = 101
    model.since_fired[1] = 100  # not yet dead
    hand = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    assert not hand["W_dec"].any() and hand["W_enc"].abs().max() <= 6**-0.5
    assert hand["W_enc"].std() > 0.5 * 6**-0.5 / 3**0.5  # uniform: std 1 / sqrt(3 d_in)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    hand_opt = torch.optim.Adam(list(hand.values()), lr=1e-2)
    since = model.since_fired.clone()
    threshold = None
    for step, (x, y) in enumerate(batches):
        xs, ys = _hand_scaled(model, x, y)
        pre = xs @ hand["W_enc"] + hand["b_enc"]
        if activation == "topk":
            top = pre.topk(3, dim=1)
            acts = torch.zeros_like(pre).scatter(1, top.indices, top.values.clamp_min(0))
        else:
            top = pre.flatten().topk(3 * 40)
            acts = torch.zeros(pre.numel()).scatter(0, top.indices, top.values.clamp_min(0))
            acts = acts.view_as(pre)
        pred = acts @ hand["W_dec"] + hand["b_dec"]
        error = (ys - pred).detach()
        is_dead = since > 100
        n_dead = int(is_dead.sum())
        aux = torch.zeros(())
        if n_dead:
            masked = torch.where(is_dead, pre, torch.tensor(-float("inf")))
            top_dead = masked.topk(min(4, n_dead), dim=1)
            aux_acts = torch.zeros_like(pre).scatter(1, top_dead.indices,
                                                     top_dead.values.clamp_min(0))  # fmt: skip
            fit = aux_acts @ hand["W_dec"]
            aux = (
                min(n_dead / 4, 1)
                * (fit - error).pow(2).sum()
                / ((error - error.mean(0)).pow(2).sum())
            )
        loss = (pred - ys).pow(2).mean() + aux / 32
        if step == 0:
            assert n_dead == 6 and float(aux) > 0
            model_loss, parts = model.loss(x, y)
            torch.testing.assert_close(model_loss, loss, rtol=1e-5, atol=1e-7)
            assert np.isclose(parts["auxk"], float(aux), rtol=1e-5)
            opt.zero_grad()
        hand_opt.zero_grad()
        loss.backward()
        hand_opt.step()
        with torch.no_grad():
            fired = (acts > 0).any(0)
            since = torch.where(fired, 0, since + 40)
            smallest = float(acts[acts > 0].min())
            threshold = smallest if threshold is None else 0.99 * threshold + 0.01 * smallest
        train_step(model, opt, x, y)
        assert model.since_fired.tolist() == since.tolist()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p, hand[n], rtol=1e-5, atol=1e-6)
    t = model.transcoder(0)
    if activation == "batchtopk":
        assert t.activation == "jumprelu"
        assert np.isclose(float(model.batch_threshold), threshold, rtol=1e-6)
        torch.testing.assert_close(t.threshold, torch.full((16,), threshold), rtol=1e-6, atol=0)
        x = batches[0][0]
        with torch.no_grad():
            xs, _ = _hand_scaled(model, x, x[:, :5])
            pre = xs @ hand["W_enc"] + hand["b_enc"]
            want = ((pre * (pre > threshold)) @ hand["W_dec"] + hand["b_dec"]) / model.y_scale
        torch.testing.assert_close(t(x), want, rtol=1e-4, atol=1e-5)
    else:
        assert t.activation == "topk" and t.k == 3


def test_the_paired_stream_pairs_rows_of_one_token(lm_run):
    with probe.open_run(lm_run) as run:
        x = run.array("transformer.h.1.ln_2", "input")[:]
        y = run.array("transformer.h.1.mlp", "output")[:]
        tokens = run.tokens()
        row = {
            (s, p): i
            for i, (s, p) in enumerate(zip(tokens["sample"], tokens["position"], strict=True))
        }
        stream = run.dataset("transformer.h.1.ln_2", "input", pair=("transformer.h.1.mlp", "output"),
                             batch_size=100, seed=2, buffer_rows=400, with_index=True)  # fmt: skip
        seen = []
        for rows, _, index, paired in stream:
            at = [
                row[(s, p)]
                for s, p in zip(index["sample"].tolist(), index["position"].tolist(), strict=True)
            ]
            np.testing.assert_array_equal(rows.numpy(), x[at])
            np.testing.assert_array_equal(paired.numpy(), y[at])
            seen += at
    assert sorted(seen) == list(range(len(x)))
    assert seen != sorted(seen)  # shuffled


def test_bad_input_exits_2_by_name(lm_run, tmp_path, capsys):
    def refused(*args) -> str:
        assert main([str(lm_run), "--out", str(tmp_path / "bad"), *args]) == 2
        return capsys.readouterr().err

    assert "--activation 'gelu'; choose relu, jumprelu, topk" in refused("--activation", "gelu")
    assert "--layers [7]: the run holds mlp_in pairs of blocks [0, 1] only" in refused(
        "--layers", "7"
    )
    assert "--test-fraction 1.5" in refused("--test-fraction", "1.5")
    assert "--lr-warmup 1.5 (a share of the steps: want it in [0, 1])" in refused(
        "--lr-warmup", "1.5"
    )
    assert "--lr-warmup 0.5 + --lr-decay 0.6 (above 1)" in refused(
        "--lr-warmup", "0.5", "--lr-decay", "0.6"
    )
    assert "--reads mlp_normalized: a fit reads captured" in refused("--reads", "mlp_normalized")
    topk = ["--activation", "topk", "--no-losses"]
    assert "--k 200 is above --width 128: give --k <= 128" in refused(*topk, "--k", "200", "--width", "128")  # fmt: skip
    assert (  # no --width: 8 x the run's d_model, 32
        "--k 300 is above the default width 256 (8 x the input's 32): give --k <= 256, or a "
        "--width of 300 or more"
        in refused("--activation", "batchtopk", "--no-losses", "--k", "300", "--workers", "2")
    )
    jumprelu = ["--activation", "jumprelu", "--no-losses"]  # its L0 target: --l0-target, else --k
    assert "--k 200 (jumprelu's L0 target) is above --width 128: give --k <= 128" in refused(*jumprelu, "--k", "200", "--width", "128")  # fmt: skip
    assert "--k 16 (jumprelu's L0 target, the default) is above --width 10: give --k <= 10" in refused(*jumprelu, "--width", "10")  # fmt: skip
    assert (
        "--l0-target 256.5 (jumprelu's L0 target) is above the default width 256 (8 x the "
        "input's 32): give --l0-target <= 256, or a --width of 257 or more"
        in refused(*jumprelu, "--l0-target", "256.5", "--k", "8")
    )
    assert "the run holds no mlp_in pairs" in refused("--mlp", "attn")
    assert "not a run directory" in (
        main([str(tmp_path), "--steps", "1"]) == 2 and capsys.readouterr().err
    )


def test_jumprelu_thresholds_learn_through_the_straight_through_kernel():
    """The threshold's gradient is the pseudo-derivative: for the output, -(theta / eps) K((pre -
    theta) / eps) times the output's gradient; for L0, -(1 / eps) K(...) per row, averaged, times
    the target penalty's derivative 2 (L0 / target - 1) / target; K the unit rectangle. The
    pre-activations' gradient is the plain one (pre > theta): the kernel reaches the thresholds
    only. A default jumprelu starts from W_dec = 0, W_enc uniform in +-1/sqrt(d_in) and
    thresholds 0.001; here its decoder is set to random rows so the output's part is not 0."""
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(200, 6, generator=g), torch.randn(200, 6, generator=g)
    start = TrainingTranscoder(6, 6, FitOptions(activation="jumprelu", width=10, k=3), seed=0)
    assert (start.W_dec == 0).all() and start.W_enc.abs().max() <= 6**-0.5
    torch.testing.assert_close(start.log_threshold.exp(), torch.full((10,), 0.001))
    options = FitOptions(
        activation="jumprelu", width=10, sparsity=0.3, threshold=0.2, bandwidth=0.5, k=3
    )
    model = TrainingTranscoder(6, 6, options, seed=0)
    with torch.no_grad():
        model.W_dec.copy_(torch.randn(10, 6, generator=g))
    model.start(x, y)
    loss, _ = model.loss(x, y)
    loss.backward()
    with torch.no_grad():
        xs, ys = _hand_scaled(model, x, y)
        pre = xs @ model.W_enc + model.b_enc
        theta, eps = model.log_threshold.exp(), 0.5
        acts = pre * (pre > theta)
        d_pred = 2 * (acts @ model.W_dec + model.b_dec - ys) / ys.numel()
        d_acts = d_pred @ model.W_dec.T
        kernel = ((pre - theta).abs() < eps / 2).double()
        # penalty 0.3 (L0 / 3 - 1)^2 (L0 target: --k), L0 through the step's kernel
        l0 = float((pre > theta).sum(1).double().mean())
        d_l0 = (-(1 / eps) * kernel).sum(0) / len(x)
        d_theta = (-(theta / eps) * kernel * d_acts).sum(0) + 0.3 * 2 * (l0 / 3 - 1) / 3 * d_l0
        d_b_enc = (d_acts * (pre > theta)).sum(0)
    assert kernel.sum() > 20 and d_acts.abs().sum() > 0  # the kernel sees rows, the output counts
    torch.testing.assert_close(
        model.log_threshold.grad, (d_theta * theta).float(), rtol=1e-4, atol=1e-7
    )
    torch.testing.assert_close(model.b_enc.grad, d_b_enc, rtol=1e-4, atol=1e-7)
