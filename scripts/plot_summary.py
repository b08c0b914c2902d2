"""Write statistics-across-depth and histogram PNGs next to a run's or a sweep's data.

    python scripts/plot_summary.py RUN_OR_SWEEP

A run gives depth.png and histograms.png in the run directory; a sweep gives depth.png in the sweep
directory with one line per run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from probe.errors import ProbeError  # noqa: E402
from probe.plots import depth_figure, histogram_figure  # noqa: E402
from probe.reading import open_run, open_sweep  # noqa: E402
from probe.summarize import is_sweep  # noqa: E402


def plot(path: Path) -> list[Path]:
    """Save the figures of one run or sweep directory; return the files written."""
    path = path.parent if path.is_file() else path
    if is_sweep(path):
        sweep = open_sweep(path)
        out = path / "depth.png"
        depth_figure(sweep.table, f"sweep {path.name}").savefig(out, dpi=110)
        return [out]
    with open_run(path) as run:
        written = [path / "depth.png", path / "histograms.png"]
        depth_figure(run.summary, f"run {path.name}").savefig(written[0], dpi=110)
        histogram_figure(run).savefig(written[1], dpi=110)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="a run or sweep directory")
    args = parser.parse_args(argv)
    try:
        for file in plot(args.path):
            print(file)
    except (ProbeError, KeyError) as e:
        print(f"plot_summary: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
