"""Figures of a run or a sweep (matplotlib, Agg backend): statistics across depth, histograms per
layer, one sample's feature maps and Linear layers' unit-by-sample heatmaps. Each function returns
the Figure so that tests can read back what was drawn; probe.report.figures saves them."""

from __future__ import annotations

import math
from fnmatch import fnmatchcase

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from probe.read.tables import summary_columns  # noqa: E402

# (column, site) per panel; the first is drawn as a p01-p99 band around the mean
DEPTH_PANELS = (("mean", "output"), ("std", "output"), ("dead_frac", "output"))
GRAD_PANEL = ("l2_mean", "grad_output")
OUTPUT_SITES = ("output",)
GRADIENT_SITES = ("grad_output", "grad_input", "param_grad.*")
LABEL_COLUMNS = ("run", "status")


def depth_rows(table: pd.DataFrame, site: str) -> pd.DataFrame:
    """Rows of one site in layer order (the table's order); empty if the site was not captured."""
    return table[table["site"] == site]


def override_columns(table: pd.DataFrame) -> list[str]:
    """The override columns of a sweep table (everything not a summary column)."""
    known = {*LABEL_COLUMNS, *summary_columns()}
    return [c for c in table.columns if c not in known]


def differing_overrides(table: pd.DataFrame) -> list[str]:
    """Override columns whose value is not the same for every run: what tells runs apart."""
    if "run" not in table:
        return []
    per_run = table.groupby("run", sort=False).first()
    return [
        c
        for c in override_columns(table)
        if per_run[c].astype(str).nunique(dropna=False) > 1 or per_run[c].isna().nunique() > 1
    ]


def run_label(part: pd.DataFrame, run, columns: list[str] | None = None) -> str:
    """'3: model=vgg11' from a sweep table's rows of one run, naming only `columns` (default:
    every override column)."""
    columns = override_columns(part) if columns is None else columns
    values = part.iloc[0]
    return " ".join([f"{run}:", *(f"{c}={values[c]}" for c in columns)])


def depth_figure(table: pd.DataFrame, title: str = "") -> plt.Figure | None:
    """Each layer's output mean inside its p01-p99 band, its std and dead-unit fraction, and the
    mean per-sample gradient norm against layer order. A sweep table (with a `run` column) gets
    one line per run, labelled by the overrides that differ, over relative depth (0 first layer,
    1 last) when its runs hold different layers. Only panels with values are drawn; None when
    the table has neither output nor grad_output sites."""
    groups = list(table.groupby("run", sort=False)) if "run" in table else [(None, table)]
    panels = [(column, site) for column, site in (*DEPTH_PANELS, GRAD_PANEL)
              if any(not depth_rows(part, site).empty for _, part in groups)]  # fmt: skip
    if not panels:
        return None
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 2.6 * len(panels)), squeeze=False)
    differ = differing_overrides(table)
    for ax, (column, site) in zip(axes[:, 0], panels, strict=True):
        names = {
            "l2_mean": "grad norm (l2_mean of grad_output)",
            "mean": "mean, p01-p99 band (output)",
            "dead_frac": "dead unit fraction (output)",
        }
        ax.set_ylabel(names.get(column, f"{column} ({site})"), fontsize=8)
        lines = [(run, rows) for run, part in groups if not (rows := depth_rows(part, site)).empty]
        layers = [list(rows["layer"]) for _, rows in lines]
        shared = all(names == layers[0] for names in layers)
        for run, rows in lines:
            x = np.arange(len(rows)) if shared else np.linspace(0, 1, len(rows))
            label = None if run is None else run_label(rows, run, differ)
            (line,) = ax.plot(x, rows[column].to_numpy(dtype=float), marker="o", label=label)
            if column == "mean":
                lo, hi = rows["p01"].to_numpy(dtype=float), rows["p99"].to_numpy(dtype=float)
                ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
        if shared:
            ax.set_xticks(np.arange(len(layers[0])), layers[0], rotation=60, ha="right", fontsize=6)
        else:
            ax.set_xlabel("relative depth (0 first layer, 1 last)", fontsize=7)
        if len(groups) > 1:
            ax.legend(fontsize=6)
    axes[-1, 0].set_xlabel(axes[-1, 0].get_xlabel() or "layer (execution order)")
    fig.suptitle(title or "statistics across depth", fontsize=9)
    fig.tight_layout()
    return fig


def histogram_counts(midpoints, counts, lo: float, hi: float, bins: int = 60):
    """Re-bin the sketch's fine buckets into `bins` equal-width bins over [lo, hi]."""
    if not math.isfinite(lo) or not math.isfinite(hi) or hi <= lo:
        lo, hi = (lo - 0.5, lo + 0.5) if math.isfinite(lo) else (-0.5, 0.5)
    values = np.clip(midpoints, lo, hi)
    return np.histogram(values, bins=bins, range=(lo, hi), weights=counts)


def site_keys(run, sites=OUTPUT_SITES) -> list[tuple[str, str]]:
    """The run's (layer, site) pairs whose site matches one of the fnmatch patterns `sites`."""
    return [k for k in run.keys if any(fnmatchcase(k[1], p) for p in sites)]


def histogram_figure(
    run, sites=OUTPUT_SITES, bins: int = 60, max_panels: int = 48, title: str = ""
) -> plt.Figure | None:
    """One histogram per (layer, site) matching `sites` (fnmatch patterns), from the run's
    quantile sketch (log y axis); None when no site matches."""
    keys = site_keys(run, sites)[:max_panels]
    if not keys:
        return None
    cols = min(4, max(1, len(keys)))
    rows = max(1, math.ceil(len(keys) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.4 * rows + 0.4), squeeze=False)
    for ax in axes.flat[len(keys) :]:
        ax.axis("off")
    for ax, (layer, site) in zip(axes.flat, keys, strict=False):
        stats = run.stats(layer, site)
        mids, counts = stats.hist.ordered()
        heights, edges = histogram_counts(mids, counts, stats.min, stats.max, bins)
        ax.bar(edges[:-1], heights, width=np.diff(edges), align="edge", log=True)
        ax.set_title(f"{layer} {site}", fontsize=7)
        ax.tick_params(labelsize=6)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def feature_maps(array: np.ndarray) -> np.ndarray:
    """One sample's row as (maps, H, W): channels of a conv layout, a single map otherwise."""
    a = np.asarray(array, dtype=np.float32)
    if a.ndim == 1:
        return a[:, None, None]
    if a.ndim == 2:
        return a[None]
    if a.ndim > 3:
        return a.reshape(a.shape[0], a.shape[1], -1)
    return a


def color_limits(values: np.ndarray) -> tuple[float, float]:
    """(min, max) of the finite values, widened when they are all equal."""
    finite = values[np.isfinite(values)]
    if not finite.size:
        return -1.0, 1.0
    lo, hi = float(finite.min()), float(finite.max())
    return (lo - 0.5, hi + 0.5) if lo == hi else (lo, hi)


def features_figure(array: np.ndarray, title: str = "", max_maps: int = 64) -> plt.Figure:
    """A grid of one sample's feature maps (C, H, W), one image per channel (the first max_maps),
    all on the colour scale of the shown maps' min and max, with one colour bar."""
    maps = feature_maps(array)[:max_maps]
    vmin, vmax = color_limits(maps)
    cols = math.ceil(math.sqrt(len(maps)))
    rows = math.ceil(len(maps) / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(max(1.6 * cols + 1, 6), 1.6 * rows + 0.8), squeeze=False
    )
    for ax in axes.flat:
        ax.axis("off")
    image = None
    for i, (ax, m) in enumerate(zip(axes.flat, maps, strict=False)):
        image = ax.imshow(m, cmap="viridis", interpolation="nearest", vmin=vmin, vmax=vmax)
        ax.set_title(str(i), fontsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    if image is not None:
        fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8)
    return fig


def units_figure(
    panels: list[tuple[str, np.ndarray]], title: str = "", max_samples: int = 256
) -> plt.Figure:
    """Linear layers as heatmaps, one per (name, rows (samples, units)): units down, samples
    across (the first max_samples), each on its own colour scale with its colour bar."""
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 2.4 * len(panels) + 0.4), squeeze=False)
    for ax, (name, rows) in zip(axes[:, 0], panels, strict=True):
        data = (
            np.asarray(rows, dtype=np.float32)[:max_samples]
            .reshape(min(len(rows), max_samples), -1)
            .T
        )
        vmin, vmax = color_limits(data)
        image = ax.imshow(
            data, aspect="auto", cmap="viridis", interpolation="nearest", vmin=vmin, vmax=vmax
        )
        ax.set_title(name, fontsize=7)
        ax.set_ylabel("unit", fontsize=7)
        ax.tick_params(labelsize=6)
        fig.colorbar(image, ax=ax)
    axes[-1, 0].set_xlabel("sample", fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def probes_figure(table: pd.DataFrame, title: str = "") -> plt.Figure:
    """linear_probes.csv by depth (layers in the table's order): held-out accuracy (and the
    MLP's) over chance, and with control tasks the control accuracy and the selectivity; one
    line per (run, site, rows)."""
    table = table.assign(rows=table["rows"].fillna("samples") if "rows" in table else "samples")
    control = "selectivity" in table and bool(table["selectivity"].notna().any())
    panels = 2 if control else 1
    fig, axes = plt.subplots(panels, 1, figsize=(10, 3.2 * panels), squeeze=False)
    layers = list(dict.fromkeys(table["layer"]))
    keys = [k for k in ("run", "site", "rows") if k in table]
    for key, part in table.groupby(keys, sort=False):
        name = " ".join(map(str, key))
        x = [layers.index(layer) for layer in part["layer"]]
        (line,) = axes[0, 0].plot(x, part["accuracy"], marker="o", label=f"{name} accuracy")
        color = line.get_color()
        axes[0, 0].plot(x, part["chance"], ls=":", color=color, label=f"{name} chance")
        for column, style in (("mlp_accuracy", "-."), ("control_accuracy", "--")):
            if column in part and part[column].notna().any():
                axes[0, 0].plot(x, part[column], ls=style, color=color, label=f"{name} {column}")
        if control:
            axes[1, 0].plot(x, part["selectivity"], marker="o", color=color, label=name)
    names = ("held-out accuracy", "selectivity (accuracy - control)")
    for ax, label in zip(axes[:, 0], names, strict=False):
        ax.set_ylabel(label, fontsize=8)
        ax.legend(fontsize=6)
        ax.set_xticks(np.arange(len(layers)), layers, rotation=60, ha="right", fontsize=6)
    fig.suptitle(title or "probes across depth", fontsize=9)
    fig.tight_layout()
    return fig
