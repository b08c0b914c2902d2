"""`python -m probe.plot`: a run's or a sweep's figures (probe.analysis.plot)."""

import sys

from probe.analysis.plot import main

if __name__ == "__main__":
    sys.exit(main())
