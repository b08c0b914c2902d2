"""`python -m probe.summarize`: per-layer statistic tables of a run or a sweep (probe.read.summarize)."""

import sys

from probe.read.summarize import main

if __name__ == "__main__":
    sys.exit(main())
