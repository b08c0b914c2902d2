"""`python -m probe.report`: one self-contained HTML page per run or sweep (probe.analysis.report)."""

import sys

from probe.analysis.report import main

if __name__ == "__main__":
    sys.exit(main())
