"""Token-level probes and control tasks on planted token rows: the probe finds a label where a
layer carries it and chance where it does not, the closed-form fit equals numpy's lstsq, and
selectivity tells a label the layer carries from one it only memorises through word identity."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch

import probe
from probe.analysis.linear_probe import split
from probe.analysis.token_probe import control_labels
from tests.analysis.test_analyze import ridge_reference
from tests.helpers import ROOT, run_probe

N, T, V = 240, 12, 20


def planted(root, name: str, labels: torch.Tensor):
    """A TokenContext run over seeded ids, right-padded rows of 8 to 12 tokens, and this label
    per token (-1 at padding)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(V, (N, T), generator=g)
    lengths = torch.randint(8, T + 1, (N,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    torch.save({"input_ids": ids * mask, "attention_mask": mask,
                "token_labels": torch.where(mask.bool(), labels(ids), -1)}, root / f"{name}.pt")  # fmt: skip
    _, f = run_probe(root / name, "model=custom", "model._target_=probe.testing.models.TokenContext",
                     "dataset=tokens", f"dataset.path={root / f'{name}.pt'}", "dataset.batch_size=32",
                     "+probes.t.layers=[lexical,context,mixed]", "+probes.t.rows=tokens",
                     "probes=none")  # fmt: skip
    f.close()
    return root / name


def previous_parity(ids):
    """Lexical-free: the parity of the previous token (-1 at position 0)."""
    out = torch.full_like(ids, -1)
    out[:, 1:] = ids[:, :-1] % 2
    return out


def word_type(ids):
    """A function of the word type alone: a fixed class of each token id."""
    return torch.tensor([3, 0, 2, 1, 1, 0, 2, 3, 0, 1, 2, 2, 3, 1, 0, 0, 3, 2, 1, 3])[ids]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("token_probes")
    return {
        "parity": planted(root, "parity", previous_parity),
        "type": planted(root, "type", word_type),
    }


def analyze(path, *flags) -> pd.DataFrame:
    out = subprocess.run(
        [sys.executable, "-m", "probe.analyze", str(path), "linear", *flags],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return pd.read_csv(path / "linear_probes.csv").set_index("layer")


def test_a_carried_label_is_found_and_a_missing_one_is_chance(runs):
    table = analyze(runs["parity"], "--control", "--probe", "mlp")
    assert (table["rows"] == "tokens").all()
    context, lexical = table.loc["context"], table.loc["lexical"]
    assert context["accuracy"] >= 0.95 and context["mlp_accuracy"] >= 0.95
    assert abs(lexical["accuracy"] - lexical["chance"]) < 0.08  # (the current word says nothing)
    assert abs(lexical["mlp_accuracy"] - lexical["chance"]) < 0.08
    # lexical-free: the control task (a label per current word type) fails where the label is
    # carried without the word: selectivity is high
    assert context["selectivity"] > 0.35
    assert context["control_accuracy"] < 0.7  # (about its majority class: one of 20 types each)


def test_selectivity_exposes_a_label_of_the_word_type(runs):
    table = analyze(runs["type"], "--control")
    lexical = table.loc["lexical"]
    assert lexical["accuracy"] >= 0.95  # high accuracy ...
    assert abs(lexical["selectivity"]) < 0.05  # ... but the control task does as well
    context = table.loc["context"]  # (the previous word says nothing of this one's type)
    assert abs(context["accuracy"] - context["chance"]) < 0.08


def test_the_closed_form_fit_equals_lstsq(runs):
    """The held-out accuracy and loss of `mixed` equal ridge solved by np.linalg.lstsq on the
    same rows, split by sequence."""
    table = analyze(runs["parity"], "--ridge", "0.01")
    with probe.open_run(runs["parity"]) as run:
        x = run.array("mixed", "output")[:].astype(np.float64)
        tokens = run.tokens()
        labels = run.file["tokens/label"][: run.num_tokens]
    keep = labels >= 0
    samples = np.unique(tokens["sample"])
    held = np.isin(tokens["sample"], samples[split(len(samples), 0.2, 0)])
    want = ridge_reference(x[keep], labels[keep], held[keep], ridge=0.01)
    got = table.loc["mixed"]
    for key in ("accuracy", "loss", "chance", "samples_train", "samples_test"):
        assert got[key] == pytest.approx(want[key], rel=1e-6), key


def test_control_labels_are_a_function_of_the_word_type():
    rng = np.random.default_rng(0)
    types = rng.integers(0, 50, 5000)
    labels = rng.integers(-1, 4, 5000)
    control = control_labels(types, labels, seed=3)
    assert ((control == -1) == (labels == -1)).all()
    for t in np.unique(types):
        assert len(np.unique(control[(types == t) & (labels >= 0)])) <= 1
    drawn = np.bincount(control[control >= 0], minlength=4) / (control >= 0).sum()
    real = np.bincount(labels[labels >= 0], minlength=4) / (labels >= 0).sum()
    assert np.abs(drawn - real).max() < 0.2  # from the real labels' distribution (50 draws)
    assert not (control_labels(types, labels, seed=4) == control).all()


def test_sample_and_token_rows_share_the_table(runs, tmp_path):
    """A run with per-sample targets and token labels: one table, a `rows` column for each."""
    table = analyze(runs["type"])
    assert set(table.columns) >= {"rows", "control_accuracy", "selectivity", "mlp_accuracy"}
    assert table["control_accuracy"].isna().all()  # (asked for with --control only)
