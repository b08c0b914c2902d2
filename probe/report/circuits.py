"""A circuit run's figures and report section, and `python -m probe.analyze PATH circuit`.

- `write_figures`: circuit.png (the first method's best edges, probe.report.circuit_plots) and
  faithfulness.png (every method's curve, where circuits were evaluated) in the run directory.
- `section`: report.html's circuit section (the areas, the figures, the best edges).
- On a run, `python -m probe.analyze RUN circuit --top 200` prints each method's best edges and
  writes them to circuit_top.csv; on a sweep (over checkpoints: `model.checkpoint=a.pt,b.pt`) it
  gathers every run's scores into circuit_sweep.csv (one row per method and edge, one column per
  run, named by the overrides that differ between runs) and draws circuit_sweep_METHOD.png, when
  each top edge appears.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from probe.circuits.files import CircuitResult, edge_table, read
from probe.errors import DataError, ProbeError
from probe.intervene.patch_steer import run_file
from probe.read.summaries import is_sweep, read_overrides, sweep_runs

log = logging.getLogger("probe")
TOP = 200


def title(result: CircuitResult, method: str) -> str:
    c = result.choices
    sign = "|score|" if c.get("absolute", True) else "signed score"
    return (
        f"{method}: {result.metric}, {c.get('ablation')} ablation, ranked by {sign} "
        f"({result.graph.n_edges} edges, {result.scores[method].count} pairs)"
    )


def write_figures(result: CircuitResult, run_dir: Path) -> list[Path]:
    """circuit.png and faithfulness.png (none without matplotlib)."""
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("no matplotlib: circuit.png is not drawn (pip install -e '.[plot]')")
        return []
    from probe.report.circuit_plots import circuit_figure, faithfulness_figure

    run_dir, out = Path(run_dir), []
    method = next(iter(result.scores))
    fig = circuit_figure(
        result.graph, result.scores[method].edges, result.ranks(method), title(result, method)
    )
    out.append(run_dir / "circuit.png")
    fig.savefig(out[-1], dpi=120)
    plt.close(fig)
    if result.curves:
        c = result.choices
        what = f"{result.metric}, {c.get('ablation')} ablation, {c.get('select')} circuits"
        fig = faithfulness_figure(result.curves, what)
        out.append(run_dir / "faithfulness.png")
        fig.savefig(out[-1], dpi=120)
        plt.close(fig)
    return out


def section(run_dir: Path, top: int = 20) -> str:
    """report.html's circuit section, from the run directory's files ('' without circuit.csv)."""
    from probe.report.html_parts import img

    run_dir = Path(run_dir)
    if not (run_dir / "circuit.csv").is_file():
        return ""
    parts = ["<h3>Circuit</h3>"]
    areas = run_dir / "circuit_areas.csv"
    if areas.is_file():
        body = pd.read_csv(areas).to_html(index=False, border=0)
        parts.append(f"<p>MIB's areas (CPR: higher is better, CMD: lower)</p>{body}")
    for name in ("circuit.png", "faithfulness.png"):
        if (run_dir / name).is_file():
            parts.append(img((run_dir / name).read_bytes(), name))
    edges = pd.read_csv(run_dir / "circuit.csv")
    best = edges[edges["rank"] <= top]
    parts.append(
        f"<p>The {top} best edges of each method (circuit.csv holds every edge)</p>"
        f'<div class="wide">{best.to_html(index=False, border=0)}</div>'
    )
    return "".join(parts)


def run_top(run_dir: Path, top: int) -> pd.DataFrame:
    """Each method's `top` best edges; written to circuit_top.csv beside the run's file."""
    path = run_file(str(run_dir), "probe.analyze RUN circuit")
    table = edge_table(read(path), top)
    table.to_csv(path.parent / "circuit_top.csv", index=False)
    return table


def labels(runs: list[Path]) -> list[str]:
    """A column name per run: the overrides whose values differ between runs (a path by its
    file name), else the run directory's name."""
    overrides = [read_overrides(r) for r in runs]
    keys = sorted({k for o in overrides for k in o})
    varying = [k for k in keys if len({o.get(k) for o in overrides}) > 1]
    names = [
        ",".join(Path(str(o.get(k, ""))).name for k in varying) or r.name
        for r, o in zip(runs, overrides, strict=True)
    ]
    return names if len(set(names)) == len(names) else [r.name for r in runs]


def sweep_tables(path: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(scores, ranks): one row per (method, edge), one column per run of the sweep holding a
    circuit; an edge a run's graph lacks is empty there."""
    runs = [r for r in sweep_runs(path) if (r / "probe.h5").is_file()]
    results, kept = [], []
    for r in runs:
        try:
            results.append(read(r / "probe.h5"))
            kept.append(r)
        except DataError:
            log.info("%s holds no circuit: left out", r.name)
    if not results:
        raise DataError(
            f"no run of the sweep {str(path)!r} holds a circuit: sweep runs made with "
            "dataset=pairs and circuit.method (e.g. model.checkpoint=a.pt,b.pt circuit.method=[eap])"
        )
    scores, ranks = [], []
    for name, result in zip(labels(kept), results, strict=True):
        frame = edge_table(result)
        index = pd.MultiIndex.from_frame(frame[["method", "edge", "sender", "receiver"]])
        scores.append(pd.Series(frame["score"].to_numpy(), index=index, name=name))
        ranks.append(pd.Series(frame["rank"].to_numpy(), index=index, name=name))
    return pd.concat(scores, axis=1), pd.concat(ranks, axis=1)


def write_sweep(path: Path, top: int = 10) -> list[Path]:
    """circuit_sweep.csv and a circuit_sweep_METHOD.png per method."""
    path = Path(path)
    scores, ranks = sweep_tables(path)
    out = [path / "circuit_sweep.csv"]
    scores = scores.sort_index(level=["method", "edge"], sort_remaining=False)
    scores.reset_index().to_csv(out[0], index=False)
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        return out
    from probe.report.circuit_plots import sweep_figure

    for method in scores.index.get_level_values("method").unique():
        s = scores.xs(method, level="method").droplevel(["sender", "receiver"])
        r = ranks.xs(method, level="method").droplevel(["sender", "receiver"]).loc[s.index]
        fig = sweep_figure(s, r.fillna(np.inf), top)
        out.append(path / f"circuit_sweep_{method}.png")
        fig.savefig(out[-1], dpi=120)
        plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m probe.analyze PATH circuit",
        description="A run's best edges (circuit_top.csv), or a sweep's edge x run table "
        "(circuit_sweep.csv) and when each top edge appears (circuit_sweep_METHOD.png)",
    )
    parser.add_argument("path", type=Path, help="a run directory, its probe.h5, or a sweep")
    parser.add_argument("what", choices=["circuit"])
    parser.add_argument(
        "--top",
        type=int,
        default=None,
        help=f"edges per method (a run: default {TOP}; a sweep's figure: 10)",
    )
    args = parser.parse_args(argv)
    try:
        if args.top is not None and args.top < 1:
            raise DataError(f"--top {args.top}: give at least 1 edge")
        if is_sweep(args.path):
            for p in write_sweep(args.path, args.top or 10):
                print(p)
            return 0
        table = run_top(args.path, args.top or TOP)
    except ProbeError as e:
        print(f"probe.analyze: error: {e}", file=sys.stderr)
        return 2
    with pd.option_context("display.max_rows", None, "display.width", 160):
        print(table.to_string(index=False))
    run_dir = args.path if args.path.is_dir() else args.path.parent
    print(run_dir / "circuit_top.csv")
    return 0
