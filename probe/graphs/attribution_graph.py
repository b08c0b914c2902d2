"""The attribution graph users hold (`probe.attribution_graph` returns one): the graph's data
(probe.graphs.graph_data) with what is done with it as methods, each the function of the module
that does it: `prune` (probe.graphs.pruning), `save` (probe.graphs.graph_h5), `to_json`
(probe.graphs.graph_json). Those modules take the data alone, so nothing they import calls
back here."""

from __future__ import annotations

from pathlib import Path

from probe.graphs.graph_data import GraphData
from probe.graphs.graph_h5 import write_graph
from probe.graphs.graph_json import to_json
from probe.graphs.pruning import prune


class AttributionGraph(GraphData):
    """One prompt's attribution graph (its fields: probe.graphs.graph_data.GraphData)."""

    def prune(self, node_threshold: float = 0.8, edge_threshold: float = 0.98) -> AttributionGraph:
        """Fill the pruning fields (influence, cumulative, node_kept, edge_kept, scores) by
        probe.graphs.pruning.prune; returns self."""
        return prune(self, node_threshold, edge_threshold)

    def save(self, path) -> Path:
        """This graph in a new HDF5 file at `path` (the /graph layout of probe.graphs.graph_h5,
        its QK table as /graph_qk); `probe.graphs.graph_files.load_graph(path)` reads it back.
        Returns the path."""
        return write_graph(self, path)

    def to_json(self, path, slug: str | None = None, **options) -> Path:
        """This graph as circuit-tracer's frontend JSON at `path` (slug: the file's stem; options:
        scan, node_threshold, clerps), by probe.graphs.graph_json.to_json. Returns the path."""
        return to_json(self, path, slug, **options)
