"""Probes on token rows: a label per token (/tokens/label; -1 is left out), read through the run's
training stream (probe.read.stream) in file order, one window at a time.

The linear probe is the closed-form ridge of probe.analysis.linear_probe, held out by sequence (no
sample gives rows to both sides). `control` adds Hewitt and Liang's (2019) control task: each
word type (token id) gets a fixed random label drawn from the real labels' distribution, seeded,
and the same probe is fitted to it in the same pass; selectivity = accuracy - control accuracy
exposes a probe that memorises word identity. `mlp` adds probe.analysis.mlp_probe.
"""

from __future__ import annotations

import logging

import numpy as np

from probe.analysis.cka import CountSketch, sketch_seed
from probe.analysis.linear_probe import RidgeFit, Scores, split
from probe.analysis.mlp_probe import mlp_accuracy
from probe.read.stream import sources_of

log = logging.getLogger("probe")
WINDOW_ROWS = 8192


def control_labels(types: np.ndarray, labels: np.ndarray, seed: int) -> np.ndarray:
    """Each type's fixed label drawn from the distribution of the labels >= 0, the same for every
    row of that type (and -1 where the real label is -1)."""
    real = labels[labels >= 0]
    classes, counts = np.unique(real, return_counts=True)
    kinds, at = np.unique(types, return_inverse=True)
    drawn = np.random.default_rng(seed).choice(classes, size=len(kinds), p=counts / counts.sum())
    return np.where(labels >= 0, drawn[at], -1)


def token_rows(run, layer: str, site: str, options) -> dict | None:
    """One row of linear_probes.csv for a token-row dataset of a run with /tokens/label; None
    when fewer than two classes are labelled."""
    (source,) = sources_of(run, layer, site)
    ranges: list[np.ndarray] = [np.arange(lo, hi) for lo, hi in source.ranges]
    f, picked = run.file, np.concatenate(ranges or [np.empty(0)])
    picked = picked.astype(np.int64)
    sample, token, label = (
        f[f"tokens/{k}"][: run.num_tokens][picked] for k in ("sample", "id", "label")
    )
    classes, y = np.unique(label, return_inverse=True)
    y = np.where(label >= 0, y - int((classes < 0).sum()), -1)
    classes = classes[classes >= 0]
    if len(classes) < 2:
        log.info("%s %s: fewer than 2 labelled classes: no token probe", layer, site)
        return None
    samples = np.unique(sample)
    held_out = np.isin(sample, samples[split(len(samples), options.test_fraction, options.seed)])
    targets = [y]
    if options.control:
        targets.append(control_labels(token, y, options.seed + 1))
    source_width = int(np.prod(source.shape, dtype=np.int64))
    sketch = None
    if source_width > options.max_features:
        seed = sketch_seed(options.seed, str(run.path.name), layer, site)
        sketch = CountSketch(source_width, options.max_features, seed)

    def windows():
        lo = 0
        stream = run.dataset(layer, site, batch_size=WINDOW_ROWS, shuffle=False)
        for rows, _ in stream:
            x = rows.numpy().reshape(len(rows), -1).astype(np.float64)
            yield lo, x if sketch is None else sketch(x)
            lo += len(x)

    row = _ridge(windows, targets, y >= 0, held_out, len(classes), options.ridge)
    row.update(rows="tokens", source_features=source_width,
               reduce="flatten" if len(source.shape) > 1 else "none")  # fmt: skip
    if options.control:
        row["selectivity"] = row["accuracy"] - row["control_accuracy"]
    if options.probe == "mlp":
        train, test = (row_mask & (y >= 0) & row["finite"] for row_mask in (~held_out, held_out))
        found = mlp_accuracy(windows, targets, train, test, options.seed)
        row["mlp_accuracy"] = found[0]
        if options.control:
            row["mlp_control_accuracy"] = found[1]
            row["mlp_selectivity"] = found[0] - found[1]
    del row["finite"]
    return row


def _ridge(windows, targets: list[np.ndarray], labelled: np.ndarray, held_out: np.ndarray,
           classes: int, ridge: float) -> dict:  # fmt: skip
    """The ridge probe of every class-index array in `targets` fitted together in one pass (a
    ridge fit is independent per target column), scored in a second."""
    finite = np.ones(len(labelled), bool)
    fit: RidgeFit | None = None
    for lo, x in windows():
        hi = lo + len(x)
        finite[lo:hi] = np.isfinite(x).all(axis=1)
        sel = labelled[lo:hi] & ~held_out[lo:hi] & finite[lo:hi]
        if fit is None:
            fit = RidgeFit(x.shape[1], classes * len(targets))
        fit.update(x[sel], np.concatenate([_onehot(t[lo:hi][sel], classes) for t in targets], 1))
    train, test = labelled & ~held_out & finite, labelled & held_out & finite
    assert fit is not None  # the rows of two classes or more: a slab at least
    model = fit.solve(ridge)
    scores = [(Scores(), Scores()) for _ in targets]
    for lo, x in windows():
        hi = lo + len(x)
        for sel, side in ((test[lo:hi], 0), (train[lo:hi], 1)):
            s = model.scores(x[sel])
            for k, t in enumerate(targets):
                scores[k][side].update(s[:, k * classes : (k + 1) * classes], t[lo:hi][sel])
    counts = np.bincount(targets[0][test], minlength=classes)
    row = {
        "features": fit.sum.shape[0], "samples_train": int(train.sum()),
        "samples_test": int(test.sum()), "accuracy": scores[0][0].accuracy,
        "loss": scores[0][0].loss, "chance": counts.max() / max(counts.sum(), 1),
        "classes": classes, "accuracy_train": scores[0][1].accuracy, "finite": finite,
    }  # fmt: skip
    if len(targets) > 1:
        row["control_accuracy"] = scores[1][0].accuracy
    return row


def _onehot(y: np.ndarray, classes: int) -> np.ndarray:
    out = np.zeros((len(y), classes))
    out[np.arange(len(y)), y] = 1.0
    return out
