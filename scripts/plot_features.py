"""Write a grid of one layer's feature maps for one sample.

    python scripts/plot_features.py RUN --layer layer1.0.conv1 --sample 0 [--site output]

Writes features_<layer>_<site>_<sample>.png in the run directory (needs a store=full run).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from probe.errors import ProbeError  # noqa: E402
from probe.plots import features_figure  # noqa: E402
from probe.reading import open_run  # noqa: E402


def figure(run, layer: str, sample: int, site: str = "output", max_maps: int = 64):
    """The feature-map Figure of one sample, read lazily (only that row)."""
    array = run.array(layer, site)
    return features_figure(array[sample], f"{layer} {site}, sample {sample}", max_maps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a run directory")
    parser.add_argument("--layer", required=True, help="a layer name (see summary.csv)")
    parser.add_argument("--sample", type=int, default=0, help="row of the sample (default 0)")
    parser.add_argument("--site", default="output", help="dataset of the layer (default output)")
    parser.add_argument("--max-maps", type=int, default=64, help="at most this many channels")
    args = parser.parse_args(argv)
    try:
        with open_run(args.run) as run:
            fig = figure(run, args.layer, args.sample, args.site, args.max_maps)
            safe = args.layer.replace("/", "_")
            out = run.path / f"features_{safe}_{args.site}_{args.sample}.png"
            fig.savefig(out, dpi=110)
    except (ProbeError, KeyError, IndexError) as e:
        print(f"plot_features: error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
