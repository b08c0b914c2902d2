"""Write a grid of one layer's feature maps for one sample: a wrapper of `python -m probe.plot`.

    python scripts/plot_features.py RUN --layer layer1.0.conv1 --sample 0 [--site output]

Writes features_<layer>_<site>_<sample>.png in the run directory (needs a store=full run), with
the run's other figures.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from probe.report.figures import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
