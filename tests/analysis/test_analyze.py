"""`probe.analysis.streamed_analyses`: linear probes and CKA over a real run, each value checked against the same
value computed in memory another way (numpy closed forms, the sample-Gram CKA formula)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import h5py
import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import probe
from probe.analysis.cka import CountSketch, Features, cka_pairs, linear_cka, sketch_seed
from probe.analysis.linear_probe import RidgeFit, split
from probe.analysis.streamed_analyses import Options, RunColumns, analyze
from probe.store.runfile import open_probe_file
from tests.helpers import ROOT, cli

CLASSES, CHANNELS, SIDE, N = 3, 6, 4, 403
PROBES = {"planted": {"layers": ["carry", "destroy", "head"]}}
LINEAR_REQUIRED = ["run", "layer", "site", "features", "samples_train", "samples_test"]
LINEAR_REQUIRED += ["accuracy", "loss", "chance", "classes"]
CKA_REQUIRED = ["layer_a", "site_a", "layer_b", "site_b", "cka"]


class Planted(nn.Module):
    """Inputs (N, 6, 4, 4) whose channel y (the label) is raised by 3: `carry` copies every channel
    (identity 1x1 conv, plus `mix` times a seeded random matrix), `destroy` zeroes the label
    channels and keeps the noise ones, `head` reads the pooled result. With `die_at` the process
    ends inside that forward (a run cut short)."""

    def __init__(self, mix: float = 0.0, die_at: int = 0):
        super().__init__()
        self.calls, self.die_at = 0, die_at
        self.carry = nn.Conv2d(CHANNELS, CHANNELS, 1, bias=False)
        self.destroy = nn.Conv2d(CHANNELS, CHANNELS, 1, bias=False)
        self.head = nn.Linear(CHANNELS, CLASSES)
        with torch.no_grad():
            eye = torch.eye(CHANNELS)
            self.carry.weight.copy_((eye + mix * torch.randn(CHANNELS, CHANNELS))[..., None, None])
            eye[:CLASSES] = 0.0
            self.destroy.weight.copy_(eye[..., None, None])

    def forward(self, x):
        self.calls += 1
        if self.calls == self.die_at:
            time.sleep(1.0)  # lets the writer flush the batches before
            os._exit(9)
        return self.head(self.destroy(self.carry(x)).mean(dim=(2, 3)))


def planted_data(n: int = N, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    x = torch.randn(n, CHANNELS, SIDE, SIDE, generator=g)
    x[torch.arange(n), y] += 3.0
    return x, y


@pytest.fixture(scope="module")
def planted_run(tmp_path_factory):
    x, y = planted_data()
    out = tmp_path_factory.mktemp("planted") / "run"
    loader = DataLoader(TensorDataset(x, y), batch_size=16)
    probe.run(Planted(), loader, PROBES, out=out, progress=False).close()
    return out


def pooled(h5, layer: str, rows: int | None = None) -> np.ndarray:
    """A layer's stored rows, pooled as the analysis pools them (mean over the spatial axes)."""
    with open_probe_file(h5) as f:
        a = f[f"layers/{layer}/output"][:rows].astype(np.float64)
    return a.mean(axis=(2, 3)) if a.ndim == 4 else a


def ridge_reference(x, labels, held_out, ridge=1e-3) -> dict:
    """Ridge on one-hot targets with standardised features, as an augmented least-squares
    problem [Z; sqrt(ridge n) I] W = [Y - ybar; 0] solved by np.linalg.lstsq."""
    train = ~held_out
    classes = labels.max() + 1
    onehot = np.eye(classes)[labels]
    mean, std = x[train].mean(axis=0), x[train].std(axis=0)
    std[std < 1e-12] = np.inf
    z = (x - mean) / std
    ybar = onehot[train].mean(axis=0)
    n, p = int(train.sum()), x.shape[1]
    design = np.vstack([z[train], np.sqrt(ridge * n) * np.eye(p)])
    target = np.vstack([onehot[train] - ybar, np.zeros((p, classes))])
    w = np.linalg.lstsq(design, target, rcond=None)[0]
    scores = z[held_out] @ w + ybar
    counts = np.bincount(labels[held_out], minlength=classes)
    return {
        "accuracy": np.mean(scores.argmax(axis=1) == labels[held_out]),
        "loss": np.mean(np.sum((scores - onehot[held_out]) ** 2, axis=1)),
        "chance": counts.max() / counts.sum(),
        "samples_train": n,
        "samples_test": int(held_out.sum()),
    }


def cka_gram(x, y) -> float:
    """CKA from the centred sample Grams: tr(KHLH) / sqrt(tr(KHKH) tr(LHLH))."""
    n = len(x)
    h = np.eye(n) - 1.0 / n
    k, ell = h @ (x @ x.T) @ h, h @ (y @ y.T) @ h
    return float(np.sum(k * ell) / np.sqrt(np.sum(k * k) * np.sum(ell * ell)))


# -- linear probes -----------------------------------------------------------------------------
def test_planted_label_is_read_where_it_is_carried_and_not_after(planted_run):
    table = analyze(planted_run, "linear", Options(window_rows=7, slab_bytes=1))["linear"]
    by = table.set_index("layer")
    assert list(by.index) == ["carry", "destroy", "head"] and (by.classes == CLASSES).all()
    assert by.loc["carry", "accuracy"] >= 0.97
    for layer in ("destroy", "head"):  # no label left: no better than the majority class
        assert by.loc[layer, "accuracy"] <= by.loc[layer, "chance"] + 0.1
    labels = np.asarray(planted_data()[1])
    held_out = split(N, 0.2, 0)
    for layer in ("carry", "destroy", "head"):
        want = ridge_reference(pooled(planted_run / "probe.h5", layer), labels, held_out)
        row = by.loc[layer]
        assert (row.samples_train, row.samples_test) == (
            want["samples_train"],
            want["samples_test"],
        )
        assert row.accuracy == pytest.approx(want["accuracy"], abs=1e-12)
        assert row.chance == pytest.approx(want["chance"], abs=1e-12)
        assert row.loss == pytest.approx(want["loss"], rel=1e-5)


def test_streamed_ridge_equals_the_in_memory_closed_form():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((101, 5)) * [1, 10, 0.1, 3, 1] + [0, 1e3, -5, 0, 2]
    labels = rng.integers(0, 4, 101)
    fit = RidgeFit(5, 4, shift=x[:7].mean(axis=0))
    for lo in range(0, 101, 7):  # windows that do not divide the rows
        fit.update(x[lo : lo + 7], labels[lo : lo + 7])
    model = fit.solve(0.01)
    z = (x - x.mean(axis=0)) / x.std(axis=0)
    onehot = np.eye(4)[labels]
    w = np.linalg.solve(z.T @ z / 101 + 0.01 * np.eye(5), z.T @ (onehot - onehot.mean(0)) / 101)
    np.testing.assert_allclose(model.scores(x), z @ w + onehot.mean(0), rtol=1e-9, atol=1e-11)


def test_split_is_seeded_and_of_the_asked_size():
    a, b, c = split(1000, 0.25, 3), split(1000, 0.25, 3), split(1000, 0.25, 4)
    assert a.sum() == 250 and np.array_equal(a, b) and not np.array_equal(a, c)
    assert split(2, 0.01, 0).sum() == 1 and split(2, 0.99, 0).sum() == 1


def planted_cli(tmp_path, *overrides: str, n: int = 64) -> subprocess.CompletedProcess:
    """`python -m probe` on Planted over n planted samples (saved to tmp_path/data.pt)."""
    x, y = planted_data(n)
    torch.save({"inputs": x, "targets": y}, tmp_path / "data.pt")
    return cli(
        "model=custom", "model._target_=tests.analysis.test_analyze.Planted",
        f"model.input_shape=[{CHANNELS},{SIDE},{SIDE}]", "dataset=tensors",
        f"dataset.path={tmp_path / 'data.pt'}", "probes=all_convs", *overrides, cwd=tmp_path,
    )  # fmt: skip


def test_a_run_cut_short_is_analysed_over_its_valid_rows(tmp_path):
    run = tmp_path / "killed"
    out = planted_cli(
        tmp_path, "+model.kwargs.die_at=4", "dataset.batch_size=8", f"hydra.run.dir={run}"
    )
    assert out.returncode == 9  # killed inside the fourth forward
    with probe.open_run(run) as reader:
        valid, complete = reader.num_samples, reader.complete
    assert not complete and 0 < valid < 64
    tables = analyze(run, "all", Options(window_rows=5))
    lin, cka = tables["linear"].set_index("layer"), tables["cka"]
    assert (lin.samples_train + lin.samples_test == valid).all()
    labels = np.asarray(planted_data(64)[1])[:valid]
    want = ridge_reference(pooled(run / "probe.h5", "carry", valid), labels, split(valid, 0.2, 0))
    assert lin.loc["carry", "accuracy"] == pytest.approx(want["accuracy"], abs=1e-12)
    assert lin.loc["carry", "loss"] == pytest.approx(want["loss"], rel=1e-5)
    a, b = (pooled(run / "probe.h5", name, valid) for name in ("carry", "destroy"))
    assert cka.samples.iloc[0] == valid and cka.cka.iloc[0] == pytest.approx(
        cka_gram(a, b), rel=1e-6
    )


# -- CKA ---------------------------------------------------------------------------------------
def streamed(arrays, pairs, window_rows=7, budget=1 << 30, features=None) -> dict:
    feats = features or [Features(i, a.shape[1], a[:5].mean(axis=0)) for i, a in enumerate(arrays)]
    usable = np.ones(len(arrays[0]), dtype=bool)
    return cka_pairs(feats, pairs, lambda i, lo, hi: arrays[i][lo:hi], usable, budget, window_rows)


@pytest.fixture(scope="module")
def xy():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((101, 12)) @ rng.standard_normal((12, 12)) + 50.0
    y = np.tanh(x[:, :8] @ rng.standard_normal((8, 9))) + 0.3 * rng.standard_normal((101, 9))
    return x, y


@pytest.mark.parametrize("window_rows", [1, 7, 100, 101, 500])
def test_streamed_cka_equals_the_gram_formula(xy, window_rows):
    x, y = xy
    got = streamed([x, y], [(0, 1)], window_rows)[0, 1]
    assert got == pytest.approx(cka_gram(x, y), rel=1e-9)
    assert got == pytest.approx(linear_cka(x, y), rel=1e-9)


def test_cka_is_one_on_itself_and_invariant_to_rotation_and_scale(xy):
    x, y = xy
    q = np.linalg.qr(np.random.default_rng(5).standard_normal((12, 12)))[0]
    values = streamed([x, x.copy(), x @ q, 3.7 * x, y], [(0, 1), (2, 4), (3, 4), (0, 4)])
    assert values[0, 1] == pytest.approx(1.0, abs=1e-12)
    assert values[2, 4] == pytest.approx(values[0, 4], rel=1e-9)
    assert values[3, 4] == pytest.approx(values[0, 4], rel=1e-9)


def test_a_small_budget_splits_the_pairs_into_passes_with_the_same_values(xy):
    x, y = xy
    arrays = [x, y, x[:, :3], y**2]
    pairs = [(i, j) for i in range(4) for j in range(i + 1, 4)]
    one_pass, many = streamed(arrays, pairs), streamed(arrays, pairs, budget=2000)
    for i, j in pairs:
        assert many[i, j] == pytest.approx(one_pass[i, j], rel=1e-12)
        assert many[i, j] == pytest.approx(cka_gram(arrays[i], arrays[j]), rel=1e-9)


def low_rank(n, p, rank, seed):
    rng = np.random.default_rng(seed)
    latent = rng.standard_normal((n, rank)) * np.linspace(3, 0.3, rank)
    return latent, latent @ rng.standard_normal((rank, p)) + 0.05 * rng.standard_normal((n, p))


def sketched(x, k, seed) -> tuple[np.ndarray, Features]:
    """The sketch of x and its Features with the correction terms computed in memory."""
    z = CountSketch(x.shape[1], k, seed)(x.copy())
    diag = ((x - x.mean(axis=0)) ** 2).sum(axis=0)
    f = Features(seed, k, z.mean(axis=0), True, x.shape[1], diag.sum(), (diag**2).sum(), len(x))
    return z, f


def test_wide_features_are_sketched_with_corrected_self_terms():
    latent, x = low_rank(3000, 1500, 12, seed=1)
    y = np.tanh(latent[:, :8] @ np.random.default_rng(2).standard_normal((8, 900)))
    exact = linear_cka(x, y)
    (zx, fx), (zy, fy) = sketched(x, 256, 11), sketched(y, 256, 12)
    got = streamed([zx, zy], [(0, 1)], window_rows=333, features=[fx, fy])[0, 1]
    raw = linear_cka(zx, zy)  # the sketch's CKA without the correction
    assert abs(got - exact) < 0.02 and abs(got - exact) < 0.5 * abs(raw - exact)


def test_the_pipeline_sketches_wide_layers_like_the_reference(planted_run):
    """flatten: 96 features per layer, over max_features=40: the streamed CKA equals the
    corrected CKA of the same sketches computed in memory."""
    opts = Options(features="flatten", max_features=40, window_rows=11, slab_bytes=1)
    table = analyze(planted_run, "cka", opts)["cka"]
    row = table[(table.layer_a == "carry") & (table.layer_b == "destroy")].iloc[0]
    assert row.method == "sketch" and row.features_a == 40
    with open_probe_file(planted_run / "probe.h5") as f:
        a, b = (
            f[f"layers/{n}/output"][:].reshape(N, -1).astype(np.float64)
            for n in ("carry", "destroy")
        )
    (za, fa), (zb, fb) = (
        sketched(v, 40, sketch_seed(0, planted_run.name, name, "output"))
        for v, name in ((a, "carry"), (b, "destroy"))
    )
    za, zb = za.astype(np.float32), zb.astype(np.float32)  # the scratch file's precision
    want = streamed([za, zb], [(0, 1)], features=[fa, fb])[0, 1]
    assert row.cka == pytest.approx(want, rel=1e-6)
    assert row.cka == pytest.approx(linear_cka(a, b), abs=0.1)


def test_run_cka_table_equals_the_gram_formula_on_the_stored_rows(planted_run):
    table = analyze(planted_run, "cka", Options(window_rows=5, slab_bytes=1))["cka"]
    assert len(table) == 3 and (table.samples == N).all() and (table.method == "exact").all()
    for row in table.itertuples():
        a, b = (pooled(planted_run / "probe.h5", layer) for layer in (row.layer_a, row.layer_b))
        assert row.cka == pytest.approx(cka_gram(a, b), rel=1e-6), (row.layer_a, row.layer_b)


def test_rows_with_nan_are_left_out(planted_run, tmp_path):
    run = tmp_path / "nan"
    run.mkdir()
    (run / "probe.h5").write_bytes((planted_run / "probe.h5").read_bytes())
    with h5py.File(run / "probe.h5", "r+") as f:
        f["layers/destroy/output"][10, 4, 0, 0] = np.nan
    rf = RunColumns(run, Options())
    try:
        usable = rf.usable
        assert not usable[10] and usable.sum() == N - 1
    finally:
        rf.close()
    cka = analyze(run, "cka")["cka"].set_index(["layer_a", "layer_b"])
    keep = np.arange(N) != 10
    a, b = pooled(run / "probe.h5", "carry")[keep], pooled(planted_run / "probe.h5", "head")[keep]
    assert cka.loc[("carry", "head"), "cka"] == pytest.approx(cka_gram(a, b), rel=1e-6)


def test_token_rows_are_skipped_and_token_layouts_pooled_per_sample(tmp_path):
    """A tiny GPT-2: one block kept a row per token (skipped), one reduced with token_mean, one
    stored whole (N, T, C) and averaged over its tokens by the analysis."""
    from transformers import AutoModelForCausalLM

    from probe.testing.tiny_lms import make_tiny

    model = AutoModelForCausalLM.from_pretrained(make_tiny("gpt2", tmp_path / "gpt2", 40))
    ids = torch.randint(1, 40, (24, 6), generator=torch.Generator().manual_seed(0))
    probes = {
        "tokens": {"layers": ["transformer.h.0"], "rows": "tokens"},
        "mean": {"layers": ["transformer.h.1"], "reduce": "token_mean"},
        "whole": {"layers": ["transformer.ln_f"]},
    }
    batches = [{"input_ids": ids[i : i + 8]} for i in range(0, 24, 8)]
    probe.run(model, batches, probes, out=tmp_path / "run", progress=False).close()
    table = analyze(tmp_path / "run", "cka", Options(window_rows=5))["cka"]
    assert list(zip(table.layer_a, table.layer_b, strict=True)) == [
        ("transformer.h.1", "transformer.ln_f")
    ]
    with open_probe_file(tmp_path / "run" / "probe.h5") as f:
        mean = f["layers/transformer.h.1/output"][:].astype(np.float64)
        whole = f["layers/transformer.ln_f/output"][:].astype(np.float64)
    assert mean.shape == (24, 32) and whole.shape == (24, 6, 32)
    assert table.cka.iloc[0] == pytest.approx(cka_gram(mean, whole.mean(axis=1)), rel=1e-6)


# -- the command line --------------------------------------------------------------------------
def analyze_cli(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "probe.analyze", *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_writes_both_tables_of_a_run(planted_run, tmp_path):
    run = tmp_path / "copy"
    run.mkdir()
    (run / "probe.h5").write_bytes((planted_run / "probe.h5").read_bytes())
    for what in ("linear", "cka"):
        out = analyze_cli(run, what)
        assert out.returncode == 0, out.stderr
    lin, cka = pd.read_csv(run / "linear_probes.csv"), pd.read_csv(run / "cka.csv")
    assert set(LINEAR_REQUIRED) <= set(lin.columns) and set(CKA_REQUIRED) <= set(cka.columns)
    assert (lin.run.astype(str) == "copy").all()
    api = analyze(planted_run, "all")
    pd.testing.assert_frame_equal(lin.drop(columns="run"), api["linear"].drop(columns="run"))
    pd.testing.assert_frame_equal(cka.drop(columns="run"), api["cka"].drop(columns="run"))
    if (run / "linear_probes.parquet").exists():
        pd.testing.assert_frame_equal(pd.read_parquet(run / "linear_probes.parquet"), lin)


def test_cli_on_a_sweep_of_two_runs(tmp_path):
    sweep = tmp_path / "sweep"
    out = planted_cli(
        tmp_path, "-m", "+model.kwargs.mix=0.5", "seed=0,1", f"hydra.sweep.dir={sweep}"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    out = analyze_cli(sweep, "all")
    assert out.returncode == 0, out.stderr
    lin, cka = pd.read_csv(sweep / "linear_probes.csv"), pd.read_csv(sweep / "cka.csv")
    assert set(LINEAR_REQUIRED + ["seed"]) <= set(lin.columns)
    assert sorted(zip(lin.run, lin.seed, lin.layer, strict=True)) == [
        (0, 0, "carry"), (0, 0, "destroy"), (1, 1, "carry"), (1, 1, "destroy")
    ]  # fmt: skip
    assert set(CKA_REQUIRED + ["run_a", "run_b"]) <= set(cka.columns)
    assert sorted(cka.layer_a) == ["carry", "destroy"] and (cka.layer_a == cka.layer_b).all()
    for row in cka.itertuples():  # the same layer in the two runs, against the Gram formula
        a, b = (pooled(sweep / str(r) / "probe.h5", row.layer_a) for r in (row.run_a, row.run_b))
        assert row.cka == pytest.approx(cka_gram(a, b), rel=1e-6)
        assert row.cka < 0.999  # the runs' seeds mix the channels differently
    for run in ("0", "1"):  # and each run's own table
        own = pd.read_csv(sweep / run / "linear_probes.csv")
        mine = lin.loc[lin.run == int(run), own.columns].reset_index(drop=True)
        pd.testing.assert_frame_equal(own, mine)
