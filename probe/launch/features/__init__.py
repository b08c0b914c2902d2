"""The run's features, in the order they wrap each batch's forward: `before_forward` in this
order, `after_forward` in the reverse one (the first is the outermost, as nested `with`s).
A new feature is one module holding a `RunFeature` (probe.hooks.run_feature) and one line:
an entry in FEATURES, or `register(MyFeature)` from anywhere before the run starts."""

from __future__ import annotations

from probe.hooks.run_feature import RunFeature
from probe.launch.features.attribution_graphs import AttributionGraphs
from probe.launch.features.attribution_maps import AttributionMaps
from probe.launch.features.capture_stats import CaptureStats
from probe.launch.features.circuit_scores import CircuitScores
from probe.launch.features.edit_effects import EditEffects
from probe.launch.features.lens_readout import LensReadout
from probe.launch.features.sae_splice import SaeSplice
from probe.launch.features.topk_examples import TopkExamples

FEATURES: list[type[RunFeature]] = [
    CaptureStats,  # captures and statistics: summary.csv
    EditEffects,  # edits and their effects, the patching grid and attribution patching
    AttributionMaps,  # attribution maps and integrated gradients: attribution.csv
    SaeSplice,  # SAE splices: sae.csv
    LensReadout,  # the lens and direct logit attribution: lens.csv, dla.csv
    TopkExamples,  # the top-k examples per unit, kept with the statistics
    CircuitScores,  # circuits: edge scores after the loop, /circuit, circuit.csv
    AttributionGraphs,  # attribution graphs after the loop: /graph, graph_*.csv
]


def register(feature: type[RunFeature]) -> type[RunFeature]:
    """Add `feature` to the runs that start from now on (innermost of the features); returns
    it, so it also serves as a class decorator."""
    if feature not in FEATURES:
        FEATURES.append(feature)
    return feature


def unregister(feature: type[RunFeature]) -> None:
    """Take a registered feature out of the runs that start from now on."""
    if feature in FEATURES:
        FEATURES.remove(feature)
