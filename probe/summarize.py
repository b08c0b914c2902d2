"""`python -m probe.summarize`: per-layer statistic tables of a run or a sweep (probe.read.summaries)."""

import sys

from probe.read.summaries import main

if __name__ == "__main__":
    sys.exit(main())
