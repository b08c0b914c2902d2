"""Figures of a watched training (`probe.watch`): each statistic over the recorded steps, a line
per module (train_lines.png), and the same as module x step heatmaps (train_heatmap.png).

The statistics, each where the run holds the sites it needs (a panel with nothing to draw is left
out, and a figure with no panel is not made):

- `abs_mean`, `std` and `dead_frac` of the modules' outputs;
- the gradient norm: `norm` of grad_output, and of the parameters' gradients (param_grad.*, a
  module's parameters together: the root of their squared norms' sum);
- the update/weight ratio: the norm of a module's param_update.* over that of its param.* (the
  parameters it holds both of).

Each statistic of the outputs and output gradients gets a panel per kind of module (block
outputs, attention, MLP, other: probe.report.train_sites reads it from the names), those of the
parameters one panel; the training's own scalars (the loss, and the global gradient norms:
`grad_norm` and any `grad_norm_*` such as the norm before clipping) come first. A panel whose
positive values span more than SPAN (and the norms and ratios always) is drawn on a log scale,
and its axis says so. Lines are coloured by depth (the block index the module's name holds,
deeper darker) with a colour bar when there are more modules than a legend can hold beside its
plot; heatmap rows run by depth, each labelled (one label per block beyond MAX_ROW_LABELS rows).

`series(table)` gives each statistic as a step x module frame and `panels(table)` splits them by
kind: the figures draw exactly those values (tests read them back).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from probe.report.train_sites import KINDS, Place, block_ticks, places, split_block  # noqa: E402
from probe.site_keys import parse_or_none  # noqa: E402

MAX_LEGEND = 8  # more modules than this: colour by depth and a colour bar, not a legend
MAX_ROW_LABELS = 48  # more heatmap rows than this: one label per block
SPAN = 100.0  # positive values spanning more than this ratio: a log scale
LOG_PANELS = ("grad norm (grad_output)", "grad norm (param_grad)", "update / weight")
LINEAR_PANELS = ("dead_frac (output)",)  # fractions of units: always linear
PARAM_PANELS = ("grad norm (param_grad)", "update / weight")
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
    """A step x layer frame of `values` (indexed like `rows`), layers in the order given."""
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


def module_places(table: pd.DataFrame, order: list[str] | None = None) -> dict[str, Place]:
    """{module: Place} of the table's modules (probe.report.train_sites): `order` is the model's
    order of the watched modules (watch.yaml's `modules`); without it the table's."""
    names = list(dict.fromkeys([*(order or []), *table["layer"]]))
    types = {}
    if "module_type" in table:
        types = table.groupby("layer", sort=False)["module_type"].first().astype(str).to_dict()
    return places(names, types)


def by_depth(table: pd.DataFrame, order: list[str] | None = None) -> list[str]:
    """The table's modules, shallowest first."""
    found = module_places(table, order)
    return sorted(dict.fromkeys(table["layer"]), key=lambda n: found[n].depth)


def series(table: pd.DataFrame, order: list[str] | None = None) -> dict[str, pd.DataFrame]:
    """{statistic: step x module frame} of the statistics the table holds (see the module),
    modules by depth (`order`: see module_places)."""
    layers = by_depth(table, order) if not table.empty else []
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


def scale_of(stat: str, values) -> str:
    """`log` for the norms and ratios (a zero left out, below the scale) and where a panel's
    values are positive and span more than SPAN; `symlog` for the latter with zeros among them
    (drawn at 0); else `linear`."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    positive = v[v > 0]
    if stat in LINEAR_PANELS or positive.size == 0 or (v < 0).any():
        return "linear"
    if stat in LOG_PANELS:
        return "log"
    if positive.max() > SPAN * positive.min():
        return "log" if positive.size == v.size else "symlog"
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


def lines_figure(stats: dict[str, pd.DataFrame], scalars: pd.DataFrame | None = None,
                 title: str = "", found: dict[str, Place] | None = None) -> plt.Figure | None:  # fmt: skip
    """A row of panels per statistic (one per kind of module), a line per module, after a row of
    the loss and the global grad norms where recorded. `found` places the modules (their kind
    and depth; by default from the frames' column order). None when there is nothing to draw."""
    modules = list(dict.fromkeys(c for frame in stats.values() for c in frame.columns))
    found = found or places(modules)
    loss, norms = scalar_columns(scalars)
    training = [c for c in (loss, norms) if c]
    rows = _rows(panels(stats, found))
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
    colours, mappable = depth_colours(found, modules)
    for row, axes in zip(rows, grid, strict=True):
        for p, ax in zip(row, axes, strict=True):
            for module in p.frame.columns:
                ax.plot(p.frame.index, p.frame[module].to_numpy(dtype=float), marker=".",
                        markersize=3, color=colours[module], label=module)  # fmt: skip
            _set_scale(ax, p.scale, p.frame.to_numpy())
            ax.set_ylabel(p.axis, fontsize=8)
            ax.set_title(f"{p.kind} ({p.frame.shape[1]})", fontsize=8)
            ax.set_label(p.label)
    for ax in fig.axes:
        ax.tick_params(which="both", labelsize=6)
    for ax in grid[-1] if grid else fig.axes:
        ax.set_xlabel("step", fontsize=8)
    if mappable is not None:
        _depth_bar(fig, mappable, {m: found[m] for m in modules}, fig.axes)
    elif modules:  # one legend for every panel, beside them, as small as the names allow
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
    stats = series(table, order)
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
