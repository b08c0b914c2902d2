"""Figures of a watched training (`probe.watch`): each statistic over the recorded steps, a line
per layer (train_lines.png), and the same as a layer x step heatmap (train_heatmap.png).

The statistics, each where the run holds the sites it needs (a panel with nothing to draw is left
out, and a figure with no panel is not made):

- `abs_mean`, `std` and `dead_frac` of the layers' outputs;
- the gradient norm: `norm` of grad_output, and of the parameters' gradients (param_grad.*, a
  layer's parameters together: the root of their squared norms' sum);
- the update/weight ratio: the norm of a layer's param_update.* over that of its param.* (the
  parameters it holds both of).

`series(table)` gives each statistic as a step x layer frame: the figures draw exactly those
values (tests read them back). Lines are coloured by depth with a colour bar when there are more
layers than a legend can hold beside its plot.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from probe.site_keys import parse_or_none  # noqa: E402

MAX_LEGEND = 8  # more layers than this: colour by depth and a colour bar, not a legend
LOG_PANELS = ("grad norm (grad_output)", "grad norm (param_grad)", "update / weight")


def site_keys(table: pd.DataFrame) -> pd.Series:
    """The SiteKey of each row's site (None for a name that is no site's), parsed once a name."""
    keys = {name: parse_or_none(name) for name in table["site"].unique()}
    return table["site"].map(keys)


def first_sites(table: pd.DataFrame, kind: str) -> pd.DataFrame:
    """The rows of each layer's first site of `kind` (output, grad_output) at its first call
    (no @): `output`, or a tuple output's first tensor `output.0`."""
    keys = site_keys(table)
    rows = table[
        keys.map(lambda k: k is not None and k.family == kind and k.call == 0).astype(bool)
    ]
    if rows.empty:
        return rows
    first = rows.groupby("layer", sort=False)["site"].first()
    return rows[rows["site"] == rows["layer"].map(first)]


def wide(rows: pd.DataFrame, values: pd.Series, layers: list[str]) -> pd.DataFrame:
    """A step x layer frame of `values` (indexed like `rows`), layers in execution order."""
    frame = pd.DataFrame({"step": rows["step"].to_numpy(), "layer": rows["layer"].to_numpy(),
                          "v": values.to_numpy(dtype=float)})  # fmt: skip
    out = frame.pivot_table(index="step", columns="layer", values="v", aggfunc="first")
    return out.reindex(columns=[c for c in layers if c in out.columns])


def param_norms(table: pd.DataFrame, kind: str) -> pd.DataFrame:
    """Per (step, layer, parameter name) the norm of a parameter site of `kind`."""
    keys = site_keys(table)
    wanted = keys.map(lambda k: k is not None and k.family == kind).astype(bool)
    rows = table[wanted]
    names = keys[wanted].map(lambda k: k.parameter)
    return rows.assign(param=names)[["step", "layer", "param", "norm"]]


def series(table: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """{statistic: step x layer frame} of the statistics the table holds (see the module)."""
    layers = list(dict.fromkeys(table["layer"]))
    out = {}
    outputs = first_sites(table, "output")
    if not outputs.empty:
        out["abs_mean (output)"] = wide(outputs, outputs["abs_mean"], layers)
        out["std (output)"] = wide(outputs, outputs["std"], layers)
    grads = first_sites(table, "grad_output")
    if not grads.empty:
        out["grad norm (grad_output)"] = wide(grads, grads["norm"], layers)
    pgrad = param_norms(table, "param_grad")
    if not pgrad.empty:
        summed = pgrad.assign(sq=pgrad["norm"] ** 2).groupby(["step", "layer"], sort=False)["sq"]
        total = summed.sum().reset_index()
        out["grad norm (param_grad)"] = wide(total, np.sqrt(total["sq"]), layers)
    update, weight = param_norms(table, "param_update"), param_norms(table, "param")
    if not update.empty and not weight.empty:
        both = update.merge(weight, on=["step", "layer", "param"], suffixes=("_u", "_w"))
        if not both.empty:
            both = both.assign(u=both["norm_u"] ** 2, w=both["norm_w"] ** 2)
            sums = both.groupby(["step", "layer"], sort=False)[["u", "w"]].sum().reset_index()
            out["update / weight"] = wide(sums, np.sqrt(sums["u"]) / np.sqrt(sums["w"]), layers)
    if not outputs.empty and outputs["dead_frac"].notna().any():
        out["dead_frac (output)"] = wide(outputs, outputs["dead_frac"], layers)
    return {k: v for k, v in out.items() if not v.empty and v.notna().to_numpy().any()}


def _colours(layers: list[str]):
    """A colour per layer: the default cycle for a legend, viridis by depth beyond MAX_LEGEND."""
    if len(layers) <= MAX_LEGEND:
        cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        return [cycle[i % len(cycle)] for i in range(len(layers))], None
    cmap = plt.get_cmap("viridis")
    norm = matplotlib.colors.Normalize(0, len(layers) - 1)
    return [cmap(norm(i)) for i in range(len(layers))], matplotlib.cm.ScalarMappable(norm, cmap)


def _depth_bar(fig, mappable, layers: list[str], axes) -> None:
    bar = fig.colorbar(mappable, ax=axes, fraction=0.03, pad=0.01)
    bar.set_ticks([0, len(layers) - 1], labels=[layers[0], layers[-1]], fontsize=6)
    bar.set_label("layer (execution order)", fontsize=7)


def lines_figure(stats: dict[str, pd.DataFrame], scalars: pd.DataFrame | None = None,
                 title: str = "") -> plt.Figure | None:  # fmt: skip
    """A panel per statistic (and one of the loss and global grad norm where recorded): its
    value over steps, a line per layer. None when there is nothing to draw."""
    scalar_columns = [c for c in ("loss", "grad_norm")
                      if scalars is not None and c in scalars and scalars[c].notna().any()]  # fmt: skip
    panels = len(stats) + bool(scalar_columns)
    if not panels:
        return None
    layers = list(dict.fromkeys(c for frame in stats.values() for c in frame.columns))
    colours, mappable = _colours(layers)
    fig, axes = plt.subplots(panels, 1, figsize=(9, 2.2 * panels + 0.6), squeeze=False,
                             layout="constrained")  # fmt: skip
    axes = axes[:, 0]
    if scalar_columns:
        ax = axes[0]
        for c in scalar_columns:
            ax.plot(scalars["step"], scalars[c], marker=".", label=c)
        ax.set_ylabel("training", fontsize=8)
        ax.legend(fontsize=6, loc="upper right")
    for ax, (name, frame) in zip(axes[bool(scalar_columns) :], stats.items(), strict=True):
        for layer in frame.columns:
            ax.plot(frame.index, frame[layer].to_numpy(dtype=float), marker=".", markersize=3,
                    color=colours[layers.index(layer)], label=layer)  # fmt: skip
        if name in LOG_PANELS and (frame.to_numpy() > 0).any():
            ax.set_yscale("log")
        ax.set_ylabel(name, fontsize=8)
    for ax in axes:
        ax.tick_params(which="both", labelsize=6)
    axes[-1].set_xlabel("step", fontsize=8)
    if mappable is not None:
        _depth_bar(fig, mappable, layers, list(axes))
    elif stats:  # one legend for every panel, beside them, as small as the names allow
        handles = [matplotlib.lines.Line2D([], [], color=colours[i]) for i in range(len(layers))]
        fig.legend(handles, layers, loc="outside right upper", fontsize=6, frameon=False)
    fig.suptitle(title or "statistics over training", fontsize=9)
    return fig


def heatmap_figure(stats: dict[str, pd.DataFrame], title: str = "") -> plt.Figure | None:
    """A layer x step heatmap per statistic (log10 of the norms and ratios); None when there is
    nothing to draw."""
    if not stats:
        return None
    fig, axes = plt.subplots(len(stats), 1, figsize=(9, 2.4 * len(stats) + 0.6), squeeze=False,
                             layout="constrained")  # fmt: skip
    for ax, (name, frame) in zip(axes[:, 0], stats.items(), strict=True):
        values = heat_values(name, frame)
        image = ax.imshow(values, aspect="auto", interpolation="nearest", cmap="viridis")
        layers, steps = list(frame.columns), list(frame.index)
        every = max(1, len(layers) // 16)
        ax.set_yticks(range(0, len(layers), every), layers[::every], fontsize=5)
        every = max(1, len(steps) // 12)
        ax.set_xticks(range(0, len(steps), every), steps[::every], fontsize=6)
        ax.set_title(f"log10 {name}" if name in LOG_PANELS else name, fontsize=8)
        fig.colorbar(image, ax=ax, fraction=0.03, pad=0.01).ax.tick_params(labelsize=6)
    axes[-1, 0].set_xlabel("step", fontsize=8)
    fig.suptitle(title or "layer x step", fontsize=9)
    return fig


def heat_values(name: str, frame: pd.DataFrame) -> np.ndarray:
    """What a heatmap panel shows: layers down, steps across (log10 for norms and ratios)."""
    values = frame.to_numpy(dtype=float).T
    if name in LOG_PANELS:
        with np.errstate(divide="ignore", invalid="ignore"):
            values = np.where(values > 0, np.log10(np.where(values > 0, values, 1)), np.nan)
    return values


def train_figures(table: pd.DataFrame, scalars: pd.DataFrame | None, title: str = "") -> dict:
    """{file name: Figure} of a watched training; figures with nothing to draw are left out."""
    stats = series(table)
    made = {
        "train_lines.png": lines_figure(stats, scalars, f"statistics over training: {title}"),
        "train_heatmap.png": heatmap_figure(stats, f"layer x step: {title}"),
    }
    return {k: v for k, v in made.items() if v is not None}


def coord_table(sweep) -> pd.DataFrame:
    """mup's coordinate-check table of a sweep of watched trainings over `model.width`
    (`python -m probe.train -m model.width=64,128,...`): one row per (width, layer, step) with
    `abs_mean`, the mean |x| of the layer's output (mup's `l1`)."""
    from pathlib import Path

    from omegaconf import OmegaConf

    from probe.errors import DataError

    frames = []
    for run in sorted(p for p in Path(sweep).iterdir() if (p / "train.csv").is_file()):
        config = run / ".hydra" / "config.yaml"
        width = OmegaConf.load(config).model.get("width") if config.is_file() else None
        if width is None:
            raise DataError(f"{run} has no model.width in .hydra/config.yaml: not a width sweep")
        table = pd.read_csv(run / "train.csv")
        rows = first_sites(table, "output")
        frames.append(rows.assign(width=int(width))[["width", "layer", "step", "abs_mean"]])
    if not frames:
        raise DataError(
            f"{sweep} holds no watched training (no */train.csv); make one with python -m "
            "probe.train -m model.width=64,128,256 train.steps=5 watch.every=1 probes=all_linear"
        )
    return pd.concat(frames, ignore_index=True).sort_values(["layer", "step", "width"],
                                                            kind="stable")  # fmt: skip


def coord_figure(table: pd.DataFrame, title: str = "") -> plt.Figure:
    """A panel per layer: abs_mean of its output against width (log-log), a line per step."""
    layers = list(dict.fromkeys(table["layer"]))
    cols = min(4, len(layers))
    rows = -(-len(layers) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows + 0.6), squeeze=False,
                             layout="constrained")  # fmt: skip
    for ax in axes.flat[len(layers) :]:
        ax.axis("off")
    for ax, layer in zip(axes.flat, layers, strict=False):
        part = table[table["layer"] == layer]
        for step, line in part.groupby("step", sort=True):
            ax.plot(line["width"], line["abs_mean"], marker="o", markersize=3, label=f"step {step}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(layer, fontsize=8)
        ax.tick_params(which="both", labelsize=6)
    axes[0, 0].legend(fontsize=6)
    axes[-1, 0].set_xlabel("width", fontsize=8)
    axes[0, 0].set_ylabel("abs_mean of output", fontsize=8)
    fig.suptitle(title or "coordinate check: abs_mean against width, a line per step", fontsize=9)
    return fig
