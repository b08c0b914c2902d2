"""`python -m probe.sites OVERRIDES`: the table of modules a probe can name (probe.hooks.site_table),
and for a token model the node and edge counts of its component graph
(probe.circuits.component_graph).

Made callable, so that `probe.sites(model)` still calls the function once this module has been
imported (an import binds the package's `sites` attribute to the module).
"""

import sys

from probe.callable import make_callable
from probe.hooks.site_table import main

make_callable(__name__, "probe.hooks.site_table", "sites")


def circuit_counts(model, inputs) -> list[str]:
    """The component graph's counts of a token model; why there is none where its anatomy says."""
    if not (isinstance(inputs, dict) and "input_ids" in inputs):
        return []
    from probe.circuits.parts import graph_of
    from probe.errors import ConfigError

    try:
        counts = graph_of(model).counts()
    except ConfigError as e:
        return [f"component graph: none ({e})"]
    return ["component graph: " + ", ".join(f"{v:,} {k}" for k, v in counts.items())]


if __name__ == "__main__":
    sys.exit(main(notes=circuit_counts))
