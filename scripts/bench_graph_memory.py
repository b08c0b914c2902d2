"""Peak memory of probe's chunked sparse attribution against the dense nodes x nodes float32
matrix circuit-tracer allocates, at several prompt lengths, on a tiny GPT-2 on the CPU.

    python scripts/bench_graph_memory.py                    # 64, 256, 1024 tokens
    python scripts/bench_graph_memory.py --lengths 64 512 --batch 32

Each length runs in a fresh subprocess: the model (2 layers, width 64, seeded) and random TopK
transcoders (k=4 of 512 features, a skip matrix) are built, one short graph warms up, the peak RSS
is reset, and the graph is attributed (floor 0: every edge kept) and pruned. The table gives the
peak RSS the attribution and pruning added, the sparse adjacency's bytes (indices and values),
the dense matrix's bytes (nodes^2 x 4; circuit-tracer holds it and its rows at once, so about
twice that) and their ratios.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import bench_common as bc  # first: it puts the repository root on sys.path
import torch

LAYERS, WIDTH, HEADS, VOCAB = 2, 64, 2, 200


def child(length: int, batch: int) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel

    from probe.graphs.attribution import GraphOptions, attribute
    from probe.testing.random_transcoders import random_transcoders

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=LAYERS, n_embd=WIDTH, n_head=HEADS, vocab_size=VOCAB, n_positions=2048
    )
    model = GPT2LMHeadModel(config).eval()
    ts = random_transcoders(WIDTH, LAYERS, activation="topk", skip=True, expansion=8)
    for t in ts.transcoders.values():
        t.k = 4
    tokens = torch.randint(0, VOCAB, (length,))
    options = GraphOptions(batch_size=batch, floor=0.0)
    attribute(model, tokens[:16], ts, options).prune()  # warm-up
    before = bc.status_mb("VmRSS") or 0.0
    reset = bc.reset_peak()
    start = time.perf_counter()
    graph = attribute(model, tokens, ts, options).prune()
    seconds = time.perf_counter() - start
    peak = bc.peak_rss_mb() - before
    a = graph.adjacency
    n = graph.n_nodes
    return {
        "tokens": length, "nodes": n, "features": graph.n_features, "nnz": a._nnz(),
        "sparse_mb": a._nnz() * (2 * 8 + 4) / 2**20, "dense_mb": n * n * 4 / 2**20,
        "peak_mb": peak, "peak_reset": reset, "seconds": seconds,
        "replacement": graph.scores["replacement"],
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--batch", type=int, default=64, help="target rows per backward")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="also write the table as markdown to OUT")
    args = p.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.batch)))
        return
    rows = []
    for length in args.lengths:
        r = bc.child_json([__file__, "--child", str(length), "--batch", str(args.batch)])
        if "error" in r:
            print(f"{length} tokens: {r['error']}", file=sys.stderr)
            continue
        rows.append([
            r["tokens"], r["nodes"], r["features"], r["nnz"], f"{r['sparse_mb']:.1f}",
            f"{r['dense_mb']:.1f}", f"{r['peak_mb']:.0f}", f"{r['dense_mb'] / r['peak_mb']:.2f}",
            f"{r['dense_mb'] / r['sparse_mb']:.1f}", f"{r['seconds']:.1f}",
        ])  # fmt: skip
    cols = [
        "tokens", "nodes", "features", "edges", "sparse MB", "dense MB", "peak RSS MB",
        "dense / peak", "dense / sparse", "s",
    ]  # fmt: skip
    text = bc.markdown(
        [f"Graph memory, tiny GPT-2 ({LAYERS} layers, width {WIDTH}), batch {args.batch}, CPU"],
        cols, rows,
        ["peak RSS: what attributing and pruning added over the warm model (VmHWM reset)",
         "dense MB: one nodes x nodes float32 matrix; circuit-tracer holds it and its rows"],
    )  # fmt: skip
    print(text)
    if args.out:
        from pathlib import Path

        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
