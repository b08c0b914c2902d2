"""One self-contained HTML page per run or sweep: `python -m probe.report RUN_OR_SWEEP`.

report.html holds the run's identity, summary table, the figures of probe.report.figures (base64 PNG data
URIs), linear probes and the CKA heatmap, effects and the resolved config: no other file and no
network is needed to read it, so it can be mailed or archived alone. A watched training's page
holds its training section (the figures of probe.report.train_plots, scalars per step, the last
step's table). A figure with nothing to draw, or linear probes on too few rows, are left out with
one line saying why. A sweep's page holds the
sweep table, its depth figure, gathered effects and one section per run (each run's own
report.html is written too and linked).
"""

from __future__ import annotations

import argparse
import html
import sys
from pathlib import Path

import pandas as pd
from omegaconf import OmegaConf

from probe.errors import ProbeError
from probe.read.runs import open_run, open_sweep
from probe.read.summaries import is_sweep
from probe.report.circuits import section as circuit_section
from probe.report.graph_figure import section as graph_section
from probe.report.html_parts import figure_png, img, page

CHEAP_BYTES = 64 * 2**20  # analyses run by the report itself only for files this small


def table(frame: pd.DataFrame | None, caption: str) -> str:
    if frame is None or frame.empty:
        return ""
    body = frame.to_html(index=False, na_rep="", border=0)
    return (
        f'<h3>{html.escape(caption)}</h3><div class="wide">{body}</div>'  # scrolls, page does not
    )


def analyses(path: Path, mode: str, size: int) -> str:
    """Run the linear probes and CKA when asked, or when the data are small (mode auto); return a
    note saying what was done or how to do it. Linear probes on too few rows per class (they
    would mean nothing) are left out, said in one line, unless asked for (mode yes)."""
    if (path / "linear_probes.csv").is_file() or (path / "cka.csv").is_file() or mode == "no":
        return ""
    how = f"python -m probe.analyze {path} all"
    if mode == "auto" and size > CHEAP_BYTES:
        return f"<p>No linear probes or CKA yet ({size / 2**20:.0f} MB of data): run <code>{html.escape(how)}</code>.</p>"
    from probe.analysis.streamed_analyses import analyze

    why = None if mode == "yes" or is_sweep(path) else too_few_rows(path)
    what = {"cka"} if why else "all"
    note = f"<p>No linear probes: {html.escape(why)}.</p>" if why else ""
    try:
        analyze(path, what)
    except ProbeError as e:
        return f"{note}<p>Analyses not run: {html.escape(str(e))}</p>"
    done = "CKA" if why else "linear probes and CKA"
    return f"{note}<p>{done} run for this report (<code>{html.escape(how)}</code>).</p>"


MIN_ROWS_PER_CLASS = 4  # fewer: a linear probe's held-out accuracy says nothing


def too_few_rows(path: Path) -> str | None:
    """Why a run's samples are too few for linear probes (fewer than MIN_ROWS_PER_CLASS per
    class of its targets), or None."""
    from probe.analysis.linear_probe import class_labels

    with open_run(path) as run:
        if "samples/target" not in run.file:
            return None
        labels = class_labels(run.file["samples/target"][: run.num_samples])
        rows = run.num_samples
    if labels is None:
        return None
    classes = len(labels[1])
    if rows >= MIN_ROWS_PER_CLASS * classes:
        return None
    return (
        f"{rows} samples of {classes} classes are too few to fit them (at least "
        f"{MIN_ROWS_PER_CLASS} per class: {MIN_ROWS_PER_CLASS * classes}); python -m "
        f"probe.report --analyze yes or python -m probe.analyze {path} linear fits them anyway"
    )


def analysis_section(path: Path) -> str:
    out = []
    csv = path / "linear_probes.csv"
    if csv.is_file():
        from probe.report.summary_plots import probes_figure

        probes = pd.read_csv(csv, dtype={"run": str})
        if not probes.empty:
            out.append(img(figure_png(probes_figure(probes)), "probes across depth"))
        out.append(table(probes, "Linear probes (linear_probes.csv)"))
    if (path / "cka.png").is_file():
        out.append("<h3>CKA (cka.png)</h3>" + img((path / "cka.png").read_bytes(), "cka"))
    elif (path / "cka.csv").is_file():
        out.append(table(pd.read_csv(path / "cka.csv"), "CKA (cka.csv)"))
    return "".join(out)


def identity(run) -> pd.DataFrame:
    """One row of what identifies the run."""
    from probe.report.figures import run_title

    cfg = run.config
    return pd.DataFrame(
        [
            {
                "directory": str(run.path),
                "state": run.state,
                "samples": run.num_samples,
                "store": run.attrs.get("store_mode", ""),
                "title": run_title(cfg, samples=run.num_samples),
                "layers": len(run.layers),
            }
        ]
    )


def feature_cards(run, sites: int = 3, cards: int = 4) -> str:
    """A few feature cards of the first sites with kept examples (stats.topk); the rest with
    `python -m probe.analyze RUN topk --layer ...`."""
    from probe.report.cards import cards_html
    from probe.store import stats_file

    kept = [k for k, info in stats_file.read(run.file).items()
            if info.topk is not None and "top" in info.topk.kinds]  # fmt: skip
    parts = [cards_html(run, layer, site, limit=cards) for layer, site in kept[:sites]]
    if len(kept) > sites:
        rest = ", ".join(f"{a} {b}" for a, b in kept[sites:])
        parts.append(f"<p>More sites with examples: {html.escape(rest)} (python -m probe.analyze "
                     f"{html.escape(str(run.path))} topk --layer L --site S)</p>")  # fmt: skip
    return "".join(parts)


def run_body(path: Path, analyze: str = "auto", layer=None, sample: int = 0) -> str:
    """The HTML sections of one run."""
    from probe.report.figures import run_figures

    with open_run(path) as run:
        watched = run.watched
    if watched:
        return training_body(path)
    size = (path / "probe.h5").stat().st_size if (path / "probe.h5").is_file() else 0
    note = analyses(path, analyze, size)
    with open_run(path) as run:
        parts = [table(identity(run), "Run"), table(run.summary, "Summary (summary.csv)")]
        parts.append("<h3>Figures</h3>")
        left_out: list[str] = []
        made = run_figures(run, layer, sample, notes=left_out)
        graphs = {n: made.pop(n) for n in list(made) if n.startswith("graph_")}
        for name, fig in made.items():
            parts.append(img(figure_png(fig), name))
        parts += [f"<p>{html.escape(line)}.</p>" for line in left_out]
        parts += [note, analysis_section(path), table(run.effects, "Effects (effects.csv)")]
        parts.append(table(run.attribution, "Attribution (attribution.csv)"))
        parts.append(table(run.lens, "Logit lens (lens.csv)"))
        parts.append(table(run.dla, "Direct logit attribution (dla.csv)"))
        parts.append(feature_cards(run))
        parts.append(circuit_section(path))
        parts.append(graph_section(path, graphs))
        config = OmegaConf.to_yaml(run.config, resolve=False)
    parts.append(f"<h3>Config</h3><pre>{html.escape(config)}</pre>")
    return "".join(parts)


def training_body(path: Path) -> str:
    """The HTML sections of a watched training (probe.watch): its state, the training section
    (its figures, the scalars per recorded step, the last step's table) and its settings; the
    probe batch's sweep over steps, when there is one, gets its own report."""
    import yaml

    from probe.read.train_steps import last_step
    from probe.report.figures import train_run_figures

    with open_run(path) as run:
        steps = run.train_scalars()
        state = pd.DataFrame([{"directory": str(run.path), "state": run.state,
                               "recorded steps": len(steps),
                               "last step": int(steps["step"].max()) if len(steps) else None}])  # fmt: skip
        parts = [table(state, "Watched training"), "<h2>Training</h2>"]
        left_out: list[str] = []
        for name, fig in train_run_figures(run, left_out).items():
            parts.append(img(figure_png(fig), name))
        parts += [f"<p>{html.escape(line)}.</p>" for line in left_out]
        parts.append(table(steps.dropna(axis=1, how="all"), "Per recorded step (scalars)"))
        parts.append(table(last_step(run.train()), "The last recorded step (train.csv)"))
        config = yaml.safe_dump(OmegaConf.to_container(run.config), sort_keys=False)
    batch = path / "probe_batch"
    if batch.is_dir() and is_sweep(batch):
        write(batch, "no")
        parts.append('<p>The probe batch over steps: <a href="probe_batch/report.html">'
                     "probe_batch/report.html</a></p>")  # fmt: skip
    parts.append(f"<h3>Watch settings (watch.yaml)</h3><pre>{html.escape(config)}</pre>")
    return "".join(parts)


def sweep_body(path: Path, analyze: str = "auto") -> str:
    """The HTML sections of a sweep; each run's report.html is written and linked."""
    from probe.report.figures import sweep_figures

    sweep = open_sweep(path)
    size = sum(
        (p / "probe.h5").stat().st_size for p in sweep.run_dirs if (p / "probe.h5").is_file()
    )
    note = analyses(path, analyze, size)
    parts = [table(sweep.overrides, "Runs and their overrides"), "<h3>Figures</h3>"]
    for name, fig in sweep_figures(sweep).items():
        parts.append(img(figure_png(fig), name))
    parts += [table(sweep.table, "Sweep table (summary.csv)"), note, analysis_section(path)]
    parts.append(table(sweep.effects, "Effects of every run"))
    parts.append(table(sweep.attribution, "Attribution of every run"))
    for png in sorted(path.glob("circuit_sweep_*.png")):
        parts.append(
            f"<h3>Circuits across the runs ({png.name})</h3>" + img(png.read_bytes(), png.name)
        )
    for run_dir in sweep.run_dirs:
        name = html.escape(run_dir.name)
        if not (run_dir / "probe.h5").is_file():
            parts.append(f"<h2>Run {name}</h2><p>no probe.h5 (the job failed)</p>")
            continue
        write(run_dir, "no")
        parts.append(
            f'<h2 id="run-{name}">Run {name}</h2><p><a href="{name}/report.html">'
            f"{name}/report.html</a> (figures and config)</p>"
        )
        with open_run(run_dir) as run:
            parts.append(table(identity(run), "Run") + table(run.summary, "Summary"))
    return "".join(parts)


def write(path: Path, analyze: str = "auto", layer=None, sample: int = 0) -> Path:
    """Write report.html into a run or sweep directory (or beside a run's probe.h5)."""
    from probe.report.figures import run_title, sweep_title, train_title

    path = Path(path)
    path = path.parent if path.is_file() else path
    if is_sweep(path):
        title, body = sweep_title(open_sweep(path)), sweep_body(path, analyze)
    else:
        body = run_body(path, analyze, layer, sample)
        with open_run(path) as run:
            title = (
                train_title(run.config, path.name)
                if run.watched
                else run_title(run.config, path.name, run.num_samples)
            )
    out = path / "report.html"
    out.write_text(page(title, body), encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> int:
    from probe.report.figures import PLOT_EXTRA, have_matplotlib

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="a run directory, its probe.h5, or a sweep")
    parser.add_argument(
        "--analyze",
        choices=["auto", "yes", "no"],
        default="auto",
        help="run probe.analyze first where its tables are absent: auto (small data only; no "
        "linear probes on fewer than 4 samples a class), yes, no",
    )
    parser.add_argument("--layer", help="feature maps of this layer (default: the first conv)")
    parser.add_argument("--sample", type=int, default=0, help="row of the sample (default 0)")
    args = parser.parse_args(argv)
    if not have_matplotlib():
        print(
            f"error: {PLOT_EXTRA.replace('probe.plot', 'probe.report')}",
            file=sys.stderr,
        )
        return 2
    try:
        print(write(args.path, args.analyze, args.layer, args.sample))
    except (ProbeError, KeyError, IndexError, FileNotFoundError) as e:
        print(f"probe.report: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
