"""`python -m probe.summarize`: per-layer statistic tables of a run or a sweep (probe.analysis.summarize)."""

import sys

from probe.analysis.summarize import main

if __name__ == "__main__":
    sys.exit(main())
