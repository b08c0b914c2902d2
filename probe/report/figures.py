"""Write a run's or a sweep's figures next to its data (the `plot` extra: matplotlib).

    python -m probe.plot RUN_OR_SWEEP [--layer NAME] [--sample 0] [--site output]
    python -m probe.plot SWEEP coord      # mup's coordinate check of a sweep over model.width

A watched training (probe.watch) gets train_lines.png and train_heatmap.png (each statistic over
steps per layer: probe.report.train_plots). A run gets depth.png (output mean in its p01-p99 band, std, dead-unit fraction, gradient norm),
histograms.png (output sites), gradients.png (grad_output, grad_input, param_grad.* sites),
features_<layer>_<site>_<sample>.png (a conv layer's maps) and linear.png (Linear layers, unit
by sample), and for attribution sites attribution.png (by depth), cams.png (CAM maps over the
inputs) and tokens_<layer>_<site>.png (token attributions as coloured text) where the run holds
them, and graph_<prompt>.png (the first prompts' pruned attribution graphs:
probe.report.graph_figure) where it holds /graph; a figure with nothing to draw is left out. A sweep gets depth.png with one line per run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from probe.errors import ProbeError
from probe.read.runs import open_run, open_sweep
from probe.read.summaries import is_sweep

MAX_LINEAR = 8
PLOT_EXTRA = "probe.plot needs matplotlib: pip install 'probe[plot]' (or pip install matplotlib)"


def run_title(config, name: str = "", samples: int | None = None) -> str:
    """'run 0 | model resnet18 | probes all_convs | 64 samples | objective cross_entropy';
    `samples` the run's count (its file's), else dataset.num_samples where set."""
    model = config.get("model") or {}
    model_name = str(model.get("name", "?"))
    target = model.get("_target_")
    if model_name == "custom" and target:
        model_name = f"custom {str(target).rsplit('.', 1)[-1]}"
    probes_cfg = config.get("probes")
    probes = (", ".join(map(str, probes_cfg)) if hasattr(probes_cfg, "keys") else "") or "none"
    if samples is None:
        samples = (config.get("dataset") or {}).get("num_samples")
    objective = (config.get("objective") or {}).get("name", "?")
    parts = [f"run {name}" if name else "", f"model {model_name}", f"probes {probes}"]
    parts += [f"{'all' if samples is None else samples} samples", f"objective {objective}"]
    return " | ".join(p for p in parts if p)


def sweep_title(sweep) -> str:
    """'sweep NAME | 2 runs | differing: model, probes'."""
    from probe.report.summary_plots import differing_overrides

    differ = differing_overrides(sweep.table) if "run" in sweep.table else []
    tail = f" | differing: {', '.join(differ)}" if differ else ""
    return f"sweep {sweep.path.name} | {len(sweep.run_dirs)} runs{tail}"


def stored(run, layer: str, site: str = "output") -> bool:
    """Whether the run keeps tensors (rows of samples) for (layer, site)."""
    from probe.store.fileformat import layer_path

    return layer_path(layer, site) in run.file and len(run.array(layer, site)) > 0


def conv_layer(run, site: str = "output") -> str | None:
    """The first layer whose stored rows are maps (N, C, H, W...), or None."""
    for layer, s in run.keys:
        if s == site and stored(run, layer, site) and len(run.array(layer, site).shape) >= 4:
            return layer
    return None


def linear_layers(run) -> list[str]:
    """Layers of module type Linear whose outputs are stored one row per sample (N, units)."""
    table = run.summary
    rows = table[(table["site"] == "output") & (table["module_type"] == "Linear")]
    names = [str(n) for n in rows["layer"] if stored(run, str(n))]
    return [
        n for n in names if len(run.array(n).shape) == 2 and len(run.array(n)) == run.num_samples
    ]


def run_figures(
    run, layer: str | None = None, sample: int = 0, site: str = "output", notes=None
) -> dict:
    """{file name: Figure} of one open run; features only where tensors are stored, and a figure
    with nothing to draw left out (why, one line each, appended to `notes`). A watched training
    gets its training figures (probe.report.train_plots)."""
    from probe.report.summary_plots import (
        GRADIENT_SITES,
        depth_figure,
        features_figure,
        histogram_figure,
        site_keys,
        units_figure,
    )

    if run.watched:
        return train_run_figures(run, notes)
    title = run_title(run.config, run.path.name, run.num_samples)
    figures = {"depth.png": depth_figure(run.summary, title)}
    figures["histograms.png"] = histogram_figure(run, title=f"output histograms: {title}")
    if figures["depth.png"] is None:
        _note(notes, "no output or grad_output sites: no depth.png")
    if figures["histograms.png"] is None:
        _note(notes, "no output sites: no histograms.png")
    if site_keys(run, GRADIENT_SITES):
        figures["gradients.png"] = histogram_figure(
            run, GRADIENT_SITES, title=f"gradient histograms: {title}"
        )
    layer = layer or conv_layer(run, site)
    if layer is not None:
        if layer not in run.layers:
            raise KeyError(f"no layer {layer!r} in {run.h5_path}; summary.csv lists them")
        array = run.array(layer, site)
        name = f"features_{layer.replace('/', '_')}_{site}_{sample}.png"
        figures[name] = features_figure(array[sample], f"{layer} {site}, sample {sample}\n{title}")
    from probe.report.attribution_plots import attribution_figures
    from probe.report.graph_figure import graph_figures
    from probe.report.lens_plots import lens_figures

    figures.update(attribution_figures(run, run.attribution, title))
    figures.update(graph_figures(run.path, title))
    figures.update(lens_figures(run, title))
    linear = linear_layers(run)[:MAX_LINEAR]
    if linear:
        panels = [(f"{n} output", run.array(n)[:256]) for n in linear]
        figures["linear.png"] = units_figure(panels, f"Linear layers, unit by sample: {title}")
    return {name: fig for name, fig in figures.items() if fig is not None}


def _note(notes: list | None, line: str) -> None:
    if notes is not None:
        notes.append(line)


def train_title(config, name: str = "") -> str:
    """'training w | model SmallCNN | optimizer SGD | every 10' of a watched training."""
    parts = [f"training {name}" if name else "training"]
    for key in ("model", "optimizer", "every"):
        if config.get(key) is not None:
            parts.append(f"{key} {config.get(key)}")
    return " | ".join(parts)


def train_run_figures(run, notes: list | None = None) -> dict:
    """{file name: Figure} of a watched training (probe.report.train_plots)."""
    from probe.report.train_plots import train_figures

    modules = run.config.get("modules") if run.config is not None else None
    made = train_figures(run.train(), run.train_scalars(), train_title(run.config, run.path.name),
                         list(modules or []))  # fmt: skip
    if not made:
        _note(notes, "no recorded step yet: no figure of the training")
    return made


def sweep_figures(sweep) -> dict:
    """{file name: Figure} of a sweep: depth.png over every run."""
    from probe.report.summary_plots import depth_figure

    depth = depth_figure(sweep.table, sweep_title(sweep))
    return {} if depth is None else {"depth.png": depth}


def figures(path: Path, layer: str | None = None, sample: int = 0, site: str = "output"):
    """(directory, {file name: Figure}) of a run or sweep directory (or a run's probe.h5)."""
    path = Path(path)
    path = path.parent if path.is_file() else path
    if is_sweep(path):
        return path, sweep_figures(open_sweep(path))
    with open_run(path) as run:
        return path, run_figures(run, layer, sample, site)


def plot(path: Path, layer: str | None = None, sample: int = 0, site: str = "output"):
    """Save the figures of one run or sweep directory; return the files written."""
    import matplotlib.pyplot as plt

    where, made = figures(path, layer, sample, site)
    written = []
    for name, fig in made.items():
        fig.savefig(where / name, dpi=110)
        plt.close(fig)
        written.append(where / name)
    return written


def coord(sweep: Path) -> list[Path]:
    """mup's coordinate check of a sweep of watched trainings over model.width: coord.csv (width,
    layer, step, abs_mean) and coord.png in the sweep directory."""
    import matplotlib.pyplot as plt

    from probe.report.train_plots import coord_figure, coord_table

    table = coord_table(sweep)
    table.to_csv(sweep / "coord.csv", index=False)
    fig = coord_figure(table, f"coordinate check: {sweep.name}")
    fig.savefig(sweep / "coord.png", dpi=110)
    plt.close(fig)
    return [sweep / "coord.csv", sweep / "coord.png"]


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="a run directory, its probe.h5, or a sweep")
    parser.add_argument("view", nargs="?", choices=["coord"],
                        help="coord: mup's coordinate check of a sweep of trainings over "
                             "model.width (coord.png, coord.csv)")  # fmt: skip
    parser.add_argument("--layer", help="feature maps of this layer (default: the first conv)")
    parser.add_argument("--sample", type=int, default=0, help="row of the sample (default 0)")
    parser.add_argument("--site", default="output", help="dataset of the layer (default output)")
    args = parser.parse_args(argv)
    if not have_matplotlib():
        print(f"error: {PLOT_EXTRA}", file=sys.stderr)
        return 2
    try:
        files = coord(args.path) if args.view == "coord" else None
        for file in files or plot(args.path, args.layer, args.sample, args.site):
            print(file)
    except (ProbeError, KeyError, IndexError, FileNotFoundError) as e:
        print(f"probe.plot: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
