"""Peak memory and time of one attribution graph at several prompt lengths on the CPU, beside the
dense nodes x nodes float32 matrix circuit-tracer allocates for the same nodes.

    python scripts/bench_graph_memory.py                          # tiny GPT-2: 64, 256, 1024 tokens
    python scripts/bench_graph_memory.py --lengths 64 512 --batch 32
    python scripts/bench_graph_memory.py --model smollm2 --lengths 256 1024 2048 \\
        --max-feature-nodes 64 --repeat 2                         # SmolLM2-135M's shape
    python scripts/bench_graph_memory.py --model smollm2 --layers 8 --lengths 4096 ...  # fewer blocks

Models (random weights, seeded):
- `tiny`: GPT-2, 2 blocks, width 64, 2 heads, vocabulary 200; random TopK transcoders (k=4 of
  512 features, a skip matrix).
- `smollm2`: a Llama of SmolLM2-135M's shape: 30 blocks (`--layers` fewer, labelled in the
  table), width 576, 9 query heads over 3 key/value heads, intermediate 1536, vocabulary 49,152,
  tied embeddings, rope base 100,000, sdpa attention; random TopK transcoders reading the MLP's
  input, 5 active features of 4,608 per position and layer.

Each length runs in a fresh subprocess (`--repeat` times, for the spread between identical
runs): the model and transcoders are built, one 8-token graph warms up, the peak RSS is reset
(VmHWM) and the graph is attributed (floor `--floor`, default 0: every edge kept;
`--max-feature-nodes` features, the most influential first, as circuit-tracer's option) and
pruned. `--batch` fixes the prompt copies per backward; without it the memory plan chooses
(probe.graphs.batch_plan), and the table shows its choice. The table gives the peak RSS the
graph added over the warm process, the whole process's peak, the sparse adjacency's bytes
(int64 indices and a float32 value per entry), the dense matrix's (nodes^2 x 4), the frozen
attention patterns' (blocks x heads x tokens^2 x 4, if they were held: each backward pass makes
a block's again), seconds,
and seconds per attributed row (logits and features: one row per prompt copy per backward).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import bench_common as bc  # first: it puts the repository root on sys.path
import torch

TINY = dict(layers=2, width=64, heads=2, vocab=200)
SMOLLM2 = dict(layers=30, width=576, heads=9, kv_heads=3, intermediate=1536, vocab=49152)
SMOLLM2_FEATURES, SMOLLM2_ACTIVE = 8 * 576, 5


def build(kind: str, layers: int | None, n_ctx: int):
    """The seeded random model and transcoder set of `kind` (tiny | smollm2)."""
    from probe.testing.random_transcoders import random_transcoders

    torch.manual_seed(0)
    if kind == "tiny":
        from transformers import GPT2Config, GPT2LMHeadModel

        s = TINY | ({"layers": layers} if layers else {})
        config = GPT2Config(n_layer=s["layers"], n_embd=s["width"], n_head=s["heads"],
                            vocab_size=s["vocab"], n_positions=max(n_ctx, 2048))  # fmt: skip
        model = GPT2LMHeadModel(config).eval()
        ts = random_transcoders(s["width"], s["layers"], activation="topk", skip=True, expansion=8)
        k = 4
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        s = SMOLLM2 | ({"layers": layers} if layers else {})
        config = LlamaConfig(
            hidden_size=s["width"], intermediate_size=s["intermediate"],
            num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
            num_key_value_heads=s["kv_heads"], vocab_size=s["vocab"],
            max_position_embeddings=max(n_ctx, 8192), rope_theta=100000.0,
            tie_word_embeddings=True, attn_implementation="sdpa",
        )  # fmt: skip
        model = LlamaForCausalLM(config).eval()
        ts = random_transcoders(s["width"], s["layers"], activation="topk",
                                expansion=SMOLLM2_FEATURES // s["width"])  # fmt: skip
        k = SMOLLM2_ACTIVE
    for t in ts.transcoders.values():
        t.k = k
    return model, ts, s


def child(args) -> dict:
    from probe.graphs.attribution import GraphOptions, attribute

    torch.set_num_threads(args.threads)
    length = args.child
    model, ts, shape = build(args.model, args.layers, length)
    tokens = torch.randint(0, shape["vocab"], (length,), generator=torch.Generator().manual_seed(1))
    options = GraphOptions(batch_size=args.batch, floor=args.floor,
                           max_feature_nodes=args.max_feature_nodes)  # fmt: skip
    attribute(model, tokens[:8], ts, options).prune()  # warm-up
    before = bc.status_mb("VmRSS") or 0.0
    reset = bc.reset_peak()
    start = time.perf_counter()
    graph = attribute(model, tokens, ts, options).prune()
    seconds = time.perf_counter() - start
    whole = bc.peak_rss_mb()
    a = graph.adjacency
    n = graph.n_nodes
    rows = graph.n_features + graph.n_logits
    patterns = shape["layers"] * shape["heads"] * length * length * 4
    return {
        "tokens": length, "layers": shape["layers"], "nodes": n, "features": graph.n_features,
        "active": graph.active_features, "rows": rows, "nnz": a._nnz(),
        "sparse_mb": a._nnz() * (2 * 8 + 4) / 2**20, "dense_mb": n * n * 4 / 2**20,
        "patterns_mb": patterns / 2**20, "peak_mb": whole - before, "process_mb": whole,
        "before_mb": before, "peak_reset": reset, "seconds": seconds,
        "per_row": seconds / max(rows, 1), "batch": graph.batch,
        "replacement": graph.scores["replacement"],
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    p.add_argument("--layers", type=int, default=None, help="blocks (default: the model's)")
    p.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--batch", type=int, default=None,
                   help="prompt copies per backward (default: the memory plan's)")  # fmt: skip
    p.add_argument("--max-feature-nodes", type=int, default=None,
                   help="features attributed (default: every active one; circuit-tracer 8192)")  # fmt: skip
    p.add_argument("--floor", type=float, default=0.0, help="graph floor (default 0)")
    p.add_argument("--repeat", type=int, default=1, help="runs of each length")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="also write the table as markdown to OUT")
    p.add_argument("--json", default=None, help="also append each run's figures to this file")
    args = p.parse_args()
    if args.child is not None:
        print(json.dumps(child(args)))
        return
    rows = []
    for length in args.lengths:
        for run in range(args.repeat):
            argv = [__file__, "--child", str(length), "--model", args.model, "--floor",
                    str(args.floor), "--threads", str(args.threads)]  # fmt: skip
            for flag, value in (("--layers", args.layers), ("--batch", args.batch),
                                ("--max-feature-nodes", args.max_feature_nodes)):  # fmt: skip
                if value is not None:
                    argv += [flag, str(value)]
            r = bc.child_json(argv)
            if "error" in r:
                print(f"{length} tokens: {r['error']}", file=sys.stderr)
                continue
            print(json.dumps(r), file=sys.stderr, flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(r | {"model": args.model, "run": run}) + "\n")
            rows.append([
                r["tokens"], r["layers"], run + 1, f"{r['nodes']:,}", f"{r['active']:,}", r["rows"],
                f"{r['nnz']:,}", f"{r['sparse_mb']:.1f}", f"{r['dense_mb']:,.1f}",
                f"{r['patterns_mb']:,.0f}", r["batch"], f"{r['peak_mb']:,.0f}",
                f"{r['process_mb']:,.0f}", f"{r['seconds']:.1f}", f"{r['per_row']:.2f}",
            ])  # fmt: skip
    cols = [
        "tokens", "blocks", "run", "nodes", "active features", "rows", "edges", "sparse MB",
        "dense MB", "patterns MB", "batch", "peak RSS MB", "process peak MB", "s", "s / row",
    ]  # fmt: skip
    what = (f"tiny GPT-2 ({TINY['layers']} blocks, width {TINY['width']})" if args.model == "tiny"
            else f"SmolLM2-135M's shape (width {SMOLLM2['width']})")  # fmt: skip
    batch = f"batch {args.batch}" if args.batch else "batch from the memory plan"
    nodes = f", max_feature_nodes {args.max_feature_nodes}" if args.max_feature_nodes else ""
    text = bc.markdown(
        [f"Graph memory, {what}, {batch}{nodes}, floor {args.floor:g}, CPU"],
        cols, rows,
        ["peak RSS: what attributing and pruning added over the warm process (VmHWM reset); "
         "process peak: the whole process's",
         "dense MB: one nodes x nodes float32 matrix (circuit-tracer's adjacency for these nodes)",
         "patterns MB: what the frozen attention patterns would take if they were held (blocks x heads x tokens^2 x 4); each backward pass makes a block's again"],
    )  # fmt: skip
    print(text)
    if args.out:
        from pathlib import Path

        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
