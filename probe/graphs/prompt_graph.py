"""`probe.attribution_graph(model, prompt, transcoders, tokenizer=None, **options)`: one prompt's
attribution graph, attributed and pruned, for a notebook.

The prompt is text (tokenized without the tokenizer's own special tokens) or token ids; with a
tokenizer, a prompt that does not begin with a special token gets one prepended, as circuit-tracer
does (position 0's activations are outliers; its features and error are not nodes). `transcoders`
is a TranscoderSet or a CrossLayerTranscoder, or the path of a circuit-tracer YAML (either kind)
or of a folder holding one. `options` are GraphOptions' fields (logit_prob, max_logits,
max_feature_nodes, node_threshold, edge_threshold, batch_size, floor, edges, zero_bos,
update_interval, qk, qk_rows, qk_sources). With `qk=K` the graph also holds its QK attribution
(`graph.qk`, a table: probe.graphs.qk_attribution): for each layer, head and query position of
its kept nodes, the K key positions attended most, their scores decomposed over query-side and
key-side parts.

    graph = probe.attribution_graph(model, "the cat sat on the", "transcoders/", tokenizer=tok)
    graph.nodes()            # DataFrame: node, kind, layer, pos, feature, token, activation, ...
    graph.edges()            # the pruned graph's edges; graph.edges(kept_only=False): all stored
    graph.adjacency          # sparse COO (target, source)
    graph.scores             # replacement, completeness
    graph.prune(node_threshold=0.6)  # pruned again
    graph.qk                 # with qk=2: where attention comes from (None without)
"""

from __future__ import annotations

from pathlib import Path

import torch

from probe.data.token_data import first_special_token
from probe.errors import ConfigError
from probe.graphs.attribution import GraphOptions, attribute, token_ids
from probe.graphs.attribution_graph import AttributionGraph
from probe.graphs.qk_attribution import qk_table
from probe.models.cross_layer_transcoder import AnyTranscoders, CrossLayerTranscoder
from probe.models.transcoder import TranscoderSet
from probe.models.transcoder_files import load_transcoders


def attribution_graph(
    model: torch.nn.Module,
    prompt,
    transcoders,
    tokenizer=None,
    *,
    overrides: dict | None = None,
    prepend_bos: bool = True,
    **options,
) -> AttributionGraph:
    """The pruned attribution graph of `prompt` through `transcoders` on `model` (see the module
    docstring); `overrides` are `model.anatomy` keys for a family probe does not know;
    `prepend_bos=False` takes the prompt's tokens as they are."""
    opts = GraphOptions.of(**options)
    ids = prompt_tokens(prompt, tokenizer, prepend_bos)
    graph_transcoders = transcoder_set(transcoders)
    graph = attribute(
        model, ids, graph_transcoders, opts, tokenizer=tokenizer, overrides=overrides,
        prompt=prompt if isinstance(prompt, str) else None,
    )  # fmt: skip
    graph = graph.prune(opts.node_threshold, opts.edge_threshold)
    if opts.qk:
        graph.qk = qk_table(model, graph, graph_transcoders, keys=opts.qk, rows=opts.qk_rows,
                            overrides=overrides, zero_bos=opts.zero_bos,
                            sources=opts.qk_sources, batch=opts.batch_size)  # fmt: skip
    return graph


def transcoder_set(transcoders) -> AnyTranscoders:
    """A TranscoderSet or CrossLayerTranscoder as given, or loaded from a YAML path or a folder
    holding one."""
    if isinstance(transcoders, TranscoderSet | CrossLayerTranscoder):
        return transcoders
    if isinstance(transcoders, str | Path):
        return load_transcoders(transcoders)
    raise ConfigError(
        f"graphs: transcoders is a {type(transcoders).__name__}; pass a TranscoderSet or a "
        "CrossLayerTranscoder, or the path "
        "of a transcoder-set YAML or of a folder holding one"
    )


def prompt_tokens(prompt, tokenizer=None, prepend_bos: bool = True) -> torch.Tensor:
    """The prompt's token ids (1-D); with a tokenizer and `prepend_bos`, a special token first
    where the prompt does not start with one (circuit-tracer's ensure_tokenized). The one rule
    of the API and of a run's graphs (graph.prepend_bos)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ConfigError(
                "graphs: a text prompt needs its tokenizer (tokenizer=...); or pass token ids"
            )
        ids = torch.as_tensor(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    else:
        ids = torch.as_tensor(prompt)
    ids = token_ids(ids)
    if not prepend_bos or tokenizer is None or int(ids[0]) in set(tokenizer.all_special_ids):
        return ids
    first = first_special_token(tokenizer)
    if first is None:
        return ids
    return torch.cat([torch.tensor([first]), ids])
