"""A run's graphs as circuit-tracer's frontend JSON: every prompt's pruned graph in its
probe.h5 as `prompt_<i>.json` of one folder (RUN/graph_json) with the folder's index, what
`circuit_tracer.frontend.local_server.serve(RUN/graph_json)` lists (probe.graphs.graph_json);
a prompt's QK attribution (/graph_qk, probe.graphs.qk_h5, read back with its graph) goes into
its JSON too."""

from __future__ import annotations

import json
from pathlib import Path

import h5py

from probe.graphs.graph_files import load_graph
from probe.graphs.graph_h5 import graph_group, graph_path, prompt_rows
from probe.graphs.graph_json import METADATA_JSON, graph_model

GRAPH_JSON_DIR = "graph_json"  # a run's folder of JSON graphs, the folder the viewer serves


def write_run_graph_json(
    run_dir: str | Path, folder: str | Path | None = None, features: str | None = None
) -> Path:
    """Every prompt's graph in a run's probe.h5 as `prompt_<i>.json` in `folder` (default
    RUN/graph_json), with their index graph-metadata.json, one prompt in memory at a time;
    node_threshold from the run's graph.* options; `features` where the viewer finds the
    features' example files (graph_json.graph_model). Returns the folder."""
    path = graph_path(run_dir)
    with h5py.File(path, "r") as f:
        g = graph_group(f, path)
        prompts = [int(p) for p in prompt_rows(g)["prompt"]]
        options = json.loads(str(g.attrs.get("options", "{}")))
    folder = Path(folder) if folder is not None else path.parent / GRAPH_JSON_DIR
    folder.mkdir(parents=True, exist_ok=True)
    entries = []
    for prompt in prompts:
        graph = load_graph(path, prompt)  # (its QK table with it, where the run made one)
        slug = f"prompt_{prompt}"
        model = graph_model(
            graph, slug, node_threshold=options.get("node_threshold"), features=features
        )
        (folder / f"{slug}.json").write_text(json.dumps(model, indent=2))
        entries.append(model["metadata"])
    index = folder / METADATA_JSON
    old = json.loads(index.read_text())["graphs"] if index.exists() else []
    slugs = {e["slug"] for e in entries}
    graphs = [g for g in old if g.get("slug") not in slugs] + entries
    index.write_text(json.dumps({"graphs": graphs}, indent=2))
    return folder
