"""Linear probes fitted in one streamed pass: ridge regression on one-hot targets.

Closed-form ridge needs only X^T X, X^T Y and the feature sums, which add up exactly over row slabs:
one pass over the file gives an in-memory fit's weights, in memory independent of the sample count,
with nothing to tune and nothing random but the split. scikit-learn's streaming fits are approximate
and its exact ones want the data in memory; numpy keeps torch out of the analysis process (but for
--probe mlp and token rows, read through the torch stream: probe.analysis.token_probe).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import pandas as pd

log = logging.getLogger("probe")
LINEAR_COLUMNS = [
    "run", "layer", "site", "rows", "features", "samples_train", "samples_test", "accuracy",
    "loss", "chance", "classes", "accuracy_train", "source_features", "reduce",
    "control_accuracy", "selectivity", "mlp_accuracy", "mlp_control_accuracy", "mlp_selectivity",
]  # fmt: skip


def split(n: int, test_fraction: float, seed: int) -> np.ndarray:
    """A boolean mask of the held-out rows among n: round(test_fraction * n) rows (at least one
    row on each side when n >= 2) drawn by a generator seeded with `seed`; the same for every
    layer of a run, and for runs of the same size."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction={test_fraction} must lie strictly between 0 and 1")
    n_test = min(max(1, round(test_fraction * n)), n - 1) if n >= 2 else 0
    held_out = np.zeros(n, dtype=bool)
    held_out[np.random.default_rng(seed).permutation(n)[:n_test]] = True
    return held_out


def class_labels(targets: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(class index per row, the label of each class) of 1-D integer-valued targets; None when
    they are not class labels (more than one value per sample, or fractional values)."""
    targets = np.asarray(targets)
    if targets.ndim != 1 or targets.dtype.kind not in "iubf":
        return None
    if targets.dtype.kind == "f" and not np.all(
        np.isfinite(targets) & (targets == np.round(targets))
    ):
        return None
    labels, index = np.unique(targets, return_inverse=True)
    return index.astype(np.int64), labels


@dataclass
class RidgeClassifier:
    """Scores (x - center) @ weights + bias; the predicted class is the largest score."""

    center: np.ndarray  # (features,)
    weights: np.ndarray  # (features, classes)
    bias: np.ndarray  # (classes,)

    def scores(self, x: np.ndarray) -> np.ndarray:
        return (np.asarray(x, np.float64) - self.center) @ self.weights + self.bias


class RidgeFit:
    """Accumulates the moments of (features, one-hot targets) over row slabs; `solve` gives the
    ridge classifier on standardised features. `shift` (any fixed vector near the mean, e.g. the
    feature means) keeps the sums small, so the centring loses no precision."""

    def __init__(self, features: int, classes: int, shift: np.ndarray | None = None):
        self.classes = classes
        self.shift = np.zeros(features) if shift is None else np.asarray(shift, np.float64)
        self.n = 0
        self.sum = np.zeros(features)
        self.xx: np.ndarray | None = np.zeros((features, features))  # X^T X; None once solved
        self.xy = np.zeros((features, classes))
        self.counts = np.zeros(classes)

    def update(self, x: np.ndarray, y: np.ndarray) -> None:
        """Rows x (n, features) with class indices y (n,), or their targets (n, classes)."""
        if not len(x):
            return
        xc = np.array(x, np.float64)
        xc -= self.shift
        if y.ndim == 2:
            onehot = y
        else:
            onehot = np.zeros((len(y), self.classes))
            onehot[np.arange(len(y)), y] = 1.0
        xx = self.xx
        assert xx is not None, "solved already"
        self.n += len(x)
        self.sum += xc.sum(axis=0)
        for r in range(0, len(xx), 256):  # xx += xc^T xc with a small temporary
            xx[r : r + 256] += xc[:, r : r + 256].T @ xc
        self.xy += xc.T @ onehot
        self.counts += onehot.sum(axis=0)

    def solve(self, ridge: float) -> RidgeClassifier:
        """Minimise mean ||y - (x - mean) W - ybar||^2 + ridge ||D W||^2 with D the feature
        standard deviations: ridge on standardised features, in closed form. Works in place on
        the accumulated X^T X (the fit is solved once): about 2 features^2 float64 at its peak."""
        if self.n == 0 or self.xx is None:
            raise ValueError("no training rows, or solved already")
        mean = self.sum / self.n
        cov, self.xx = self.xx, None
        cov /= self.n
        for lo in range(0, len(mean), 256):  # cov -= mean mean^T, without a second matrix
            cov[lo : lo + 256] -= np.outer(mean[lo : lo + 256], mean)
        ybar = self.counts / self.n
        cross = self.xy / self.n - np.outer(mean, ybar)
        std = np.sqrt(np.clip(np.diag(cov), 0.0, None))
        scale = np.where(std > 1e-12 * max(1.0, float(std.max(initial=0.0))), std, np.inf)
        cov /= scale[:, None]
        cov /= scale[None, :]  # the correlation matrix
        cov[np.diag_indices_from(cov)] += ridge
        constant = np.flatnonzero(~np.isfinite(scale))
        cov[constant, constant] = 1.0  # their columns are zero: any positive value will do
        w_std = np.linalg.solve(cov, cross / scale[:, None])
        return RidgeClassifier(mean + self.shift, w_std / scale[:, None], ybar)


@dataclass
class Scores:
    """Accuracy and one-hot squared error accumulated over the rows of one set."""

    n: int = 0
    correct: int = 0
    squared_error: float = 0.0

    def update(self, scores: np.ndarray, y: np.ndarray) -> None:
        if not len(y):
            return
        self.n += len(y)
        self.correct += int(np.sum(scores.argmax(axis=1) == y))
        err = scores.copy()
        err[np.arange(len(y)), y] -= 1.0
        self.squared_error += float(np.sum(err * err))

    @property
    def accuracy(self) -> float:
        return self.correct / self.n if self.n else float("nan")

    @property
    def loss(self) -> float:
        return self.squared_error / self.n if self.n else float("nan")


def probe_layer(
    windows: Callable[[], Iterable[tuple[int, np.ndarray]]],
    y: np.ndarray,
    classes: int,
    held_out: np.ndarray,
    usable: np.ndarray,
    ridge: float,
    shift: np.ndarray | None = None,
) -> dict:
    """Fit on the usable training rows, score both sets: `windows()` yields (first row, features)
    slabs in row order and is called twice (fit, then evaluation). y holds class indices."""
    train, test = usable & ~held_out, usable & held_out
    fit: RidgeFit | None = None
    for lo, x in windows():
        if fit is None:
            fit = RidgeFit(x.shape[1], classes, shift)
        keep = train[lo : lo + len(x)]
        fit.update(x[keep], y[lo : lo + len(x)][keep])
    row: dict[str, float] = {"samples_train": int(train.sum()), "samples_test": int(test.sum())}
    test_counts = np.bincount(y[test], minlength=classes)
    row["chance"] = test_counts.max() / test_counts.sum() if test_counts.sum() else float("nan")
    if fit is None or fit.n == 0 or not test.any():
        return {
            **row,
            "accuracy": float("nan"),
            "loss": float("nan"),
            "accuracy_train": float("nan"),
        }
    model = fit.solve(ridge)
    on_train, on_test = Scores(), Scores()
    for lo, x in windows():
        hi = lo + len(x)
        sel = usable[lo:hi]
        s, labels, is_test = model.scores(x[sel]), y[lo:hi][sel], held_out[lo:hi][sel]
        on_test.update(s[is_test], labels[is_test])
        on_train.update(s[~is_test], labels[~is_test])
    return {
        **row,
        "accuracy": on_test.accuracy,
        "loss": on_test.loss,
        "accuracy_train": on_train.accuracy,
    }


def run_table(rf) -> pd.DataFrame | None:
    """One row per (layer, site) of a run's sample-row features
    (`probe.analysis.streamed_analyses.RunColumns`): held-out accuracy and loss of a ridge probe (and of
    an MLP with --probe mlp); None when the run has no class targets. (Control tasks are defined
    over word types: token rows, probe.analysis.token_probe.)"""
    if rf.targets is None:
        log.info("%s: no /samples/target: no linear probes", rf.path)
        return None
    labels = class_labels(rf.targets)
    if labels is None or len(labels[1]) < 2:
        log.info("%s: /samples/target is not 2 or more class labels: no linear probes", rf.path)
        return None
    y, names = labels
    opts = rf.options
    held_out = split(len(y), opts.test_fraction, opts.seed)
    rows = []
    for item in rf.items:
        n = min(len(y), len(item.usable))
        usable = np.zeros(len(y), dtype=bool)
        usable[:n] = item.usable[:n]

        def windows(item=item, n=n):
            for lo, x in rf.windows(item, rf.step(item.width)):
                yield lo, x[: max(0, n - lo)]

        result = probe_layer(
            windows, y, len(names), held_out, usable, opts.ridge, item.features.shift
        )
        if opts.probe == "mlp":
            from probe.analysis.mlp_probe import mlp_accuracy

            def float64_windows(w=windows) -> Iterator[tuple[int, np.ndarray]]:
                return ((lo, x.astype(np.float64)) for lo, x in w())

            (result["mlp_accuracy"],) = mlp_accuracy(
                float64_windows, [y], usable & ~held_out, usable & held_out, opts.seed
            )
        rows.append(
            {
                "run": rf.name,
                "layer": item.layer,
                "site": item.site,
                "rows": "samples",
                "features": item.width,
                "classes": len(names),
                "source_features": item.features.source_width or item.width,
                "reduce": item.reduce,
                **result,
            }
        )
    return pd.DataFrame(rows, columns=LINEAR_COLUMNS)
