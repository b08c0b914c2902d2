"""`python -m probe.analyze`: linear probes and CKA over a run or a sweep (probe.analysis.analyze)."""

import sys

from probe.analysis.analyze import main

if __name__ == "__main__":
    sys.exit(main())
