"""Figures of a watched training (`probe.watch`): each statistic over the recorded steps, a line
per module (train_lines.png), and the same as module x step heatmaps (train_heatmap.png).

The statistics are `run.train_series()`'s (probe.read.train_series): `abs_mean`, `std` and
`dead_frac` of the outputs, the gradient norms of grad_output and of the parameters, the
update/weight ratio; a panel with nothing to draw is left out, and a figure with no panel is
not made.

Each statistic of the outputs and output gradients gets a panel per kind of module (block
outputs, attention, MLP, other: probe.report.train_sites reads it from the names), those of the
parameters one panel; the training's own scalars (the loss, and the global gradient norms:
`grad_norm` and any `grad_norm_*` such as the norm before clipping) come first.

- Scale: the norms and ratios on a log axis; another panel on a log axis where on a linear one
  some line would be squashed (`scale_of`: its peak below LEGIBLE of the panel's top), its axis
  saying so. A log panel leaves zeros out (below its scale) rather than drawing them as a drop,
  and the update/weight panel leaves out, with a note, the steps whose learning rate is 0 (no
  update: a warmup's step 0).
- Colour: lines by depth (the block index the module's name holds, deeper darker) with a colour
  bar when there are more modules than a legend holds (MAX_LEGEND), else one legend; the
  parameter panels, a few modules from anywhere in the model, have their own legend and the
  default colour cycle's distinct colours. Heatmap rows run by depth, each labelled (one label
  per block beyond MAX_ROW_LABELS rows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from probe.read.train_series import (  # noqa: E402
    GRAD_OUTPUT_NORM,
    PARAM_GRAD_NORM,
    UPDATE_RATIO,
    first_sites,
    series,
)
from probe.report.train_sites import KINDS, Place, block_ticks, places, split_block  # noqa: E402

MAX_LEGEND = 8  # more modules than this: colour by depth and a colour bar, not a legend
MAX_ROW_LABELS = 48  # more heatmap rows than this: one label per block
LEGIBLE = 0.1  # a line peaking below this fraction of its panel's top: squashed if linear
LOG_PANELS = (GRAD_OUTPUT_NORM, PARAM_GRAD_NORM, UPDATE_RATIO)
LINEAR_PANELS = ("dead_frac (output)",)  # fractions of units: always linear
PARAM_PANELS = (PARAM_GRAD_NORM, UPDATE_RATIO)
PARAMETERS = "parameters"  # the kind of a parameter statistic's panel
SAID = {  # each statistic as its axes say it
    "abs_mean (output)": "abs_mean of output",
    "std (output)": "std of output",
    "dead_frac (output)": "dead_frac of output",
    "grad norm (grad_output)": "norm of grad_output",
    "grad norm (param_grad)": "norm of param_grad",
    "update / weight": "update / weight",
}
DEPTH_CMAP = matplotlib.colors.LinearSegmentedColormap.from_list(
    "depth", plt.get_cmap("viridis")(np.linspace(0.9, 0.0, 24)), N=2048
)  # viridis from light green to dark blue: shallow light, deep dark, 2048 shades


def module_places(table: pd.DataFrame, order: list[str] | None = None) -> dict[str, Place]:
    """{module: Place} of the table's modules (probe.report.train_sites): `order` is the model's
    order of the watched modules (watch.yaml's `modules`); without it the table's."""
    names = list(dict.fromkeys([*(order or []), *table["layer"]]))
    types = {}
    if "module_type" in table:
        types = table.groupby("layer", sort=False)["module_type"].first().astype(str).to_dict()
    return places(names, types)


def in_depth_order(stats: dict[str, pd.DataFrame], found: dict[str, Place]) -> dict:
    """The frames of `stats` (probe.read.train_series) with their modules by depth."""
    return {stat: frame[sorted(frame.columns, key=lambda n: found[n].depth)]
            for stat, frame in stats.items()}  # fmt: skip


def scale_of(stat: str, values) -> str:
    """A panel's y scale, from its values (steps down, a column per line): `log` for the
    norms and ratios, and where on a linear axis some line would be squashed: its peak below
    LEGIBLE of the panel's highest value, so that on an axis from 0 up it would stay in the
    bottom tenth (`symlog` where zeros are among the values: drawn at 0); else `linear`.
    Fractions of units (dead_frac) and values with negatives are always linear."""
    v = np.asarray(values, dtype=float)
    v = v.reshape(len(v), -1) if v.ndim < 2 else v
    finite = v[np.isfinite(v)]
    if stat in LINEAR_PANELS or not (finite > 0).any() or (finite < 0).any():
        return "linear"
    if stat in LOG_PANELS:
        return "log"
    with np.errstate(all="ignore"):
        peaks = np.nanmax(np.where(np.isfinite(v), v, np.nan), axis=0)
    peaks = peaks[np.isfinite(peaks) & (peaks > 0)]
    if peaks.min() < LEGIBLE * peaks.max():
        return "log" if (finite > 0).all() else "symlog"
    return "linear"


@dataclass
class Panel:
    """One panel: a statistic of one kind of module, its step x module frame and its scale."""

    stat: str
    kind: str
    frame: pd.DataFrame
    scale: str

    @property
    def label(self) -> str:
        """The panel's name, which its axes carry (`ax.get_label()`)."""
        return f"{self.stat} | {self.kind}"

    @property
    def axis(self) -> str:
        """The y axis label: the statistic, and its scale where not linear."""
        said = SAID.get(self.stat, self.stat)
        return said if self.scale == "linear" else f"{said} ({self.scale})"


def panels(stats: dict[str, pd.DataFrame], found: dict[str, Place]) -> list[Panel]:
    """The panels of `stats` (series): a statistic of outputs or output gradients per kind of
    module (KINDS, those with values), one of parameters whole."""
    out = []
    for stat, frame in stats.items():
        if stat in PARAM_PANELS:
            parts = [(PARAMETERS, frame)]
        else:
            parts = [(k, frame[[c for c in frame.columns if found[c].kind == k]]) for k in KINDS]
        for kind, part in parts:
            if part.shape[1] and part.notna().to_numpy().any():
                out.append(Panel(stat, kind, part, scale_of(stat, part.to_numpy())))
    return out


def _rows(found: list[Panel]) -> list[list[Panel]]:
    """The panels a row per statistic, in the order of the statistics."""
    rows: dict[str, list[Panel]] = {}
    for p in found:
        rows.setdefault(p.stat, []).append(p)
    return list(rows.values())


def _grid(fig, rows: list[int], heights: list[float] | None = None) -> list[list]:
    """Axes in rows of the given lengths, each row as wide as the figure (one grid, so that a
    colour bar can span them all)."""
    cols = math.lcm(*rows)
    grid = fig.add_gridspec(len(rows), cols, height_ratios=heights)
    return [[fig.add_subplot(grid[r, c * cols // n : (c + 1) * cols // n]) for c in range(n)]
            for r, n in enumerate(rows)]  # fmt: skip


def _set_scale(ax, scale: str, values) -> None:
    if scale == "log":
        ax.set_yscale("log")
    elif scale == "symlog":
        v = np.asarray(values, dtype=float)
        ax.set_yscale("symlog", linthresh=float(v[np.isfinite(v) & (v > 0)].min()))


def depth_colours(found: dict[str, Place], modules: list[str]) -> tuple[dict, object]:
    """{module: colour}: the default cycle for a legend (up to MAX_LEGEND modules, by depth),
    else by depth on DEPTH_CMAP (deeper darker) with its ScalarMappable for a colour bar."""
    modules = sorted(modules, key=lambda n: found[n].depth)
    if len(modules) <= MAX_LEGEND:
        cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        return {m: cycle[i % len(cycle)] for i, m in enumerate(modules)}, None
    depths = [found[m].depth for m in modules]
    norm = matplotlib.colors.Normalize(min(depths), max(depths))
    colours = {m: DEPTH_CMAP(norm(found[m].depth)) for m in modules}
    return colours, matplotlib.cm.ScalarMappable(norm, DEPTH_CMAP)


def _depth_bar(fig, mappable, found: dict[str, Place], axes) -> None:
    bar = fig.colorbar(mappable, ax=axes, fraction=0.03, pad=0.01)
    ticks, labels, said = block_ticks(found)
    bar.set_ticks(ticks, labels=labels, fontsize=6)
    bar.set_label(f"{said}; deeper is darker", fontsize=7)


def scalar_columns(scalars: pd.DataFrame | None) -> tuple[list[str], list[str]]:
    """The training panels' columns: the loss, and the global gradient norms (`grad_norm` and
    any `grad_norm_*`, such as the norm before clipping), those with values."""
    if scalars is None:
        return [], []
    has = [c for c in scalars.columns if scalars[c].notna().any()]
    return [c for c in has if c == "loss"], [c for c in has if c.startswith("grad_norm")]


def colour_plan(found: dict[str, Place], drawn: list[Panel]) -> tuple[dict, dict, object, bool]:
    """The lines' colours: (by module in the panels of outputs and gradients, by module in the
    parameter panels, the depth colour bar's ScalarMappable or None, whether the parameter
    panels carry their own legend). Up to MAX_LEGEND modules in all: one set of distinct colours
    (one legend). More: depth colours, but the parameter panels' few modules (up to MAX_LEGEND),
    which sit anywhere in the model and would get colours too close to tell apart, the colour
    cycle's distinct ones and a legend of their own."""
    modules = list(dict.fromkeys(c for p in drawn for c in p.frame.columns))
    params = list(dict.fromkeys(c for p in drawn if p.kind == PARAMETERS for c in p.frame.columns))
    rest = list(dict.fromkeys(c for p in drawn if p.kind != PARAMETERS for c in p.frame.columns))
    if len(modules) <= MAX_LEGEND or not params or len(params) > MAX_LEGEND:
        colours, mappable = depth_colours(found, modules)
        return colours, colours, mappable, False
    colours, mappable = depth_colours(found, rest)
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    skip = len(colours) if mappable is None else 0  # (after the legend's colours beside)
    ordered = sorted(params, key=lambda n: found[n].depth)
    own = {m: cycle[(skip + i) % len(cycle)] for i, m in enumerate(ordered)}
    return colours, own, mappable, True


def no_update_steps(scalars: pd.DataFrame | None) -> list[int]:
    """The steps at which every param group's learning rate was 0 (a warmup's first step): the
    optimizer changed no weight, so update/weight is 0 there."""
    if scalars is None:
        return []
    rates = [c for c in scalars.columns if c.startswith("lr.")]
    if not rates:
        return []
    zero = (scalars[rates] == 0).all(axis=1)
    return [int(s) for s in scalars.loc[zero, "step"]]


def _drawn(p: Panel, skipped: list[int]) -> tuple[pd.DataFrame, str]:
    """The values a panel draws and its note: on a log axis zeros are left out (below the
    scale, not a drop to its bottom); update/weight leaves out the steps without an update."""
    frame = p.frame.astype(float)
    note = ""
    if p.stat == UPDATE_RATIO:
        gone = [s for s in skipped if s in frame.index]
        if gone:
            frame = frame.drop(index=gone)
            said = ", ".join(map(str, gone[:4])) + (", ..." if len(gone) > 4 else "")
            note = f"step{'s' * (len(gone) > 1)} {said} left out: learning rate 0, no update"
    if p.scale == "log":
        frame = frame.where(frame > 0)
    return frame, note


def lines_figure(stats: dict[str, pd.DataFrame], scalars: pd.DataFrame | None = None,
                 title: str = "", found: dict[str, Place] | None = None) -> plt.Figure | None:  # fmt: skip
    """A row of panels per statistic (one per kind of module), a line per module, after a row of
    the loss and the global grad norms where recorded. `found` places the modules (their kind
    and depth; by default from the frames' column order). None when there is nothing to draw."""
    modules = list(dict.fromkeys(c for frame in stats.values() for c in frame.columns))
    found = found or places(modules)
    loss, norms = scalar_columns(scalars)
    training = [c for c in (loss, norms) if c]
    drawn = panels(stats, found)
    rows = _rows(drawn)
    if not rows and not training:
        return None
    lengths = [len(training)] * bool(training) + [len(r) for r in rows]
    wide_as = max(lengths)
    fig = plt.figure(figsize=(max(9.0, 3.4 * wide_as + 1.2), 2.1 * len(lengths) + 0.6),
                     layout="constrained")  # fmt: skip
    grid = _grid(fig, lengths)
    if training and scalars is not None:
        for ax, columns in zip(grid.pop(0), training, strict=True):
            for c in columns:
                ax.plot(scalars["step"], scalars[c], marker=".", label=c)
            what = "loss" if columns is loss else "global grad norm"
            scale = scale_of("" if columns is loss else what, scalars[columns].to_numpy())
            _set_scale(ax, scale, scalars[columns].to_numpy())
            ax.set_ylabel(what if scale == "linear" else f"{what} ({scale})", fontsize=8)
            ax.set_title("training", fontsize=8)
            ax.set_label(f"training | {what}")
            ax.legend(fontsize=6, loc="upper right")
    colours, param_colours, mappable, own_legend = colour_plan(found, drawn)
    skipped = no_update_steps(scalars)
    for row, axes in zip(rows, grid, strict=True):
        for p, ax in zip(row, axes, strict=True):
            values, note = _drawn(p, skipped)
            palette = param_colours if p.kind == PARAMETERS else colours
            for module in values.columns:
                ax.plot(values.index, values[module].to_numpy(dtype=float), marker=".",
                        markersize=3, color=palette[module], label=module)  # fmt: skip
            _set_scale(ax, p.scale, p.frame.to_numpy())
            ax.set_ylabel(p.axis, fontsize=8)
            ax.set_title(f"{p.kind} ({p.frame.shape[1]})", fontsize=8)
            ax.set_label(p.label)
            if note:
                ax.text(0.01, 0.02, note, transform=ax.transAxes, fontsize=6, va="bottom",
                        color="0.3")  # fmt: skip
            if own_legend and p.kind == PARAMETERS:
                ax.legend(fontsize=6, loc="best", framealpha=0.7)
    for ax in fig.axes:
        ax.tick_params(which="both", labelsize=6)
    for ax in grid[-1] if grid else fig.axes:
        ax.set_xlabel("step", fontsize=8)
    if mappable is not None:
        _depth_bar(fig, mappable, {m: found[m] for m in colours}, fig.axes)
    elif colours:  # one legend for every panel, beside them, as small as the names allow
        handles = [matplotlib.lines.Line2D([], [], color=colours[m]) for m in colours]
        fig.legend(handles, list(colours), loc="outside right upper", fontsize=6, frameon=False)
    fig.suptitle(title or "statistics over training", fontsize=9)
    return fig


def short_names(names: list[str]) -> tuple[list[str], str]:
    """Row labels: the names less the dotted prefix and suffix they share, and the pattern they
    fill (`model.layers.*.self_attn`); the names whole (and "") where that leaves none or
    repeats one."""
    parts = [n.split(".") for n in names]
    if len(names) < 2:
        return list(names), ""
    pre = 0
    while all(len(p) > pre + 1 for p in parts) and len({p[pre] for p in parts}) == 1:
        pre += 1
    suf = 0
    while (all(len(p) > pre + suf + 1 for p in parts)
           and len({p[len(p) - 1 - suf] for p in parts}) == 1):  # fmt: skip
        suf += 1
    labels = [".".join(p[pre : len(p) - suf]) for p in parts]
    if not pre + suf or len(set(labels)) < len(labels):
        return list(names), ""
    head = parts[0]
    return labels, ".".join([*head[:pre], "*", *head[len(head) - suf :]])


def row_labels(names: list[str]) -> tuple[list[int], list[str], str]:
    """A heatmap's y ticks: every row labelled (short_names), or past MAX_ROW_LABELS rows one
    label per block (at its first row) and one per module outside the blocks."""
    if len(names) <= MAX_ROW_LABELS:
        labels, pattern = short_names(names)
        return list(range(len(names))), labels, pattern
    blocks = [split_block(n) for n in names]
    keys = [f"{b[0]}.{b[1]}" if b else n for n, b in zip(names, blocks, strict=True)]
    rows = [i for i, k in enumerate(keys) if i == 0 or k != keys[i - 1]]
    labels, pattern = short_names([keys[i] for i in rows])
    return rows, labels, pattern


def heatmap_figure(stats: dict[str, pd.DataFrame], title: str = "",
                   found: dict[str, Place] | None = None) -> plt.Figure | None:  # fmt: skip
    """A module x step heatmap per statistic and kind of module (log10 where the panel's scale is
    log), rows by depth, each labelled; None when there is nothing to draw."""
    modules = list(dict.fromkeys(c for frame in stats.values() for c in frame.columns))
    rows = _rows(panels(stats, found or places(modules)))
    if not rows:
        return None
    heights = [max(1.3, 0.075 * max(p.frame.shape[1] for p in row) + 0.8) for row in rows]
    wide_as = max(len(row) for row in rows)
    fig = plt.figure(figsize=(max(9.0, 4.2 * wide_as), sum(heights) + 0.6), layout="constrained")
    for row, axes in zip(rows, _grid(fig, [len(r) for r in rows], heights), strict=True):
        for p, ax in zip(row, axes, strict=True):
            values = heat_values(p)
            image = ax.imshow(values, aspect="auto", interpolation="nearest", cmap="viridis")
            names, steps = list(p.frame.columns), list(p.frame.index)
            ticks, labels, pattern = row_labels(names)
            size = 6 if len(ticks) <= 16 else 5 if len(ticks) <= 32 else 4
            ax.set_yticks(ticks, labels, fontsize=size)
            every = max(1, len(steps) // 10)
            ax.set_xticks(range(0, len(steps), every), steps[::every], fontsize=6)
            said = SAID.get(p.stat, p.stat)
            log = "log10 " if p.scale != "linear" else ""
            where = f": {pattern}" if pattern else ""
            ax.set_title(f"{log}{said}, {p.kind}{where}", fontsize=7)
            ax.set_label(p.label)
            bar = fig.colorbar(image, ax=ax, fraction=0.05, pad=0.01)
            bar.ax.tick_params(labelsize=6)
            bar.set_label(f"{log}{said}", fontsize=6)
        for ax in axes:
            ax.set_xlabel("step", fontsize=7)
    fig.suptitle(title or "module x step", fontsize=9)
    return fig


def heat_values(p: Panel) -> np.ndarray:
    """What a heatmap panel shows: modules down, steps across (log10 where its scale is log;
    a zero of a symlog panel is left blank)."""
    values = p.frame.to_numpy(dtype=float).T
    if p.scale != "linear":
        with np.errstate(divide="ignore", invalid="ignore"):
            values = np.where(values > 0, np.log10(np.where(values > 0, values, 1)), np.nan)
    return values


def train_figures(table: pd.DataFrame, scalars: pd.DataFrame | None, title: str = "",
                  order: list[str] | None = None) -> dict:  # fmt: skip
    """{file name: Figure} of a watched training; figures with nothing to draw are left out.
    `order`: the model's order of the watched modules (watch.yaml's `modules`)."""
    found = module_places(table, order) if not table.empty else {}
    stats = in_depth_order(series(table, order), found)
    made = {
        "train_lines.png": lines_figure(
            stats, scalars, f"statistics over training: {title}", found
        ),  # fmt: skip
        "train_heatmap.png": heatmap_figure(stats, f"module x step: {title}", found),
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
