"""Benchmark: EAP edge scores over every edge of a GPT-2-shaped model, against a plain forward +
backward of the same batch, against the exact edge loop on the same pairs, against the peers
that are installed, and its peak memory. Shapes (--shape): `bench`, the model of the token
benchmarks (6 layers, width 256, 4 heads, vocab 5000: 1,108 edges); `gpt2-small`, GPT-2 small's
(12 layers, width 768, 12 heads, vocab 50257: 32,491 edges), random weights.

    python scripts/bench_circuits.py                       # 16 pairs x 32 tokens a batch
    python scripts/bench_circuits.py --rounds 5 --threads 1 --out docs/bench/circuits.md
    python scripts/bench_circuits.py --shape gpt2-small --pairs 8 --rounds 2

- time per batch: probe.circuits' `eap` (the corrupt forward, the clean forward with gradients,
  one backward to the receivers, the products with the senders' writes) over a plain forward +
  backward of the model (the logit difference's gradient to every parameter); target <= 3x.
- edges x pairs per second: `eap` against `exact` (one patched forward per edge, variants of
  16 edges a forward; timed on --exact-edges edges, its cost being linear in the edges); target
  >= 100x.
- the peers (--no-peers leaves them out), each timed on the same weights and batch, interleaved
  with the rest, with `eap`'s speed-up over it (the median of the per-round ratios) and the
  largest difference of its per-edge scores from probe's over the largest |score|; a line names
  each one skipped and why:
  - probe.testing.peers, the project's own copy of hannamw/EAP-IG's EAP (`get_scores_eap`
    rewritten for TransformerLens 4's TransformerBridge), wherever TransformerLens is installed;
  - hannamw/EAP-IG's own code (`eap.attribute.attribute(..., method="EAP")` on its `Graph`)
    and auto-circuit's edge attribution patching (its registry's "EAP": mask gradients at mask
    0 on the logit difference), both on a HookedTransformer with `use_attn_result`, which
    TransformerLens 4 no longer has (scripts/circuit_peers.py; auto-circuit 1.0.1 imports
    TransformerLens 2's KV cache module besides). They run in a venv of their own, e.g.:

        python3 -m venv venv-peers
        venv-peers/bin/pip install torch==2.14.1 torchvision==0.29.1 \
            transformer-lens==3.9.0 auto-circuit==1.0.1 attrs matplotlib \
            "hydra-core>=1.3.2,<1.4" h5py     # attrs: auto-circuit's undeclared import
        git clone https://github.com/hannamw/EAP-IG peers-src/EAP-IG  # not on PyPI
        PYTHONPATH=$PWD:peers-src/EAP-IG/src venv-peers/bin/python \
            scripts/bench_circuits.py --threads 2

    (transformer-lens 3.9 brings transformers 5, as probe's own venv has.)
- peak memory above the loaded model (CUDA: allocated; CPU: the resident set, glibc told to
  hand freed blocks back), each in a fresh process: a plain forward + backward of one batch;
  `eap` over 1, 2 and 8 batches (flat in the pairs); `eap` on one batch with 1 MiB chunks
  against the default 256 MiB; beside the size of every sender's write at every position of a
  batch (the tensor the chunks never build).
Interleaved rounds after a warm-up; medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import bench_common as bc  # first: it puts the repository root on sys.path

EAP_TARGET, EXACT_TARGET = 3.0, 100.0  # eap <= 3x forward + backward; >= 100x the exact loop
SHAPES = {  # layers, width, heads, vocab
    "bench": (bc.LAYERS, bc.WIDTH, bc.HEADS, bc.VOCAB),
    "gpt2-small": (12, 768, 12, 50257),
}


def parse_args(argv=None):
    p = bc.token_parser(__doc__, rounds=3)
    p.add_argument("--pairs", type=int, default=16, help="pairs a batch (default 16)")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--exact-edges", type=int, default=64, help="edges the exact loop is timed on")
    p.add_argument("--shape", choices=list(SHAPES), default="bench", help="the model's shape")
    p.add_argument("--no-peers", action="store_true", help="leave out the peers' EAP")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # BATCHES,BUDGET: one peak
    return p.parse_args(argv)


def assets(args, device):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    layers, width, heads, vocab = SHAPES[args.shape]
    config = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab,
                        n_positions=max(32, args.seq_len))  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(args.seed)
        model = GPT2LMHeadModel(config).eval().to(device)
    g = torch.Generator().manual_seed(args.seed + 1)

    def batch():
        n, t = args.pairs, args.seq_len
        clean = torch.randint(0, vocab, (n, t), generator=g)
        corrupt = clean.clone()
        corrupt[:, : t // 2 : 3] = torch.randint(
            0, vocab, (n, len(range(0, t // 2, 3))), generator=g
        )
        return {"input_ids": clean, "corrupt_ids": corrupt, "attention_mask": torch.ones_like(clean),
                "answer": torch.randint(0, vocab, (n, 1), generator=g),
                "wrong": torch.randint(0, vocab, (n, 1), generator=g)}  # fmt: skip

    return model, [batch() for _ in range(8)]


def forward_backward(model, batch, device) -> None:
    """The floor: the logit difference at the last position (its logits alone computed, as
    probe asks for them), its gradient to every parameter."""
    import torch

    ids = batch["input_ids"].to(device)
    logits = model(input_ids=ids, logits_to_keep=1).logits[:, -1]
    rows = torch.arange(len(ids), device=device)
    answer, wrong = batch["answer"][:, 0].to(device), batch["wrong"][:, 0].to(device)
    (logits[rows, answer] - logits[rows, wrong]).sum().backward()
    model.zero_grad(set_to_none=True)


def own_copy(model, tmp):
    """probe.testing.peers, the project's copy of EAP-IG's EAP, on a TransformerLens
    TransformerBridge over a copy of `model`: {label: (run, scores)} (run(batch) the timed call,
    scores(batch) by edge name), empty where it cannot run, and [(label, why)] skipped."""
    label = "probe.testing.peers' copy of EAP-IG's EAP"
    try:
        from probe.testing.peers import bridge, eap_scores, edge_scores

        b = bridge(model, tmp, str(model.device))
    except (ImportError, AttributeError) as e:
        return {}, [(label, f"{type(e).__name__}: {e}")]
    from importlib.metadata import version

    import torch

    def logit_diff(logits, batch):
        last = logits[:, -1]
        rows = torch.arange(len(last), device=last.device)
        a, w = batch["answer"][:, 0].to(last.device), batch["wrong"][:, 0].to(last.device)
        return last[rows, a] - last[rows, w]

    name = f"{label} (TransformerLens {version('transformer-lens')}'s TransformerBridge)"
    return {name: (lambda batch: eap_scores(b, batch, logit_diff),
                   lambda batch: edge_scores(b, batch, logit_diff))}, []  # fmt: skip


def all_peers(model, args, device):
    """The own copy and the published peers (scripts/circuit_peers.py) that run here:
    {label: (run, scores)}, and the lines naming those skipped and why."""
    import tempfile

    import circuit_peers

    os.environ["HF_HUB_OFFLINE"] = "1"
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        got, skipped = own_copy(model, tmp)
    real, more = circuit_peers.peers(model, device)
    got.update(real)
    return got, [
        f"peer skipped: {label}: {why} (the peers' venv: this script's docstring)"
        for label, why in skipped + more
    ]


def peak_mb(fn, device) -> float:
    """Peak memory of fn() (after one call for the one-off costs) above what was held before,
    in MB (CUDA: allocated bytes; CPU: the resident set, VmHWM after a reset)."""
    import gc

    import torch

    fn()
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        before = bc.status_mb("VmRSS") or 0.0
        bc.reset_peak()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    return bc.peak_rss_mb() - before


def child(args, model, parts, batches, device) -> int:
    """One peak in this fresh process, `--child BATCHES,BUDGET`: eap over that many batches with
    that chunk budget, or (0 batches) the plain forward + backward of one."""
    from probe.circuits.scores import attribute

    count, budget = (int(v) for v in args.child.split(","))
    if count == 0:
        fn = lambda: forward_backward(model, batches[0], device)  # noqa: E731
    else:
        fn = lambda: attribute(parts, batches[:count], ["eap"], budget=budget)  # noqa: E731
    print(json.dumps({"peak": peak_mb(fn, device)}))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    import time

    import numpy as np
    import torch

    from probe.circuits.context import BatchContext
    from probe.circuits.exact import exact_edges
    from probe.circuits.parts import parts_of
    from probe.circuits.receiver_grads import CHUNK_BYTES
    from probe.circuits.scores import attribute
    from probe.circuits.task import Ablation, AnswerMetric, pair_batch

    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, batches = assets(args, device)
    parts = parts_of(model)
    if args.child:
        return child(args, model, parts, batches, device)
    graph = parts.graph
    one = batches[:1]
    metric = AnswerMetric()

    def plain():
        forward_backward(model, one[0], device)

    edges = np.linspace(0, graph.n_edges - 1, args.exact_edges).astype(np.int64)

    def exact():
        ctx = BatchContext(parts, pair_batch(model, one[0], metric), metric, Ablation())
        exact_edges(ctx, edges)

    fns = {"forward+backward": plain, "eap": lambda: attribute(parts, one, ["eap"]), "exact": exact}
    agreement, skipped = {}, []
    if not args.no_peers:
        peers, skipped = all_peers(model, args, device)
        mine = attribute(parts, one, ["eap"])["eap"].edges
        for label, (run, scores) in peers.items():
            fns[label] = lambda run=run: run(one[0])
            theirs = scores(one[0])
            other = np.array([theirs[name] for name in graph.edges])
            agreement[label] = float(np.abs(mine - other).max() / np.abs(other).max())
    for fn in fns.values():  # warm-up
        fn()
    times = {k: [] for k in fns}
    for _ in range(args.rounds):
        for name, fn in fns.items():
            bc.sync_device()
            start = time.perf_counter()
            fn()
            bc.sync_device()
            times[name].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    per_round = [e / p for e, p in zip(times["eap"], times["forward+backward"], strict=True)]
    eap_ratio = statistics.median(per_round)
    rate = {"eap": graph.n_edges * args.pairs / med["eap"],
            "exact": len(edges) * args.pairs / med["exact"]}  # fmt: skip
    per_edge = [
        (x / len(edges)) / (e / graph.n_edges)
        for e, x in zip(times["eap"], times["exact"], strict=True)
    ]
    speedup = statistics.median(per_edge)  # per round, as the rates of one round compare
    common = [__file__, f"--pairs={args.pairs}", f"--seq-len={args.seq_len}", f"--seed={args.seed}",
              f"--shape={args.shape}"]  # fmt: skip
    if args.threads:
        common.append(f"--threads={args.threads}")
    peaks = {}
    # glibc returns freed blocks of 64 KiB and more at once, so the resident set follows what
    # is live (by default freed memory stays resident and a peak hides in reuse)
    os.environ.update({"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"})
    for label, spec in (("forward+backward", "0,0"), ("eap, 1 batch", f"1,{CHUNK_BYTES}"), ("eap, 2 batches", f"2,{CHUNK_BYTES}"),
                        ("eap, 8 batches", f"8,{CHUNK_BYTES}"),
                        ("eap, 1 batch, 1 MiB chunks", f"1,{2**20}")):  # fmt: skip
        got = bc.child_json([*common, f"--child={spec}"])
        peaks[label] = got.get("peak", float("nan"))
    dense = args.pairs * args.seq_len * graph.n_senders * parts.width * 4 / 2**20
    rows = [
        ["forward+backward", f"{med['forward+backward'] * 1e3:.1f}", "1.00", "-"],
        ["eap", f"{med['eap'] * 1e3:.1f}", f"{eap_ratio:.2f}", f"{rate['eap']:,.0f}"],
        [f"exact ({len(edges)} edges)", f"{med['exact'] * 1e3:.1f}", "-", f"{rate['exact']:,.0f}"],
    ]
    faster = {}
    for label in agreement:
        ratio = statistics.median(
            [p / f for p, f in zip(times[label], times["forward+backward"], strict=True)]
        )
        faster[label] = statistics.median(
            [p / e for p, e in zip(times[label], times["eap"], strict=True)]
        )
        rows.append([f"peer: {label}", f"{med[label] * 1e3:.1f}", f"{ratio:.2f}",
                     f"{graph.n_edges * args.pairs / med[label]:,.0f}"])  # fmt: skip
    head = [
        f"# bench_circuits ({args.shape}): {graph.n_edges} edges, {args.pairs} pairs x "
        f"{args.seq_len} tokens a batch, {device}, {torch.get_num_threads()} threads, "
        f"{args.rounds} rounds",
    ]
    notes = [
        f"eap per batch / forward+backward: {eap_ratio:.2f}x (target <= {EAP_TARGET:g}x): "
        f"{'met' if eap_ratio <= EAP_TARGET else 'MISSED'}",
        f"eap / exact, edges x pairs per second: {speedup:,.0f}x (target >= {EXACT_TARGET:g}x): "
        f"{'met' if speedup >= EXACT_TARGET else 'MISSED'}",
        "peak memory above the loaded model (MB, each in a fresh process): "
        + ", ".join(f"{k} {v:.1f}" for k, v in peaks.items())
        + f"; every sender's write of a batch would take {dense:.1f}",
    ]
    for label, worst in agreement.items():
        notes.append(
            f"peer: eap {faster[label]:.2f}x faster than {label} (per round); their scores "
            f"differ per edge by at most {worst:.1e} of the largest |score|"
        )
    notes += skipped
    text = bc.markdown(head, ["variant", "ms a batch", "x forward+backward", "edges x pairs / s"],
                       rows, notes)  # fmt: skip
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
