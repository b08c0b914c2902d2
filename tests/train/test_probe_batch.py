"""The probe batch: a fixed batch evaluated every K steps of the training, stored as a probing
run per step that the existing analyses read. CKA between steps equals a numpy CKA of the same
batch's features taken by hand from the model at those steps; top-k examples equal a brute-force
top-k; the training's flags, buffers and random states are as they were."""

from __future__ import annotations

import copy
import os
import random
import subprocess
import sys

import numpy as np
import pandas as pd
import torch

import probe
from probe.testing.trainings import cnn, image_batches, image_loss, train
from tests.helpers import ROOT


def numpy_cka(x: np.ndarray, y: np.ndarray) -> float:
    x = x.astype(np.float64) - x.mean(axis=0)
    y = y.astype(np.float64) - y.mean(axis=0)
    return float(np.linalg.norm(y.T @ x) ** 2 / (np.linalg.norm(x.T @ x) * np.linalg.norm(y.T @ y)))


def features_by_hand(model, x) -> dict[str, np.ndarray]:
    """fc's output and layer2's channel means (the analyses' pooled features) of `x`, from a
    copy of the model in eval mode."""
    twin = copy.deepcopy(model).eval()
    got = {}
    twin.fc.register_forward_hook(lambda m, a, out: got.update(fc=out.numpy().copy()))
    twin.layer2.register_forward_hook(
        lambda m, a, out: got.update(layer2=out.mean(dim=(2, 3)).numpy().copy())
    )
    with torch.no_grad():
        twin(x)
    return got


def test_cka_across_steps_and_topk_of_the_probe_batch(tmp_path):
    """6 steps, the probe batch at steps 0, 2, 4, 6 (6: after the last update); `python -m
    probe.analyze RUN cka` gives CKA between every two steps."""
    x = torch.randn(16, 3, 8, 8, generator=torch.Generator().manual_seed(5))
    y = torch.arange(16) % 4
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    by_hand = {0: features_by_hand(model, x)}

    def look(step, model, optimizer, phase):
        if phase == "after" and (step + 1) % 2 == 0:
            by_hand[step + 1] = features_by_hand(model, x)

    probes = {"net": {"layers": ["layer2", "fc"], "capture": ["output", "grad_output"]}}
    watch = {"probes": probes, "out": tmp_path / "run", "probe_batch": (x, y), "probe_every": 2,
             "probe_stats": {"topk": 3}}  # fmt: skip
    train(model, opt, image_batches(6), image_loss, watch, hand=look)
    assert sorted(by_hand) == [0, 2, 4, 6]

    done = subprocess.run(
        [sys.executable, "-m", "probe.analyze", str(tmp_path / "run"), "cka"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    table = pd.read_csv(tmp_path / "run" / "probe_batch" / "cka.csv")
    assert len(table) == 6 * 2  # every two steps of 4, two layers
    for row in table.itertuples():
        assert row.layer_a == row.layer_b and row.samples == 16
        want = numpy_cka(by_hand[row.run_a][row.layer_a], by_hand[row.run_b][row.layer_b])
        np.testing.assert_allclose(row.cka, want, rtol=1e-5)
    assert table["cka"].min() < 0.999  # (the features moved: the comparison means something)

    with probe.open_run(tmp_path / "run" / "probe_batch" / "4") as run:
        stored = run.array("fc", "output")[:]
        np.testing.assert_allclose(stored, by_hand[4]["fc"], rtol=1e-5, atol=1e-6)
        kept = run.topk("fc", "output", unit=1)
    want = np.argsort(-by_hand[4]["fc"][:, 1], kind="stable")[:3]
    assert list(kept["sample"]) == list(want)


def test_the_probe_batch_leaves_flags_buffers_and_random_states_as_they_were(tmp_path):
    """A user's module kept in eval mode stays so, BatchNorm's running statistics and every
    random generator (torch's, Python's, numpy's) are where the training left them."""
    model = cnn()
    model.bn1.eval()  # the user's choice: bn1 frozen
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    w = probe.watch(model, {"fc": {"layers": ["fc"]}}, out=tmp_path, probe_batch=x)
    with w:  # (the batch runs at start: step 0)
        got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]
    assert model.training and not model.bn1.training and model.layer1.bn.training
    for k, v in model.named_buffers():
        assert torch.equal(v, buffers[k]), k
    assert (tmp_path / "probe_batch" / "0" / "probe.h5").is_file()
