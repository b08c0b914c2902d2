"""The cost of the QK attribution traced to the nodes (`qk_sources="nodes"`,
probe.graphs.qk_sources) beside the position one, on random Llamas, by both directions side by
side: per shape, the graph's time, the position table's, then each direction's table (forward
passes carrying tangents, backward passes seeded per residual component): its time, the time
in its passes, the passes and their prompt copies, and the block passes its cost estimate
counted (a pass times the blocks it runs through); the ratio of the two, whether the tables are
equal, and the direction `nodes` takes. Figures: docs/bench/graphs.md, "The QK attribution
traced to the nodes".

    python scripts/bench_qk_sources.py [--shapes 3x32x7 6x128x16 6x576x15x9x3] [--keys 2]
        [--threads 1] [--forward-only 30x576x15x9x3]

A shape is LAYERSxWIDTHxTOKENS[xHEADSxKV_HEADS] (default 4 heads, 2 key-value heads; head width
WIDTH/HEADS), TopK transcoders of 2 x WIDTH features, 12 active a position, with a skip path.
A --forward-only shape runs the forward direction's passes alone (every layer's parts, no table:
at 30 blocks a query position's cells, heads x keys x parts^2 in float64, are gigabytes) and
prints the backward's estimate (its passes, not run).
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

import probe
from probe.graphs import qk_attribution, qk_sources
from probe.graphs.attribution import zeroed_positions
from probe.graphs.qk_attribution import qk_table
from probe.testing.random_transcoders import random_transcoders

ROW = ["layer", "head", "query_pos", "key_pos", "query_part", "key_part"]


def random_llama(layers: int, width: int, heads: int, kv: int) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=width // heads,
        max_position_embeddings=512, bos_token_id=1, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


class _Recorded(qk_sources.NodeSources):
    """NodeSources keeping its latest instance and the seconds spent in rows() (the passes and
    their contractions)."""

    latest: _Recorded | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rows_s = 0.0
        _Recorded.latest = self

    def rows(self, layer, positions):
        start = time.perf_counter()
        try:
            return super().rows(layer, positions)
        finally:
            self.rows_s += time.perf_counter() - start


def traced(model, graph, ts, keys: int, direction: str):
    """(table, seconds, the NodeSources that made it)."""
    start = time.perf_counter()
    table = qk_table(model, graph, ts, keys=keys, sources=f"nodes_{direction}")
    seconds = time.perf_counter() - start
    assert _Recorded.latest is not None
    return table, seconds, _Recorded.latest


def forward_passes(model, graph, ts, keys: int, graph_s: float, shape: str) -> None:
    """The forward direction's parts of every layer (as qk_table plans them), timed; the
    backward's estimate beside."""
    seen = qk_attribution._Forward(model, ts, None)
    with seen, torch.no_grad():
        model(graph.tokens[None], use_cache=False)
        writes = qk_attribution._mlp_writes(
            seen.rep, ts, zeroed_positions(model, graph.tokens, True)
        )
    positions = qk_attribution.query_positions(graph)
    needed = {}
    for layer in range(seen.parts.n_layers):
        pattern = seen.rep.saved["patterns"][layer][0].double()
        needed[layer] = qk_sources.needed_positions(pattern, positions, keys)
    start = time.perf_counter()
    traced = qk_sources.NodeSources(seen, writes, graph, ts, None, direction="forward",
                                    needed=needed)  # fmt: skip
    for layer in range(seen.parts.n_layers):
        traced.rows(layer, needed[layer])
    seconds = time.perf_counter() - start
    cost = traced.cost
    print(
        f"{shape}: graph {graph_s:.2f} s ({graph.n_features} feature nodes), "
        f"{len(traced.names)} columns; forward passes {seconds:.1f} s: "
        f"{traced.forward_passes} forwards of {cost.forward_batch} copies, "
        f"{cost.forward_blocks} block passes, {len(cost.groups)} group(s) "
        f"({1000 * seconds / cost.forward_blocks:.1f} ms a block pass); backward (not run): "
        f"{cost.backward_passes} passes of {cost.backward_batch} copies, "
        f"{cost.backward_blocks} block passes ({cost.backward_blocks / cost.forward_blocks:.1f}x"
        f" the forward's); nodes takes {cost.cheaper}",
        flush=True,
    )


def measure(shape: str, keys: int, forward_only: bool) -> None:
    layers, width, tokens, *rest = (int(v) for v in shape.split("x"))
    heads, kv = rest if rest else (4, 2)
    model = random_llama(layers, width, heads, kv)
    ts = random_transcoders(width, layers, activation="topk", skip=True, expansion=2)
    prompt = torch.randint(2, 256, (tokens,), generator=torch.Generator().manual_seed(1))
    start = time.perf_counter()
    graph = probe.attribution_graph(model, prompt, ts, prepend_bos=False)
    graph_s = time.perf_counter() - start
    if forward_only:
        forward_passes(model, graph, ts, keys, graph_s, shape)
        return
    start = time.perf_counter()
    qk_table(model, graph, ts, keys=keys)
    plain_s = time.perf_counter() - start
    qk_sources.NodeSources = _Recorded  # type: ignore[misc]
    try:
        forward, forward_s, fwd = traced(model, graph, ts, keys, "forward")
        backward, backward_s, bwd = traced(model, graph, ts, keys, "backward")
    finally:
        qk_sources.NodeSources = _Recorded.__mro__[1]  # type: ignore[misc]
    cost = fwd.cost
    pairs = forward.groupby(ROW[:4]).ngroups
    print(
        f"{shape}: graph {graph_s:.2f} s ({graph.n_features} feature nodes); position table "
        f"{plain_s:.2f} s; {pairs} pairs, {len(fwd.names)} columns; nodes takes "
        f"{cost.cheaper}",
        flush=True,
    )
    print(
        f"  forward: table {forward_s:.2f} s, passes {fwd.rows_s:.2f} s; {fwd.forward_passes} "
        f"forwards of {cost.forward_batch} copies, {cost.forward_blocks} block passes, "
        f"{len(cost.groups)} group(s)",
        flush=True,
    )
    # (in float32 a part is its direction's rounding of the largest parts of the side, so a
    # pair's `rows` largest may swap a near tie at the last place: rows compared where shared)
    got, want = (t.set_index(ROW).sort_index()["contribution"] for t in (forward, backward))
    shared = got.index.intersection(want.index)
    diff = (got[shared] - want[shared]).abs().max() / want.abs().max()
    print(
        f"  backward: table {backward_s:.2f} s, passes {bwd.rows_s:.2f} s; "
        f"{bwd.backward_passes} backward passes of {cost.backward_batch} copies, "
        f"{cost.backward_blocks} block passes",
        flush=True,
    )
    print(
        f"  backward / forward: table {backward_s / forward_s:.1f}x, passes "
        f"{bwd.rows_s / fwd.rows_s:.1f}x, block passes (estimate) "
        f"{cost.backward_blocks / cost.forward_blocks:.1f}x; per block pass: forward "
        f"{1000 * fwd.rows_s / cost.forward_blocks:.2f} ms, backward "
        f"{1000 * bwd.rows_s / cost.backward_blocks:.2f} ms; rows in both tables {len(shared)} "
        f"of {len(want)}, their largest difference {float(diff):.1e} of the largest "
        "|contribution|",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="*", default=["3x32x7", "6x128x16", "6x576x15x9x3"])
    parser.add_argument("--forward-only", nargs="*", default=[])
    parser.add_argument("--keys", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for shape in args.shapes:
        measure(shape, args.keys, forward_only=False)
    for shape in args.forward_only:
        measure(shape, args.keys, forward_only=True)


if __name__ == "__main__":
    main()
