"""fit.csv's loss measures: ce_clean, ce_spliced, ce_zero, ce_recovered and kl of each fitted
layer (and of all at once) equal a hand computation with plain forward hooks on the tiny GPT-2
and torch.nn.functional's cross-entropy and KL over the held-out samples; ce_clean is
transformers' own loss; splicing with the error added back gives ce_clean; `--evaluate` on the
set a fit wrote gives fit.csv's numbers; bad input exits 2 by name."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

import probe
from probe.analysis.fit import losses
from probe.analysis.fit.fit_sites import find_sites, held_out
from probe.analysis.fit.fitting import EVALUATE_COLUMNS
from probe.analysis.fit.losses import loss_measures, run_model, sample_tokens
from probe.analysis.fit.transcoder_splice import splice_points
from probe.fit import main
from probe.models.transcoder import Transcoder, TranscoderSet
from probe.models.transcoder_files import load_transcoders, save_transcoders
from probe.testing.tiny_lms import make_tiny
from tests.helpers import run_probe

FAST = ["--steps", "25", "--width", "64", "--batch-size", "256", "--lr", "3e-3"]
LOSSES = ["ce_clean", "ce_spliced", "ce_zero", "ce_recovered", "kl"]


def _capture(root, name, task="causal_lm", samples=96, length=24):
    model = make_tiny("gpt2", root / "gpt2", vocab_size=50)
    ids = torch.randint(1, 50, (samples, length), generator=torch.Generator().manual_seed(0))
    torch.save({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, root / "ids.pt")
    _, f = run_probe(root / name, "model=hf", f"model.name={model}", f"model.task={task}",
                     "dataset=tokens", f"dataset.path={root / 'ids.pt'}", "dataset.batch_size=48",
                     "probes=none", "+probes.tc.layers=[@blocks.mlp,@blocks.ln_2]",
                     "+probes.tc.capture=[input,output]", "+probes.tc.rows=tokens",
                     "+probes.tc.match=any")  # fmt: skip
    f.close()
    return root / name, model


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    """A tiny GPT-2's MLP inputs and outputs and ln_2 inputs, 96 x 24 token rows."""
    return _capture(tmp_path_factory.mktemp("measures"), "run")


@pytest.fixture(scope="module")
def fitted(lm_run, tmp_path_factory):
    """Two fits of lm_run: relu reading mlp_in, topk with a skip reading resid_mid."""
    run, _ = lm_run
    outs = {}
    for reads, extra in (("mlp_in", []), ("resid_mid", ["--activation", "topk", "--k", "8",
                                                        "--skip"])):  # fmt: skip
        out = tmp_path_factory.mktemp(reads)
        assert main([str(run), "--reads", reads, "--out", str(out), *FAST, *extra]) == 0
        outs[reads] = out
    return outs


def held_out_ids(run_dir, fraction=0.1, seed=0) -> tuple[np.ndarray, torch.Tensor]:
    """The held-out samples and their token ids (every sample has the same length here)."""
    with probe.open_run(run_dir) as run:
        tokens = run.tokens()
        samples = np.unique(tokens["sample"])
        held = samples[held_out(samples, run.num_samples, fraction, seed)]
        rows = tokens[tokens["sample"].isin(held)].sort_values(["sample", "position"])
    return held, torch.from_numpy(rows["id"].to_numpy().reshape(len(held), -1))


def hand_losses(model, ids, tset: TranscoderSet, layers, how: str):
    """(ce, kl against the clean model) with `layers`' MLP outputs replaced by plain forward
    hooks: `transcoder` (from the MLP's input, or ln_2's for resid_mid) or `zero`."""
    blocks = model.transformer.h
    handles, kept = [], {}
    for layer in layers:
        t = tset[layer]
        if tset.reads == "resid_mid":
            handles.append(blocks[layer].ln_2.register_forward_pre_hook(
                lambda m, a, layer=layer: kept.__setitem__(layer, a[0])))  # fmt: skip
        if how == "zero":
            handles.append(blocks[layer].mlp.register_forward_hook(
                lambda m, a, o: torch.zeros_like(o)))  # fmt: skip
        else:
            handles.append(blocks[layer].mlp.register_forward_hook(
                lambda m, a, o, t=t, layer=layer: t(a[0] if tset.reads == "mlp_in"
                                                    else kept[layer])))  # fmt: skip
    try:
        with torch.no_grad():
            logits = model(ids).logits[:, :-1].double()
    finally:
        for h in handles:
            h.remove()
    with torch.no_grad():
        clean = model(ids).logits[:, :-1].double()
    vocab = logits.shape[-1]
    ce = F.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1))
    kl = F.kl_div(logits.reshape(-1, vocab).log_softmax(-1),
                  clean.reshape(-1, vocab).log_softmax(-1), log_target=True,
                  reduction="batchmean")  # fmt: skip
    return float(ce), float(kl)


@pytest.mark.parametrize("reads", ["mlp_in", "resid_mid"])
def test_fit_csv_losses_equal_a_hand_computation_with_forward_hooks(lm_run, fitted, reads):
    from transformers import AutoModelForCausalLM

    run, model_dir = lm_run
    out = fitted[reads]
    fit = pd.read_csv(out / "fit.csv")
    assert fit["layer"].astype(str).tolist() == ["0", "1", "all"]
    held, ids = held_out_ids(run)
    assert pd.read_csv(out / "held_out.csv")["sample"].tolist() == held.tolist()
    assert pd.read_csv(out / "held_out.csv")["tokens"].tolist() == [ids.shape[1]] * len(held)
    tset = load_transcoders(out)
    model = AutoModelForCausalLM.from_pretrained(model_dir).float().eval()
    with torch.no_grad():
        clean = model(ids).logits[:, :-1].double()
        reference = model(ids, labels=ids).loss  # transformers' own mean over the predictions
    ce_clean = float(F.cross_entropy(clean.reshape(-1, clean.shape[-1]), ids[:, 1:].reshape(-1)))
    np.testing.assert_allclose(fit["ce_clean"], ce_clean, rtol=1e-9)
    np.testing.assert_allclose(fit["ce_clean"], float(reference), rtol=1e-6)
    for key, layers in (("0", [0]), ("1", [1]), ("all", [0, 1])):
        row = fit[fit["layer"].astype(str) == key].iloc[0]
        ce_spliced, kl = hand_losses(model, ids, tset, layers, "transcoder")
        ce_zero, _ = hand_losses(model, ids, tset, layers, "zero")
        np.testing.assert_allclose(row["ce_spliced"], ce_spliced, rtol=1e-7)
        np.testing.assert_allclose(row["kl"], kl, rtol=1e-5, atol=1e-12)
        np.testing.assert_allclose(row["ce_zero"], ce_zero, rtol=1e-7)
        recovered = (ce_zero - ce_spliced) / (ce_zero - ce_clean)
        np.testing.assert_allclose(row["ce_recovered"], recovered, rtol=1e-5)
        assert kl > 0 and ce_zero != ce_clean  # the splice and the ablation change the model
    assert fit["fvu"].iloc[:2].notna().all() and fit["fvu"].iloc[2:].isna().all()


def test_splicing_with_the_error_added_back_is_the_clean_model(lm_run, fitted, monkeypatch):
    run, _ = lm_run
    tset = load_transcoders(fitted["resid_mid"])
    held, _ = held_out_ids(run)
    with probe.open_run(run) as opened:
        model = run_model(opened)
        sites = find_sites(opened.keys, "resid_mid")
        sequences = sample_tokens(opened, held)
    points = splice_points(model, [0, 1], "resid_mid", sites)
    assert points == splice_points(model, [0, 1], "resid_mid")  # the anatomy's modules too
    plain = loss_measures(model, sequences, points, tset.transcoders)
    kept = loss_measures(model, sequences, points, tset.transcoders, mode="with_error")
    for key in (0, 1, "all"):
        np.testing.assert_allclose(kept[key]["ce_spliced"], kept[key]["ce_clean"], rtol=1e-6)
        assert kept[key]["kl"] < 1e-10 < plain[key]["kl"]
        assert kept[key]["ce_zero"] == plain[key]["ce_zero"]
    # memory bounds that cut the batches to 5 tokens and the log-probabilities to 3 rows at once
    # (of a 50-token vocabulary) give the same measures
    monkeypatch.setattr(losses, "LOGITS_BYTES", 5 * 50 * 4)
    monkeypatch.setattr(losses, "LOG_PROB_BYTES", 3 * 50 * 8)
    small = loss_measures(model, sequences, points, tset.transcoders)
    # (ce_recovered, a ratio of differences of the means, carries their rounding amplified)
    for key in (0, 1, "all"):
        for name, value in plain[key].items():
            rtol = 1e-10 if name == "ce_recovered" else 1e-11
            np.testing.assert_allclose(small[key][name], value, rtol=rtol, err_msg=name)


def test_evaluate_gives_the_fits_numbers(lm_run, fitted, tmp_path, capsys):
    run, _ = lm_run
    out = fitted["resid_mid"]
    csv = tmp_path / "eval" / "theirs.csv"
    assert main(["--evaluate", str(out), str(run), "--out", str(csv)]) == 0
    got, fit = pd.read_csv(csv), pd.read_csv(out / "fit.csv")
    assert list(got.columns) == EVALUATE_COLUMNS
    pd.testing.assert_frame_equal(got, fit[EVALUATE_COLUMNS], rtol=1e-9)
    held = pd.read_csv(tmp_path / "eval" / "theirs.held_out.csv")
    pd.testing.assert_frame_equal(held, pd.read_csv(out / "held_out.csv"))
    assert main(["--evaluate", str(out), str(run)]) == 0
    printed = capsys.readouterr().out
    assert printed.splitlines()[-1].split()[:3] == ["all", "resid_mid", "topk"]
    every = tmp_path / "every.csv"
    assert main(["--evaluate", str(out), str(run), "--all-samples", "--out", str(every)]) == 0
    with probe.open_run(run) as opened:
        measured = pd.read_csv(every).iloc[:2]
        assert (measured["held_out_rows"] + measured["left_out_rows"] == opened.num_tokens).all()
        samples = pd.read_csv(tmp_path / "every.held_out.csv")["sample"]
        assert samples.tolist() == list(range(opened.num_samples))


def test_a_published_mlp_normalized_set_is_measured_through_the_norm(lm_run, fitted, tmp_path):
    """A set reading ln_2's normalised input: its row measures from the captured ln_2 inputs
    normalised by hand (held-out rows, position 0 and special tokens left out), its spliced loss
    from hooks normalising by hand."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, model_dir = lm_run
    theirs = load_transcoders(fitted["mlp_in"])
    tset = TranscoderSet(theirs.transcoders, reads="mlp_normalized", model_name="tiny")
    save_transcoders(tset, tmp_path / "set")
    csv = tmp_path / "norm.csv"
    assert main(["--evaluate", str(tmp_path / "set"), str(run), "--out", str(csv)]) == 0
    got = pd.read_csv(csv)
    model = AutoModelForCausalLM.from_pretrained(model_dir).float().eval()
    held, ids = held_out_ids(run)

    def norm(x):
        x = x - x.mean(-1, keepdim=True)
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)

    with probe.open_run(run) as opened:
        tokens = opened.tokens()
        rows = held_out(tokens["sample"].to_numpy(), opened.num_samples, 0.1, 0)
        specials = AutoTokenizer.from_pretrained(model_dir).all_special_ids
        rows &= ~((tokens["position"] == 0) | tokens["id"].isin(specials)).to_numpy()
        assert (got["held_out_rows"].iloc[:2] == rows.sum()).all()
        for layer in (0, 1):
            t = tset[layer].double()
            x = norm(
                torch.from_numpy(
                    opened.array(f"transformer.h.{layer}.ln_2", "input")[:][rows]
                ).double()
            )
            y = torch.from_numpy(
                opened.array(f"transformer.h.{layer}.mlp", "output")[:][rows]
            ).double()
            fvu = float((y - t(x)).pow(2).sum() / (y - y.mean(0)).pow(2).sum())
            np.testing.assert_allclose(got["fvu"].iloc[layer], fvu, rtol=1e-6)
    handles = []
    for layer in (0, 1):
        block, t = model.transformer.h[layer], tset[layer].float()
        kept = {}
        handles.append(block.ln_2.register_forward_pre_hook(
            lambda m, a, kept=kept: kept.__setitem__("x", norm(a[0]))))  # fmt: skip
        handles.append(block.mlp.register_forward_hook(
            lambda m, a, o, kept=kept, t=t: t(kept["x"])))  # fmt: skip
    with torch.no_grad():
        logits = model(ids).logits[:, :-1].double()
    for h in handles:
        h.remove()
    ce = float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)))
    np.testing.assert_allclose(got["ce_spliced"].iloc[2], ce, rtol=1e-6)


def test_bad_input_exits_2_by_name(lm_run, fitted, tmp_path, capsys):
    run, model_dir = lm_run

    def refused(*args) -> str:
        assert main(list(args)) == 2
        return capsys.readouterr().err

    g = torch.Generator().manual_seed(0)
    narrow = {layer: Transcoder(torch.randn(16, 8, generator=g), torch.zeros(8),
                                torch.randn(8, 16, generator=g), torch.zeros(16), layer=layer)
              for layer in (0, 1)}  # fmt: skip
    save_transcoders(TranscoderSet(narrow, model_name="another-model"), tmp_path / "narrow")
    err = refused("--evaluate", str(tmp_path / "narrow"), str(run))
    assert "the transcoder of layer 0" in err and "d_in=16" in err and "hidden size 32" in err
    assert "(trained on another-model)" in err and "give transcoders trained on this model" in err
    assert "probe.fit: error:" in refused("--evaluate", str(tmp_path / "none"), str(run))
    headless, _ = _capture(tmp_path, "base", task="base", samples=8, length=8)
    err = refused(str(headless), "--out", str(tmp_path / "tc"), *FAST)
    assert "has no language-model head" in err and "model.task=causal_lm" in err
    assert "--no-losses" in err
    assert "has no language-model head" in refused("--evaluate", str(fitted["mlp_in"]),
                                                   str(headless))  # fmt: skip
    out = tmp_path / "tc"
    assert main([str(headless), "--out", str(out), "--no-losses", *FAST]) == 0
    fit = pd.read_csv(out / "fit.csv")
    assert fit["layer"].tolist() == [0, 1] and fit[LOSSES].isna().all().all()
    assert (out / "held_out.csv").is_file()


def test_evaluate_measures_a_fit_of_some_layers(lm_run, tmp_path, caplog, capsys):
    """A fit of `--layers 1` is evaluated: rows `1` and `all` (block 1 alone: the fitted blocks
    at once, logged), equal to the fit's own fit.csv, and ce_spliced / ce_zero / kl equal to a
    hand splice of block 1 by forward hooks; a set holding a layer the model lacks exits 2 naming
    it."""
    import logging

    from transformers import AutoModelForCausalLM

    run, model_dir = lm_run
    out = tmp_path / "layer1"
    assert main([str(run), "--layers", "1", "--out", str(out), *FAST]) == 0
    csv = tmp_path / "layer1.csv"
    with caplog.at_level(logging.INFO, logger="probe.fit"):
        assert main(["--evaluate", str(out), str(run), "--out", str(csv)]) == 0
    assert "the set covers blocks [1] of the model's 2" in caplog.text
    got, fit = pd.read_csv(csv), pd.read_csv(out / "fit.csv")
    assert got["layer"].astype(str).tolist() == ["1", "all"]
    pd.testing.assert_frame_equal(got, fit[EVALUATE_COLUMNS], rtol=1e-9)
    tset = load_transcoders(out, every_block=False)
    model = AutoModelForCausalLM.from_pretrained(model_dir).float().eval()
    _, ids = held_out_ids(run)
    ce_spliced, kl = hand_losses(model, ids, tset, [1], "transcoder")
    ce_zero, _ = hand_losses(model, ids, tset, [1], "zero")
    for row in got.itertuples():
        np.testing.assert_allclose(row.ce_spliced, ce_spliced, rtol=1e-7)
        np.testing.assert_allclose(row.ce_zero, ce_zero, rtol=1e-7)
        np.testing.assert_allclose(row.kl, kl, rtol=1e-5, atol=1e-12)
    far = TranscoderSet({1: tset[1], 5: tset[1]}, model_name="tiny", every_block=False)
    save_transcoders(far, tmp_path / "far")
    capsys.readouterr()
    assert main(["--evaluate", str(tmp_path / "far"), str(run)]) == 2
    err = capsys.readouterr().err
    assert "has a transcoder of layer 5" in err and "2 blocks (layers 0..1)" in err, err
