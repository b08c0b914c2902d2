"""Figures of circuits (matplotlib figures; the callers save them): the graph of a method's top
edges, the faithfulness curves over circuit sizes, and when each top edge appears across the
runs of a sweep."""

from __future__ import annotations

import numpy as np
import pandas as pd

from probe.circuits.component_graph import ComponentGraph

POSITIVE, NEGATIVE = "#2166ac", "#b2182b"  # edge colours: score above zero, below zero


def node_positions(graph: ComponentGraph) -> dict[str, tuple[float, float]]:
    """x: the input at 0, layer l's heads at 2l + 1 and its MLP at 2l + 2, the logits last; y:
    a head's number (the MLP, the input and the logits in the middle)."""
    middle = (graph.heads - 1) / 2
    out = {"input": (0.0, middle), "logits": (2.0 * graph.layers + 1, middle)}
    for layer in range(graph.layers):
        for h in range(graph.heads):
            out[f"a{layer}.h{h}"] = (2.0 * layer + 1, float(h))
        out[f"m{layer}"] = (2.0 * layer + 2, middle)
    return out


def receiver_node(graph: ComponentGraph, receiver: int) -> str:
    """The node a receiver's edge is drawn to (a key/value head: the first head it serves)."""
    name = graph.receivers[receiver]
    if "<" not in name:
        return name
    layer = name.split(".")[0]
    return f"{layer}.h{graph.query_heads(receiver)[0]}"


def circuit_figure(
    graph: ComponentGraph, scores: np.ndarray, rank: np.ndarray, title: str, edges=40, labels=8
):
    """The `edges` best-ranked edges (rank 1 first; those scoring 0 left out) between nodes laid
    out by layer: colour by the score's sign, width by its size, the `labels` best named."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    where = node_positions(graph)
    chosen = np.argsort(rank, kind="stable")[: min(edges, graph.n_edges)]
    chosen = chosen[scores[chosen] != 0]  # (an edge of no effect is not drawn)
    width = max(6.0, 1.1 * (2 * graph.layers + 2))
    fig, ax = plt.subplots(figsize=(width, max(3.5, 1.5 + 0.45 * graph.heads)))
    biggest = float(np.abs(scores[chosen]).max()) if len(chosen) else 1.0
    used: set[str] = set()
    for n, e in enumerate(chosen[::-1]):  # the best drawn last, on top
        sender = graph.senders[graph.edge_sender[e]]
        target = receiver_node(graph, graph.edge_receiver[e])
        used.update((sender, target))
        (x0, y0), (x1, y1) = where[sender], where[target]
        value = float(scores[e])
        ax.annotate(
            "",
            xy=(x1, y1),
            xytext=(x0, y0),
            arrowprops={
                "arrowstyle": "-|>",
                "color": POSITIVE if value > 0 else NEGATIVE,
                "lw": 0.4 + 3.6 * abs(value) / biggest,
                "alpha": 0.75,
                "shrinkA": 6,
                "shrinkB": 6,
                "connectionstyle": "arc3,rad=0.08",
            },
        )
        if len(chosen) - n <= labels:
            ax.text(
                (x0 + x1) / 2,
                (y0 + y1) / 2,
                graph.edges[e],
                fontsize=6,
                ha="center",
                va="center",
                color="#222222",
                zorder=4,
                bbox={"boxstyle": "round,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.7},
            )
    for name, (x, y) in where.items():
        on = name in used
        ax.plot(x, y, "o", ms=9 if on else 5, color="#444444" if on else "#cccccc", zorder=3)
        if on:
            ax.text(x, y - 0.32, name, fontsize=6, ha="center", va="top")
    ticks = [0] + [2 * i + 1.5 for i in range(graph.layers)] + [2 * graph.layers + 1]
    ax.set_xticks(ticks, ["input"] + [f"layer {i}" for i in range(graph.layers)] + ["logits"])
    ax.set_yticks([])
    ax.set_ylim(-0.9, graph.heads - 0.1)
    ax.set_title(title, fontsize=9)
    for colour, label in ((POSITIVE, "score > 0"), (NEGATIVE, "score < 0")):
        ax.plot([], [], color=colour, label=label)
    ax.legend(fontsize=7, loc="upper left", frameon=False)
    fig.tight_layout()
    return fig


def faithfulness_figure(curves: dict, title: str):
    """Faithfulness against circuit size (percent of edges, log scale), a line per method with
    its CPR and CMD; the empty circuit at 0 and the full model at 1 dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for method, curve in curves.items():
        cpr, cmd = curve.areas
        sizes = [*curve.sizes, 100.0] if curve.sizes[-1] != 100 else list(curve.sizes)
        values = list(curve.faithfulness) + ([1.0] if curve.sizes[-1] != 100 else [])
        ax.plot(sizes, values, "o-", ms=4, label=f"{method} (CPR {cpr:.3f}, CMD {cmd:.3f})")
    for level in (0, 1):
        ax.axhline(level, color="#999999", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel("circuit size (% of edges)")
    ax.set_ylabel("faithfulness")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def sweep_figure(scores: pd.DataFrame, ranks: pd.DataFrame, top: int = 10, shown: int = 30):
    """When each top edge appears: rows the edges that reach the `top` ranks in some run (by
    the first run they do, at most `shown`), columns the runs in order; colour each run's score
    over that run's largest |score|, a dot where the edge is in that run's top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    inside = ranks <= top
    first = inside.to_numpy().argmax(1).astype(float)
    first[~inside.to_numpy().any(1)] = np.inf
    by_first = np.lexsort((ranks.min(axis=1).to_numpy(), first))
    order = [i for i in by_first if np.isfinite(first[i])][:shown]
    values = scores.to_numpy(dtype=float)
    scale = np.nanmax(np.abs(values), axis=0)
    values = values / np.where(scale > 0, scale, 1)
    fig, ax = plt.subplots(figsize=(2.5 + 0.6 * scores.shape[1], 1.2 + 0.22 * len(order)))
    image = ax.imshow(values[order], cmap="RdBu", vmin=-1, vmax=1, aspect="auto")
    rows, cols = np.nonzero(inside.to_numpy()[order])
    ax.plot(cols, rows, "k.", ms=4)
    ax.set_yticks(range(len(order)), [scores.index[i] for i in order], fontsize=6)
    ax.set_xticks(range(scores.shape[1]), list(scores.columns), rotation=45, ha="right", fontsize=7)
    ax.set_title(f"edges in some run's top {top} (dot: in that run's top {top})", fontsize=8)
    fig.colorbar(image, ax=ax, label="score / the run's largest |score|")
    fig.tight_layout()
    return fig
