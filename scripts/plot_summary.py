"""Write a run's or a sweep's figures next to its data: a wrapper of `python -m probe.plot`.

python scripts/plot_summary.py RUN_OR_SWEEP
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from probe.report.figures import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
