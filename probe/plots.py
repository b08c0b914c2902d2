"""Figures of a run or a sweep (matplotlib, Agg backend): statistics across depth, histograms per
layer, and one sample's feature maps. Each function returns the Figure; scripts/ save them."""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from probe.summarize import COLUMNS  # noqa: E402

DEPTH_PANELS = (("mean", "output"), ("std", "output"), ("frac_zero", "output"))
GRAD_PANEL = ("l2_mean", "grad_output")


def depth_rows(table: pd.DataFrame, site: str) -> pd.DataFrame:
    """Rows of one site in layer order (the table's order); empty if the site was not captured."""
    return table[table["site"] == site]


def depth_figure(table: pd.DataFrame, title: str = "") -> plt.Figure:
    """mean, std, frac_zero of each layer's output and the mean per-sample gradient norm against
    layer order; a sweep table (with a `run` column) gets one line per run on the same axes, over
    relative depth (0 first layer, 1 last) when its runs hold different layers."""
    panels = [*DEPTH_PANELS, GRAD_PANEL]
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 2.6 * len(panels)), squeeze=False)
    groups = list(table.groupby("run", sort=False)) if "run" in table else [(None, table)]
    where = "in this run" if len(groups) == 1 else "in these runs"
    for ax, (column, site) in zip(axes[:, 0], panels, strict=True):
        name = (
            "grad norm (l2_mean of grad_output)" if site == "grad_output" else f"{column} ({site})"
        )
        ax.set_ylabel(name, fontsize=8)
        lines = [(run, rows) for run, part in groups if not (rows := depth_rows(part, site)).empty]
        if not lines:
            ax.text(0.5, 0.5, f"no {site} sites {where}", ha="center", transform=ax.transAxes)
            continue
        layers = [list(rows["layer"]) for _, rows in lines]
        shared = all(names == layers[0] for names in layers)
        for run, rows in lines:
            x = np.arange(len(rows)) if shared else np.linspace(0, 1, len(rows))
            label = None if run is None else run_label(rows, run)
            ax.plot(x, rows[column].to_numpy(), marker="o", label=label)
        if shared:
            ax.set_xticks(np.arange(len(layers[0])), layers[0], rotation=60, ha="right", fontsize=6)
        else:
            ax.set_xlabel("relative depth (0 first layer, 1 last)", fontsize=7)
        if len(groups) > 1:
            ax.legend(fontsize=6)
    axes[-1, 0].set_xlabel(axes[-1, 0].get_xlabel() or "layer (execution order)")
    fig.suptitle(title or "statistics across depth")
    fig.tight_layout()
    return fig


def run_label(part: pd.DataFrame, run) -> str:
    """'3: model=vgg11 probes=all_convs' from a sweep table's override columns."""
    overrides = [c for c in part.columns if c not in ("run", "status", *COLUMNS)]
    values = part.iloc[0]
    return " ".join([f"{run}:", *(f"{c}={values[c]}" for c in overrides)])


def histogram_counts(midpoints, counts, lo: float, hi: float, bins: int = 60):
    """Re-bin the sketch's fine buckets into `bins` equal-width bins over [lo, hi]."""
    if not math.isfinite(lo) or not math.isfinite(hi) or hi <= lo:
        lo, hi = (lo - 0.5, lo + 0.5) if math.isfinite(lo) else (-0.5, 0.5)
    values = np.clip(midpoints, lo, hi)
    return np.histogram(values, bins=bins, range=(lo, hi), weights=counts)


def histogram_figure(run, sites=("output",), bins: int = 60, max_panels: int = 48) -> plt.Figure:
    """One histogram per (layer, site) of the run, from its quantile sketch (log y axis)."""
    keys = [k for k in run.keys if k[1] in sites][:max_panels] or run.keys[:max_panels]
    cols = min(4, max(1, len(keys)))
    rows = max(1, math.ceil(len(keys) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.4 * rows), squeeze=False)
    for ax in axes.flat[len(keys) :]:
        ax.axis("off")
    for ax, (layer, site) in zip(axes.flat, keys, strict=False):
        stats = run.stats(layer, site)
        mids, counts = stats.hist.ordered()
        heights, edges = histogram_counts(mids, counts, stats.min, stats.max, bins)
        ax.bar(edges[:-1], heights, width=np.diff(edges), align="edge", log=True)
        ax.set_title(f"{layer} {site}", fontsize=7)
        ax.tick_params(labelsize=6)
    fig.tight_layout()
    return fig


def features_figure(array: np.ndarray, title: str = "", max_maps: int = 64) -> plt.Figure:
    """A grid of one sample's feature maps (C, H, W), one image per channel (the first max_maps)."""
    a = np.asarray(array, dtype=np.float32)
    if a.ndim == 1:
        a = a[:, None, None]
    elif a.ndim == 2:
        a = a[None]
    elif a.ndim > 3:
        a = a.reshape(a.shape[0], a.shape[1], -1)
    maps = a[:max_maps]
    cols = math.ceil(math.sqrt(len(maps)))
    rows = math.ceil(len(maps) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(1.6 * cols, 1.6 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for i, (ax, m) in enumerate(zip(axes.flat, maps, strict=False)):
        ax.imshow(m, cmap="viridis", interpolation="nearest")
        ax.set_title(str(i), fontsize=6)
    fig.suptitle(title)
    fig.tight_layout()
    return fig
