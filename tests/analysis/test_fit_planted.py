"""The planted problem (probe.testing.planted): `python -m probe.fit` with its defaults except
the width, the budget and k recovers a tiny GPT-2's MLP dictionary: held-out FVU, dead features
and the share of planted encoder directions found by a learned encoder row (cosine >= 0.9,
computed here from the saved safetensors with plain torch) within TARGETS. The suite runs a
smaller problem than the issue's (SPEC below); the full size, with every activation, is
scripts/bench_fit_planted.py (docs/bench/fit_planted.md)."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from probe.fit import main
from probe.testing.planted import PlantedSpec, capture_run, make_planted

SPEC = PlantedSpec(d_model=32, n_inner=128, n_head=2, sequences=512, calibration_sequences=128,
                   rounds=2)  # fmt: skip
K = round(SPEC.fire_rate * SPEC.n_inner)  # the planted L0 (3.8 a token on average)
EPOCHS = "30"
# an eighth of the full size's rows (512 sequences) in batches of 256: 1,700 steps (the full size
# 3,450 of 1024 rows)
BUDGET = ["--epochs", EPOCHS, "--batch-size", "256"]


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """The small planted problem and a probe run of its MLPs' inputs and outputs (probes=mlp_io);
    on one thread (small matrices)."""
    root = tmp_path_factory.mktemp("planted")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        p = make_planted(root, SPEC)
        capture_run(p, root / "run")
        yield p, root / "run"
    finally:
        torch.set_num_threads(threads)


def fit_on_one_thread(run, flags: list[str]) -> None:
    """`python -m probe.fit RUN FLAGS` in this process, on one thread (small matrices)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main([str(run), *flags]) == 0
    finally:
        torch.set_num_threads(threads)


def found(planted_dir, learned: torch.Tensor, cosine: float = 0.9) -> float:
    """The share of block 0's planted encoder directions (c_fc's columns, read from the saved
    model) whose best learned encoder row has cosine >= `cosine` with them."""
    c_fc = load_file(str(planted_dir / "model.safetensors"))["transformer.h.0.mlp.c_fc.weight"]
    planted = c_fc.T / c_fc.T.norm(dim=1, keepdim=True)
    rows = learned / learned.norm(dim=1, keepdim=True)
    return float(((planted @ rows.T).max(1).values >= cosine).double().mean())


# What the small problem reaches (measured): relu meets the targets; batchtopk, at the
# small problem's planted L0 of 3.8 (a Poisson-like count: half the tokens have more than 4 active
# units, where the full size's 7.4 has a third above 8), FVU 0.14, 11% dead, 88% found. The
# issue's targets for topk, batchtopk and jumprelu are held at the full size
# (docs/bench/fit_planted.md).
TARGETS = {"relu": (0.05, 0.05, 0.9), "batchtopk": (0.15, 0.12, 0.85)}


@pytest.mark.parametrize("activation", list(TARGETS))
def test_the_default_fit_recovers_the_planted_dictionary(planted, tmp_path, activation):
    p, run = planted
    out = tmp_path / activation
    flags = ["--layers", "0", "--width", str(SPEC.n_inner), *BUDGET, "--activation", activation,
             "--out", str(out)]  # fmt: skip
    if activation != "relu":
        flags += ["--k", str(K)]
    fit_on_one_thread(run, flags)
    fit = pd.read_csv(out / "fit.csv").iloc[0]
    tensors = load_file(str(out / "layer_0.safetensors"))
    share = found(p.model_dir, tensors["W_enc"])
    fvu, dead, want = TARGETS[activation]
    assert fit["fvu"] <= fvu and fit["dead"] <= dead and share >= want, (
        fit[["fvu", "l0", "dead"]].to_dict(), share,
    )  # fmt: skip
    if activation == "batchtopk":  # saved as a jumprelu of one learnt threshold
        threshold = tensors["activation_function.threshold"]
        assert (threshold == threshold[0]).all() and threshold[0] > 0
        assert abs(fit["l0"] - K) < 1  # the threshold keeps about k features a row


# jumprelu's defaults (W_dec from 0 with free rows, thresholds from 0.001, kernel width 0.01) to
# the planted L0 at half the budget (15 passes, 960 steps: 9 s): measured FVU 0.061, L0 3.59 for
# its target of 4, no dead feature, 91% found. At the full size and budget it meets the issue's
# targets (docs/bench/fit_planted.md).
JUMP = {"epochs": "15", "fvu": 0.08, "dead": 0.05, "found": 0.88, "l0": 0.25}


def test_the_default_jumprelu_fit_recovers_the_planted_dictionary_at_its_l0_target(
    planted, tmp_path
):
    """jumprelu to the planted L0 (--k K): held-out FVU, dead share and planted directions found
    within JUMP, and held-out L0 within JUMP["l0"] of its target."""
    p, run = planted
    out = tmp_path / "jumprelu"
    flags = ["--layers", "0", "--width", str(SPEC.n_inner), "--epochs", JUMP["epochs"],
             "--batch-size", "256", "--activation", "jumprelu", "--k", str(K), "--out", str(out)]  # fmt: skip
    fit_on_one_thread(run, flags)
    fit = pd.read_csv(out / "fit.csv").iloc[0]
    share = found(p.model_dir, load_file(str(out / "layer_0.safetensors"))["W_enc"])
    got = {**fit[["fvu", "l0", "dead"]].to_dict(), "found": share}
    assert fit["fvu"] <= JUMP["fvu"] and fit["dead"] <= JUMP["dead"], got
    assert share >= JUMP["found"], got
    assert abs(fit["l0"] - K) <= JUMP["l0"] * K, got
