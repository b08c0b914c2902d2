"""`python -m probe.sites OVERRIDES`: the table of modules a probe can name (probe.hooks.sites).

Made callable, so that `probe.sites(model)` still calls the function once this module has been
imported (an import binds the package's `sites` attribute to the module).
"""

import sys

from probe.callable import make_callable
from probe.hooks.sites import main

make_callable(__name__, "probe.hooks.sites", "sites")

if __name__ == "__main__":
    sys.exit(main())
