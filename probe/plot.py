"""`python -m probe.plot`: a run's or a sweep's figures (probe.report.figures)."""

import sys

from probe.report.figures import main

if __name__ == "__main__":
    sys.exit(main())
