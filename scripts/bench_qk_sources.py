"""The cost of the QK attribution traced to the nodes (`qk_sources="nodes"`,
probe.graphs.qk_sources) beside the position one, on random Llamas, by both directions side by
side: per shape, the graph's time, the position table's, then each direction's table (forward
passes carrying tangents, backward passes seeded per residual component): its time, the time
in its passes, the passes and their prompt copies, and the block passes its cost estimate
counted (a pass times the blocks it runs through); the ratio of the two, whether the tables are
equal, and the direction `nodes` takes. Figures: docs/bench/graphs.md, "The QK attribution
traced to the nodes".

    python scripts/bench_qk_sources.py [--shapes 3x32x7 6x128x16 6x576x15x9x3] [--keys 2]
        [--threads 1] [--forward-only 30x576x15x9x3] [--cells 1000 3000 [--before TREE]]

A shape is LAYERSxWIDTHxTOKENS[xHEADSxKV_HEADS] (default 4 heads, 2 key-value heads; head width
WIDTH/HEADS), TopK transcoders of 2 x WIDTH features, 12 active a position, with a skip path.
A --forward-only shape runs the forward direction's passes alone (every layer's parts, no table)
and prints the backward's estimate (its passes, not run). A --nodes-table shape makes the
forward direction's whole table alone (keys 2, rows 20) and prints its time, rows and the
process's resident-set peak (VmHWM) above the graph's.

--cells PARTS...: the peak memory of one layer's rows (qk_attribution._layer_rows, every query
position, keys 2, rows 20) at SmolLM2's block (width 576, 9 heads / 3, 15 tokens; layer 1 of a
2-block Llama in float32) with PARTS parts a position (random, summing to the residual), its
cells made in chunks (probe.graphs.qk_cells) beside one chunk of every cell (the memory the
table took before chunks), each in a fresh process: the resident-set peak above the process's
before the call (/proc/self/clear_refs, VmHWM), the seconds, the ratio, whether the rows are
the same. --before TREE adds a third column: the same call under another checkout's probe
(TREE on PYTHONPATH, e.g. `git archive <commit> probe | tar -x -C TREE`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
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


def cells_child(parts: int, mode: str) -> None:
    """(in a fresh process) one layer's rows at `parts` parts a position, `mode` "chunks" (the
    chunk size from the budget), "one-chunk" (every cell at once) or "as-is" (another tree's
    code, untouched); prints a JSON line: peak resident bytes above the start of the call,
    seconds, and the rows' digest."""
    torch.manual_seed(0)
    model = random_llama(2, 576, 9, 3)
    ts = random_transcoders(576, 2, activation="topk", skip=True, expansion=2)
    tokens = torch.randint(2, 256, (15,), generator=torch.Generator().manual_seed(1))
    seen = qk_attribution._Forward(model, ts, None)
    with seen, torch.no_grad():
        model(tokens[None], use_cache=False)
        x = seen.norm_io["attn_norm", 1][0][0]
        residual = qk_attribution._Residual(len(tokens))
        spread = torch.randn(parts - 1, *x.shape, generator=torch.Generator().manual_seed(2))
        spread *= float(x.norm(dim=-1).mean()) / (parts * x.shape[-1]) ** 0.5
        for pos in range(len(tokens)):
            for i in range(parts - 1):
                residual.add(pos, f"part {i}@{pos}", -1, spread[i, pos])
            residual.add(pos, f"part {parts - 1}@{pos}", -1, x[pos] - spread[:, pos].sum(0))
        del spread
        if mode == "one-chunk":
            from probe.graphs import qk_cells

            qk_cells.chunk_parts = lambda *shape: 1 << 40  # type: ignore[assignment]
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # (the resident-set peak from here)
        start_rss = _status("VmRSS")
        start = time.perf_counter()
        rows = qk_attribution._layer_rows(seen, 1, residual, list(range(len(tokens))), 2, 20)
        seconds = time.perf_counter() - start
    peak = _status("VmHWM") - start_rss
    digest = [len(rows), sum(abs(r[8]) for r in rows)]
    print(json.dumps({"peak": peak, "seconds": seconds, "digest": digest}))


def _status(field: str) -> int:
    """A /proc/self/status field in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure_cells(parts: int, threads: int, before: str | None) -> None:
    """One layer's rows at `parts` parts a position: chunks beside one chunk (and `before`)."""
    runs = [("chunks", "chunks", None), ("one chunk", "one-chunk", None)]
    if before:
        runs.append(("before", "as-is", before))
    got = {}
    for label, mode, tree in runs:
        env = dict(os.environ, PYTHONPATH=tree or os.environ.get("PYTHONPATH", ""))
        command = [sys.executable, __file__, "--cells-child", str(parts), mode]
        done = subprocess.run(command + ["--threads", str(threads)], env=env,
                              capture_output=True, text=True)  # fmt: skip
        if done.returncode:
            raise SystemExit(f"{label}: {done.stderr[-2000:]}")
        got[label] = json.loads(done.stdout.strip().splitlines()[-1])
    chunked = got["chunks"]
    line = f"{parts} parts a position: chunks {chunked['peak'] / 2**20:,.0f} MiB {chunked['seconds']:.1f} s"
    for label in list(got)[1:]:
        other = got[label]
        line += (
            f"; {label} {other['peak'] / 2**20:,.0f} MiB {other['seconds']:.1f} s "
            f"({other['peak'] / chunked['peak']:.1f}x the peak, rows "
            f"{'the same' if _same(other['digest'], chunked['digest']) else 'DIFFERENT'})"
        )
    print(line, flush=True)


def _same(a, b) -> bool:
    return a[0] == b[0] and abs(a[1] - b[1]) <= 1e-9 * abs(b[1])


def nodes_table(shape: str, keys: int) -> None:
    """The forward direction's whole table at `shape`, its time, rows and memory peak."""
    layers, width, tokens, *rest = (int(v) for v in shape.split("x"))
    heads, kv = rest if rest else (4, 2)
    model = random_llama(layers, width, heads, kv)
    ts = random_transcoders(width, layers, activation="topk", skip=True, expansion=2)
    prompt = torch.randint(2, 256, (tokens,), generator=torch.Generator().manual_seed(1))
    graph = probe.attribution_graph(model, prompt, ts, prepend_bos=False)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    start = time.perf_counter()
    table = qk_table(model, graph, ts, keys=keys, sources="nodes_forward")
    seconds = time.perf_counter() - start
    peak = _status("VmHWM")
    print(
        f"{shape}: nodes_forward table {seconds:.0f} s, {len(table):,} rows; resident peak "
        f"{peak / 2**30:.2f} GiB ({(peak - before) / 2**30:.2f} GiB above the start of the "
        "table)",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="*", default=["3x32x7", "6x128x16", "6x576x15x9x3"])
    parser.add_argument("--forward-only", nargs="*", default=[])
    parser.add_argument("--keys", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cells", nargs="*", type=int, default=[])
    parser.add_argument("--nodes-table", nargs="*", default=[])
    parser.add_argument("--before", default=None)
    parser.add_argument("--cells-child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.cells_child:
        cells_child(int(args.cells_child[0]), args.cells_child[1])
        return
    for shape in args.nodes_table:
        nodes_table(shape, args.keys)
    if args.cells:
        for parts in args.cells:
            measure_cells(parts, args.threads, args.before)
        return
    if args.nodes_table:
        return
    for shape in args.shapes:
        measure(shape, args.keys, forward_only=False)
    for shape in args.forward_only:
        measure(shape, args.keys, forward_only=True)


if __name__ == "__main__":
    main()
