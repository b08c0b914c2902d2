"""The cost of the QK attribution traced to the nodes (`qk_sources="nodes"`,
probe.graphs.qk_sources) beside the position one, on random Llamas: per shape, the graph's time,
then each table's time, pairs and rows, and for the traced one its backward passes, seeds
(width x the positions each layer needs) and the prompt copies per pass. Figures:
docs/bench/graphs.md, "The QK attribution traced to the nodes".

    python scripts/bench_qk_sources.py [--shapes 3x32x7 6x128x16] [--keys 2] [--threads 1]

A shape is LAYERSxWIDTHxTOKENS (4 heads, 2 key-value heads, head width WIDTH/4, TopK
transcoders of 2 x WIDTH features, 12 active a position, with a skip path).
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

import probe
from probe.graphs import qk_sources
from probe.graphs.qk_attribution import qk_table
from probe.testing.random_transcoders import random_transcoders


def random_llama(layers: int, width: int) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=width // 4,
        max_position_embeddings=512, bos_token_id=1, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def measure(layers: int, width: int, tokens: int, keys: int) -> None:
    model = random_llama(layers, width)
    ts = random_transcoders(width, layers, activation="topk", skip=True, expansion=2)
    prompt = torch.randint(2, 256, (tokens,), generator=torch.Generator().manual_seed(1))
    start = time.perf_counter()
    graph = probe.attribution_graph(model, prompt, ts, prepend_bos=False)
    graph_s = time.perf_counter() - start
    passes: list[int] = []
    seeds: list[int] = []
    batch: list[int] = []
    rows = qk_sources.NodeSources.rows

    def counted(self, layer, positions):
        before = self.backward_passes
        out = rows(self, layer, positions)
        passes.append(self.backward_passes - before)
        seeds.append(self.width * len(positions))
        batch.append(self.batch)
        return out

    qk_sources.NodeSources.rows = counted  # type: ignore[method-assign]
    try:
        start = time.perf_counter()
        plain = qk_table(model, graph, ts, keys=keys)
        plain_s = time.perf_counter() - start
        start = time.perf_counter()
        traced = qk_table(model, graph, ts, keys=keys, sources="nodes")
        traced_s = time.perf_counter() - start
    finally:
        qk_sources.NodeSources.rows = rows  # type: ignore[method-assign]
    pairs = traced.groupby(["layer", "head", "query_pos", "key_pos"]).ngroups
    print(
        f"{layers}x{width}x{tokens}: graph {graph_s:.2f} s ({graph.n_features} feature nodes); "
        f"position table {plain_s:.2f} s, {len(plain)} rows; nodes table {traced_s:.2f} s, "
        f"{len(traced)} rows; {pairs} pairs; {sum(passes)} backward passes of {batch[0]} copies "
        f"for {sum(seeds)} seeds; {1000 * traced_s / pairs:.1f} ms and "
        f"{sum(passes) / pairs:.2f} backward passes a pair (position: "
        f"{1000 * plain_s / pairs:.1f} ms)",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["3x32x7", "6x128x16"])
    parser.add_argument("--keys", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for shape in args.shapes:
        layers, width, tokens = (int(v) for v in shape.split("x"))
        measure(layers, width, tokens, args.keys)


if __name__ == "__main__":
    main()
