"""A one-hidden-layer probe, trained on row windows with plain torch: the non-linear companion of
the closed-form ridge probe (`python -m probe.analyze linear --probe mlp`).

Features are standardised by the training rows' moments; rows are visited window by window in
a seeded order, so memory is one window, as for the ridge fit. Sizes: MLP below.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypedDict

import numpy as np
import torch


class Sizes(TypedDict):
    hidden: int  # hidden units
    epochs: int
    lr: float
    batch: int  # rows per step
    weight_decay: float


MLP: Sizes = {"hidden": 128, "epochs": 8, "lr": 3e-3, "batch": 256, "weight_decay": 1e-4}

Windows = Callable[[], Iterable[tuple[int, np.ndarray]]]


def mlp_accuracy(windows: Windows, targets: list[np.ndarray], train: np.ndarray,
                 test: np.ndarray, seed: int) -> list[float]:  # fmt: skip
    """Held-out accuracy of one MLP per class-index array in `targets` (all trained in the same
    passes over the windows): `train` and `test` mark the rows of each side."""
    n, total, total_sq = 0, 0.0, 0.0
    for lo, x in windows():
        rows = x[train[lo : lo + len(x)]]
        n, total, total_sq = n + len(rows), total + rows.sum(0), total_sq + (rows * rows).sum(0)
    if n == 0 or not test.any():
        return [float("nan")] * len(targets)
    mean = np.asarray(total / n)  # (the sums are per feature, arrays)
    std = np.sqrt(np.maximum(total_sq / n - mean * mean, 1e-12))
    center, scale = (torch.tensor(v, dtype=torch.float32) for v in (mean, std))
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    nets = [_net(len(mean), int(y.max()) + 1) for y in targets]
    opts = [
        torch.optim.AdamW(net.parameters(), lr=MLP["lr"], weight_decay=MLP["weight_decay"])
        for net in nets
    ]
    for _ in range(MLP["epochs"]):
        for lo, x in windows():
            sel = train[lo : lo + len(x)]
            xs = (torch.from_numpy(x[sel]).float() - center) / scale
            ys = [torch.from_numpy(y[lo : lo + len(x)][sel]) for y in targets]
            order = torch.randperm(len(xs), generator=g)
            for b in range(0, len(xs), MLP["batch"]):
                pick = order[b : b + MLP["batch"]]
                for net, opt, y in zip(nets, opts, ys, strict=True):
                    loss = torch.nn.functional.cross_entropy(net(xs[pick]), y[pick])
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
    correct, seen = np.zeros(len(nets)), 0
    with torch.no_grad():
        for lo, x in windows():
            sel = test[lo : lo + len(x)]
            xs = (torch.from_numpy(x[sel]).float() - center) / scale
            for i, (net, target) in enumerate(zip(nets, targets, strict=True)):
                right = net(xs).argmax(1).numpy() == target[lo : lo + len(x)][sel]
                correct[i] += int(right.sum())
            seen += int(sel.sum())
    return (correct / seen).tolist()


def _net(width: int, classes: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(width, MLP["hidden"]),
        torch.nn.ReLU(),
        torch.nn.Linear(MLP["hidden"], classes),
    )
