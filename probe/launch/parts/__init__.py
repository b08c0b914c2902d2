"""The run's parts, in the order they wrap each batch's forward: `before_forward` in this order,
`after_forward` in the reverse one (the first is the outermost, as nested `with`s: the
statistics and the examples see every value the others take), and their passes after the loop
in this order. A new part is one module holding a `RunPart`
(probe.launch.run_part) and one line: an entry in PARTS, or `register(MyPart)` from anywhere
before the run starts. Each part's module, class and `name` agree (statistics.py, Statistics,
"statistics")."""

from __future__ import annotations

from probe.launch.parts.attribution_graphs import AttributionGraphs
from probe.launch.parts.attribution_maps import AttributionMaps
from probe.launch.parts.circuit_scores import CircuitScores
from probe.launch.parts.edit_effects import EditEffects
from probe.launch.parts.lens_readout import LensReadout
from probe.launch.parts.sae_splice import SaeSplice
from probe.launch.parts.statistics import Statistics
from probe.launch.parts.topk_examples import TopkExamples
from probe.launch.run_part import RunPart

PARTS: list[type[RunPart]] = [
    Statistics,  # the captures' statistics: /stats, summary.csv
    TopkExamples,  # the top-k examples per unit: /topk
    EditEffects,  # edits and their effects, the patching grid and attribution patching
    AttributionMaps,  # attribution maps and integrated gradients: attribution.csv
    SaeSplice,  # SAE splices: sae.csv
    LensReadout,  # the lens and direct logit attribution: lens.csv, dla.csv
    CircuitScores,  # circuits: edge scores after the loop, /circuit, circuit.csv
    AttributionGraphs,  # attribution graphs after the loop: /graph, graph_*.csv
]


def register(part: type[RunPart]) -> type[RunPart]:
    """Add `part` to the runs that start from now on (innermost of the parts); returns it, so
    it also serves as a class decorator."""
    if part not in PARTS:
        PARTS.append(part)
    return part


def unregister(part: type[RunPart]) -> None:
    """Take a registered part out of the runs that start from now on."""
    if part in PARTS:
        PARTS.remove(part)
