"""A circuit run's files: `/circuit` in probe.h5, circuit.csv, faithfulness.csv, circuit_areas.csv
and the edge scores in MIB's submission format; and `read` for what was written.

`/circuit` (attributes: the graph's shape, the choices that made the scores, the pairs counted):
`senders`, `receivers`, `edges` (names), `edge_sender`, `edge_receiver` (indices), then per
method a group `/circuit/METHOD` with `scores` (the mean per edge), the float64 sums that merge
exactly (`edge_sum`, `edge_sumsq`, `node_sum`, `node_sumsq`; attribute `count`), and, where
circuits were evaluated, `circuits` (sizes x edges, 1 for an edge kept) and `faithfulness` (sizes,
edges asked and kept, metric, faithfulness; attributes full, empty, cpr, cmd). A mean ablation's
node means are in `/circuit/means` (`input`, `heads{layer}`, `mlp{layer}`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np
import pandas as pd

from probe.circuits.component_graph import ComponentGraph
from probe.circuits.cut import RISES_WITH_ANSWER, importance
from probe.circuits.faithfulness import Curve
from probe.circuits.scores import EdgeScores
from probe.circuits.states import SenderStates
from probe.errors import DataError

GROUP = "circuit"
EDGE_COLUMNS = ["edge", "sender", "receiver", "method", "score", "rank"]
FAITHFULNESS_COLUMNS = ["method", "size", "edges", "metric", "faithfulness"]
AREA_COLUMNS = ["method", "select", "absolute", "ablation", "metric", "full", "empty", "cpr", "cmd"]
_TEXT = h5py.string_dtype()


@dataclass
class CircuitResult:
    """What a circuit run found: the graph, each method's scores and (where evaluated) curves
    and circuits (sizes x edges, bool), and the choices that made them (`choices`: metric,
    ablation, select, absolute, steps, position, sizes)."""

    graph: ComponentGraph
    scores: dict[str, EdgeScores]
    choices: dict
    width: int = 0
    curves: dict[str, Curve] = field(default_factory=dict)
    circuits: dict[str, np.ndarray] = field(default_factory=dict)
    means: SenderStates | None = None

    @property
    def metric(self) -> str:
        return self.choices.get("metric", "logit_diff")

    def ranks(self, method: str) -> np.ndarray:
        """(E,) 1 for the most important edge (by the run's absolute or signed choice)."""
        key = importance(self.scores[method].edges, self.metric, self.choices.get("absolute", True))
        order = np.argsort(-key, kind="stable")
        rank = np.empty(len(order), dtype=np.int64)
        rank[order] = np.arange(1, len(order) + 1)
        return rank


def edge_table(result: CircuitResult, top: int | None = None) -> pd.DataFrame:
    """circuit.csv: per method, every edge (or its `top` most important) with its mean score and
    rank, rank order."""
    graph, frames = result.graph, []
    senders = np.array(graph.senders, dtype=object)[graph.edge_sender]
    receivers = np.array(graph.receivers, dtype=object)[graph.edge_receiver]
    names = np.array(graph.edges, dtype=object)
    for method, scores in result.scores.items():
        rank = result.ranks(method)
        order = np.argsort(rank, kind="stable")[:top]
        frames.append(
            pd.DataFrame(
                {
                    "edge": names[order],
                    "sender": senders[order],
                    "receiver": receivers[order],
                    "method": method,
                    "score": scores.edges[order],
                    "rank": rank[order],
                }
            )
        )
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=EDGE_COLUMNS)


def faithfulness_table(result: CircuitResult) -> pd.DataFrame:
    """faithfulness.csv: per method the empty circuit (size 0), each size and the full model
    (size 100): the edges kept, the mean metric and the faithfulness."""
    rows = []
    for method, c in result.curves.items():
        rows.append((method, 0.0, 0, c.empty, 0.0))
        f = c.faithfulness
        for size, edges, value, faith in zip(c.sizes, c.edges, c.metric, f, strict=True):
            if size != 100:
                rows.append((method, float(size), int(edges), value, float(faith)))
        rows.append((method, 100.0, result.graph.n_edges, c.full, 1.0))
    return pd.DataFrame(rows, columns=FAITHFULNESS_COLUMNS)


def areas_table(result: CircuitResult) -> pd.DataFrame:
    """circuit_areas.csv: per method MIB's CPR and CMD and the choices they depend on."""
    ch = result.choices
    rows = [
        (
            m,
            ch.get("select"),
            ch.get("absolute"),
            ch.get("ablation"),
            result.metric,
            c.full,
            c.empty,
            *c.areas,
        )
        for m, c in result.curves.items()
    ]
    return pd.DataFrame(rows, columns=AREA_COLUMNS)


def write_tables(result: CircuitResult, run_dir: Path) -> list[Path]:
    """circuit.csv, and where circuits were evaluated faithfulness.csv and circuit_areas.csv."""
    run_dir = Path(run_dir)
    out = [run_dir / "circuit.csv"]
    edge_table(result).to_csv(out[0], index=False)
    if result.curves:
        out += [run_dir / "faithfulness.csv", run_dir / "circuit_areas.csv"]
        faithfulness_table(result).to_csv(out[1], index=False)
        areas_table(result).to_csv(out[2], index=False)
    return out


def mib_importances(result: CircuitResult, method: str) -> dict:
    """The method's edge scores as MIB's importance-score JSON (hannamw/EAP-IG's
    `ComponentGraph.to_json`): {cfg, nodes: {name: {in_graph}}, edges: {name: {score, in_graph}}},
    every edge out of the circuit (in_graph false, as EAP-IG writes scores before any cut).
    Scores are turned so that larger means more important (as MIB's loss-based scores): negated
    for a metric that rises with the answer. A key/value head's k and v edges become one edge per
    query head of its group (MIB ungroups grouped-query attention), each with 1/group of the
    score, so that a group's scores sum to the key/value head's."""
    graph = result.graph
    score = result.scores[method].edges
    if result.metric in RISES_WITH_ANSWER:
        score = -score
    group = graph.heads // graph.kv_heads
    edges = {}
    for i, name in enumerate(graph.edges):
        sender, receiver = name.split("->")
        r = graph.edge_receiver[i]
        heads = graph.query_heads(r)
        if receiver.endswith(("<k>", "<v>")) and group > 1:
            layer, kind = receiver.split(".")[0], receiver[-2]
            for h in heads:
                edges[f"{sender}->{layer}.h{h}<{kind}>"] = {
                    "score": float(score[i]) / group,
                    "in_graph": False,
                }
        else:
            edges[name] = {"score": float(score[i]), "in_graph": False}
    nodes = {name: {"in_graph": False} for name in graph.senders}
    nodes["logits"] = {"in_graph": True}
    cfg = {
        "n_layers": graph.layers,
        "n_heads": graph.heads,
        "parallel_attn_mlp": bool(graph.parallel),
        "d_model": int(result.width),
    }
    return {"cfg": cfg, "nodes": nodes, "edges": edges}


def write_mib(result: CircuitResult, run_dir: Path) -> list[Path]:
    """mib/METHOD/importances.json per method: a folder to upload as one task/model folder of a
    MIB submission (renamed TASK_MODEL, e.g. ioi_gpt2)."""
    out = []
    for method in result.scores:
        path = Path(run_dir) / "mib" / method / "importances.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(mib_importances(result, method)))
        out.append(path)
    return out


def write_circuit(result: CircuitResult, f: h5py.File) -> None:
    """`/circuit` into an open file that holds none (the run's sink gives it: probe.store.sink's
    `write_whole`)."""
    graph = result.graph
    g = f.create_group(GROUP)
    g.attrs.update(
        layers=graph.layers,
        heads=graph.heads,
        kv_heads=graph.kv_heads,
        parallel=bool(graph.parallel),
        width=int(result.width),
        choices=json.dumps(result.choices, sort_keys=True),
        methods=json.dumps(list(result.scores)),
    )
    for name in ("senders", "receivers", "edges"):
        g.create_dataset(name, data=np.array(getattr(graph, name), dtype=object), dtype=_TEXT)
    g.create_dataset("edge_sender", data=graph.edge_sender)
    g.create_dataset("edge_receiver", data=graph.edge_receiver)
    for method, s in result.scores.items():
        m = g.create_group(method)
        m.attrs["count"] = int(s.count)
        m.create_dataset("scores", data=s.edges)
        for key in ("edge_sum", "edge_sumsq", "node_sum", "node_sumsq"):
            m.create_dataset(key, data=getattr(s, key))
        if method in result.circuits:
            m.create_dataset("circuits", data=result.circuits[method].astype(np.uint8))
        curve = result.curves.get(method)
        if curve is not None:
            c = m.create_group("faithfulness")
            c.attrs.update(
                full=curve.full, empty=curve.empty, cpr=curve.areas[0], cmd=curve.areas[1]
            )
            c.create_dataset("sizes", data=np.array(curve.sizes, dtype=np.float64))
            c.create_dataset("asked", data=np.array(curve.asked, dtype=np.int64))
            c.create_dataset("edges", data=np.array(curve.edges, dtype=np.int64))
            c.create_dataset("metric", data=np.array(curve.metric, dtype=np.float64))
            c.create_dataset("faithfulness", data=curve.faithfulness)
    if result.means is not None:
        _write_means(g.create_group("means"), result.means)


def _write_means(g: h5py.Group, means: SenderStates) -> None:
    """Each node's mean: (D,) or per position (T, D), without the broadcast row."""

    def plain(t):
        t = t[0, 0] if t.shape[1] == 1 else t[0]
        return t.detach().cpu().numpy()

    g.create_dataset("input", data=plain(means.input))
    for i, (h, m) in enumerate(zip(means.heads, means.mlp, strict=True)):
        g.create_dataset(f"heads{i}", data=plain(h))
        g.create_dataset(f"mlp{i}", data=plain(m))


def read(h5_path: Path) -> CircuitResult:
    """What `write_circuit` wrote, or a DataError naming the file and how to make it."""
    h5_path = Path(h5_path)
    with h5py.File(h5_path, "r") as f:
        if GROUP not in f:
            raise DataError(
                f"{str(h5_path)!r} holds no circuit: run with dataset=pairs and circuit.method "
                "(e.g. circuit.method=[eap]) to score edges"
            )
        return read_group(f[GROUP])


def read_group(g: h5py.Group) -> CircuitResult:
    """The CircuitResult of an open file's `/circuit`."""
    a = g.attrs
    graph = ComponentGraph(
        int(a["layers"]), int(a["heads"]), int(a["kv_heads"]), bool(a["parallel"])
    )
    result = CircuitResult(graph, {}, json.loads(a["choices"]), int(a["width"]))
    for method in json.loads(a["methods"]):
        m = g[method]
        result.scores[method] = EdgeScores(
            graph,
            method,
            m["edge_sum"][:],
            m["edge_sumsq"][:],
            m["node_sum"][:],
            m["node_sumsq"][:],
            int(m.attrs["count"]),
        )
        if "circuits" in m:
            result.circuits[method] = m["circuits"][:].astype(bool)
        if "faithfulness" in m:
            c = m["faithfulness"]
            result.curves[method] = Curve(
                method,
                tuple(c["sizes"][:].tolist()),
                tuple(c["asked"][:].tolist()),
                tuple(c["edges"][:].tolist()),
                tuple(c["metric"][:].tolist()),
                float(c.attrs["full"]),
                float(c.attrs["empty"]),
            )
    if "means" in g:
        result.means = read_means(g["means"], graph.layers)
    return result


def read_means(g: h5py.Group, layers: int) -> SenderStates:
    """The node means of `/circuit/means`."""
    return SenderStates.constant(
        g["input"][:],
        [g[f"heads{i}"][:] for i in range(layers)],
        [g[f"mlp{i}"][:] for i in range(layers)],
    )
