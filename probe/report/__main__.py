"""`python -m probe.report`: one self-contained HTML page per run or sweep (probe.report.page)."""

import sys

from probe.report.page import main

if __name__ == "__main__":
    sys.exit(main())
