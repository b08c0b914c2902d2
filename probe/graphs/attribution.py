"""One prompt's attribution graph: the direct effects between features, errors, tokens and logits
in the local replacement model (probe.graphs.replacement), computed in chunks of target rows and
kept sparse.

One forward runs `batch_size` copies of the prompt under the replacement model. Each backward then
computes `batch_size` target rows at once: batch row b is seeded with its target's direction at
its target's place (a feature: its encoder column at its position at the transcoder's input; a
logit: the demeaned unembedding row at the last position at the final norm's output), and tensor
hooks read the gradient at every MLP output (contracted with the activation x decoder rows of the
active features that write there, a cross-layer transcoder's earlier layers' too, and with the
error vectors) and at the embeddings' output (contracted with the token
embeddings). The rows in flight are dense (batch_size x columns); what is kept of them is sparse.

The floor is a bound, not a cut: per row the smallest entries are dropped only while their
|weight| sum stays under `floor` times the row's |weight| sum (floor 0 keeps every nonzero entry).
Pruning normalises each row by its |weight| sum, so a row's normalised weights move by less than
2 x floor in total (the dropped share, and the rest scaled up by at most 1 / (1 - floor)), and
every influence, a sum over paths of products of normalised weights, moves by a share of the
same order per step of the path.

Kept rows are stored in row order, entry after entry, in large blocks reused for every batch
(int32 row and column, float32 weight: 12 bytes an entry); the graph's COO adjacency (int64
indices, 20 bytes an entry) is written from them block by block, already in (target, source)
order, each block released as it is written. On the host, glibc's heap is kept from
fragmenting (probe.graphs.host_heap: while a graph runs, blocks of 1 MiB and more mapped and
unmapped on their own, the thresholds of a warmed-up process after it; and after each batch, at most 5% of the time, the heap's free pages given back): the forward's
and the batches' temporaries otherwise left the process holding 2.5 times what it used.

Logit rows come first; then the features' rows, all of them, or with `max_feature_nodes` the most
influential ones, ranked every `update_interval` batches by the influence the rows so far give
(circuit-tracer's order). As in circuit-tracer, position 0's features and error are not nodes
(`zero_bos`: the first token is a special token whose activations are outliers); for an
instruction-tuned Gemma-3 (a model named `gemma-3...-it`, Gemma Scope 2's -it transcoders) the
first four positions' are not, the chat template's `<bos><start_of_turn>user\n`
(zeroed_positions, circuit-tracer's rule).
"""

from __future__ import annotations

import inspect
import logging
import math
from dataclasses import dataclass, fields
from typing import Literal

import torch

from probe.config import GRAPH_QK_SOURCES as QK_SOURCES  # what a QK table splits a side into
from probe.errors import ConfigError
from probe.graphs.attribution_graph import AttributionGraph
from probe.graphs.batch_plan import FRACTION, BatchPlan, device_shares, plan_batch
from probe.graphs.host_heap import bounded_host_heap, release_free_memory
from probe.graphs.replacement import LocalReplacement, check_interface
from probe.hooks.hookset import HookSet
from probe.models.cross_layer_transcoder import AnyTranscoders, CrossLayerTranscoder
from probe.models.placement import execution_device

EDGES = ("pruned", "all")
EXACT_NODES = 8192  # graphs up to this many nodes keep every edge by default (floor 0)
# larger graphs: per row, the smallest entries whose |weight| sum stays under this share of the
# row's |weight| sum are dropped (1e-6: the pruned graph at 1,024 tokens is circuit-tracer's)
DEFAULT_FLOOR = 1e-6
BLOCK_MIN, BLOCK_MAX = 1 << 16, 1 << 22  # entries of the first and the largest storage block
PIECE = 1 << 24  # elements of a gathered gradient per contraction (bounds the rows' scratch)
PROGRESS_BATCHES = 8  # backward passes a graph takes before its progress bar shows
# a row's target: (layer, or "final" for a logit), position, the vector seeded at its input
Seed = tuple[int | Literal["final"], int, torch.Tensor]
log = logging.getLogger("probe")


@dataclass(frozen=True)
class GraphOptions:
    """How a graph is attributed and pruned (the `graph.*` keys).

    logit_prob, max_logits: the logit nodes, the fewest top tokens at the last position whose
    probabilities sum to logit_prob, at most max_logits. max_feature_nodes: the features
    attributed (None: every active one). node_threshold, edge_threshold: pruning's cumulative
    influence kept. batch_size: target rows per backward (and copies of the prompt in the
    forward); None: as many as the memory plan fits (probe.graphs.batch_plan). floor: per row, the smallest entries are dropped while their |weight| sum stays
    under floor x the row's |weight| sum (a bound on what is lost); None: 0 for graphs of up to
    EXACT_NODES nodes, else DEFAULT_FLOOR. edges: which edges the
    files hold (pruned | all). zero_bos: position 0's features and error are not nodes (an
    instruction-tuned Gemma-3's first four: zeroed_positions).
    update_interval: batches between re-rankings of the features by influence. qk: the key
    positions per layer, head and query position whose attention score the QK attribution
    decomposes (probe.graphs.qk_attribution; 0: none); qk_rows: the largest cells and
    marginals kept per decomposed pair, the rest summed in one row (None: every one);
    qk_sources: each side split into the parts at its own position ("position") or traced
    through the earlier layers' frozen patterns to the graph's nodes ("nodes", by the cheaper
    of forward and backward passes; "nodes_forward", "nodes_backward": the one named)."""

    logit_prob: float = 0.95
    max_logits: int = 10
    max_feature_nodes: int | None = None
    node_threshold: float = 0.8
    edge_threshold: float = 0.98
    batch_size: int | None = None
    floor: float | None = None
    edges: str = "pruned"
    zero_bos: bool = True
    update_interval: int = 4
    qk: int = 0
    qk_rows: int | None = 20
    qk_sources: str = "position"

    def __post_init__(self) -> None:
        def bad(key, value, want):
            raise ConfigError(f"graph.{key}={value!r}: {want}")

        if not (0 < self.logit_prob <= 1):
            bad("logit_prob", self.logit_prob, "a probability in (0, 1]")
        if not _is_int(self.max_logits) or self.max_logits < 1:
            bad("max_logits", self.max_logits, "at least 1 logit node")
        if self.max_feature_nodes is not None and (
            not _is_int(self.max_feature_nodes) or self.max_feature_nodes < 1
        ):
            bad("max_feature_nodes", self.max_feature_nodes, "at least 1, or null for all")
        for key in ("node_threshold", "edge_threshold"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
                bad(key, value, "a fraction of the influence in [0, 1]")
        if self.batch_size is not None and (not _is_int(self.batch_size) or self.batch_size < 1):
            bad("batch_size", self.batch_size,
                "at least 1 target row per backward, or null for the memory plan's")  # fmt: skip
        if self.floor is not None and (
            isinstance(self.floor, bool)
            or not isinstance(self.floor, int | float)
            or not 0 <= self.floor < 1
            or math.isnan(self.floor)
        ):
            bad(
                "floor", self.floor,
                "the share of a row's |weight| sum its dropped smallest entries stay under, in "
                "[0, 1), or null",
            )  # fmt: skip
        if self.edges not in EDGES:
            bad("edges", self.edges, f"choose from {', '.join(EDGES)}")
        if not _is_int(self.update_interval) or self.update_interval < 1:
            bad("update_interval", self.update_interval, "at least 1 batch")
        check_qk_options(self.qk, self.qk_rows, self.qk_sources)

    @classmethod
    def of(cls, **options) -> GraphOptions:
        """Options from keywords, an unknown one refused by name."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(
                f"graph option(s) {', '.join(unknown)} unknown; choose from {', '.join(sorted(known))}"
            )
        return cls(**options)

    def floor_for(self, n_nodes: int) -> float:
        """The floor used for a graph of `n_nodes` nodes (the default rule when floor is None)."""
        if self.floor is not None:
            return float(self.floor)
        return 0.0 if n_nodes <= EXACT_NODES else DEFAULT_FLOOR


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_qk_options(qk, qk_rows, qk_sources: str = "position") -> None:
    """graph.qk (key positions per layer, head and query position: 0 off), graph.qk_rows
    (cells and marginals kept per decomposed pair, the rest summed; None: all) and
    graph.qk_sources (QK_SOURCES), refused by name."""
    if qk_sources not in QK_SOURCES:
        raise ConfigError(
            f"graph.qk_sources={qk_sources!r}: choose position (the parts at the pair's own "
            "positions, an earlier attention's write one part) or nodes (those writes traced "
            "to the graph's nodes at every earlier position and layer, by forward or backward "
            "passes, whichever costs less; nodes_forward or nodes_backward names one)"
        )
    if not _is_int(qk) or qk < 0:
        raise ConfigError(
            f"graph.qk={qk!r}: the number of most-attended key positions whose attention score "
            "is decomposed per layer, head and query position, an integer >= 0 (0: off), e.g. "
            "graph.qk=2"
        )
    if qk_rows is not None and (not _is_int(qk_rows) or qk_rows < 1):
        raise ConfigError(
            f"graph.qk_rows={qk_rows!r}: the largest cells (and marginals) kept per decomposed "
            "pair, the rest summed in one row, an integer >= 1, or null for every one"
        )


@dataclass
class _Writes:
    """What active features write into one layer's MLP output: the features' indices among the
    active ones, their positions, and activation x decoder row (k, d) float32."""

    active: torch.Tensor  # (k,) int64, increasing
    pos: torch.Tensor  # (k,)
    vectors: torch.Tensor  # (k, d)


@dataclass
class _Nodes:
    """The prompt's active features (in (layer, pos, feature) order), their writes into each
    layer's MLP output (a per-layer set: that layer's features; a CLT: every earlier layer's
    too), their encoder directions, the error vectors and the token embeddings."""

    layer: torch.Tensor  # (n_active,)
    pos: torch.Tensor
    feature: torch.Tensor
    activation: torch.Tensor  # float32
    starts: list[int]  # first active index of each layer, and n_active
    writes: list[_Writes]  # per output layer
    encoders: list[torch.Tensor]  # per layer (k_l, d_in): encoder columns
    errors: torch.Tensor  # (n_layers, n_pos, d) float32
    tokens: torch.Tensor  # (n_pos, d) float32

    @property
    def n_active(self) -> int:
        return int(self.layer.shape[0])


def _progress(rows: int, batch: int):
    """A progress bar over a graph's target rows (tqdm, on stderr), shown from PROGRESS_BATCHES
    backward passes on: a short prompt's graph prints nothing."""
    from tqdm.auto import tqdm

    return tqdm(total=rows, unit="row", desc="graph rows", leave=False, mininterval=1.0,
                disable=rows <= PROGRESS_BATCHES * batch)  # fmt: skip


def attribute(
    model: torch.nn.Module,
    tokens,
    transcoders: AnyTranscoders,
    options: GraphOptions | None = None,
    *,
    tokenizer=None,
    overrides: dict | None = None,
    prompt: str | None = None,
) -> AttributionGraph:
    """The attribution graph of `tokens` (a prompt's ids, 1-D) through `transcoders` (a per-layer
    TranscoderSet or a CrossLayerTranscoder) on `model` (unpruned; probe.graphs.pruning fills
    the pruning fields). `tokenizer` names the tokens; `overrides` are `model.anatomy` keys."""
    options = options or GraphOptions()
    ids = token_ids(tokens)
    _check_context(model, ids)
    zeroed = zeroed_positions(model, ids, options.zero_bos)
    with bounded_host_heap():
        return _attribute(model, ids, transcoders, options, zeroed, tokenizer, overrides, prompt)


def _attribute(model, ids: torch.Tensor, transcoders: AnyTranscoders, options: GraphOptions,
               zeroed: int, tokenizer, overrides: dict | None, prompt: str | None,
               ) -> AttributionGraph:  # fmt: skip
    """attribute's work, the host heap bounded around it."""
    n_layers, n_pos = len(transcoders), int(ids.shape[0])
    replacement = LocalReplacement(model, transcoders, overrides, mode="attribute")
    # the prompt goes where the embeddings run; the transcoders and the rows stay there (a
    # block on another device of a `device_map` meets them through .to(its device))
    device = execution_device(replacement.parts.embed)
    transcoders.to(device=device)
    with replacement as rep:
        plan = batch_plan(model, rep, n_pos, options)
        B = plan.batch
        log.info("graph plan: %s", plan.reason)
        with torch.enable_grad():
            out = model(ids[None].expand(B, -1).to(device), **_lean(model))
        check_interface(rep)
        logits = _logits_of(out)[0, -1].detach().float()
        nodes = _nodes(rep, transcoders, zeroed)
        logit_ids, logit_probs, logit_vecs = _salient_logits(logits, rep.parts.unembed, options)
        n_active, n_logits = nodes.n_active, int(logit_ids.shape[0])
        n_cols = n_active + (n_layers + 1) * n_pos
        rows = _Rows(n_cols, n_logits, logit_probs)
        n_max = min(options.max_feature_nodes or n_active, n_active)
        floor = options.floor_for(n_max + (n_layers + 1) * n_pos + n_logits)
        reader = _Reader(rep, nodes, n_cols, B)
        progress = _progress(n_logits + n_max, B)
        with reader.hooks, progress:
            reader.register()
            for i in range(0, n_logits, B):
                idx = torch.arange(i, min(i + B, n_logits))
                seeds: list[Seed] = [("final", n_pos - 1, logit_vecs[j]) for j in idx.tolist()]
                rows.add(n_cols + idx, reader.rows(seeds), floor)
                progress.update(len(idx))
                release_free_memory()
            visited = torch.zeros(n_active, dtype=torch.bool)
            while int(visited.sum()) < n_max:
                if n_max == n_active:
                    pending = torch.arange(n_active)
                else:
                    rank = torch.argsort(rows.influence()[:n_active], descending=True)
                    size = min(options.update_interval * B, n_max - int(visited.sum()))
                    pending = rank[~visited[rank]][:size]
                for j in range(0, len(pending), B):
                    batch = pending[j : j + B]
                    seeds = [
                        (int(nodes.layer[a]), int(nodes.pos[a]), _encoder(nodes, int(a)))
                        for a in batch.tolist()
                    ]
                    rows.add(batch, reader.rows(seeds), floor)
                    visited[batch] = True
                    progress.update(len(batch))
                    release_free_memory()
        del out, reader
    selected = torch.where(visited)[0]
    adjacency = rows.assemble(selected, n_active, n_layers, n_pos)
    release_free_memory(force=True)
    name = _namer(tokenizer)
    return AttributionGraph(
        tokens=ids.cpu(),
        token_strings=[name(t) for t in ids.tolist()],
        n_layers=n_layers,
        features=torch.stack([nodes.layer, nodes.pos, nodes.feature], 1)[selected].reshape(-1, 3),
        activations=nodes.activation[selected],
        logit_tokens=logit_ids.cpu(),
        logit_probs=logit_probs.cpu(),
        logit_strings=[name(t) for t in logit_ids.tolist()],
        adjacency=adjacency,
        floor=floor,
        prompt=prompt,
        scan=_scan(transcoders),
        active_features=n_active,
        batch=B,
    )


def batch_plan(model: torch.nn.Module, rep: LocalReplacement, n_pos: int,
               options: GraphOptions, *, tangents: bool = False, fraction: float | None = None,
               rows: int | None = None) -> BatchPlan:  # fmt: skip
    """The prompt copies per backward: graph.batch_size where given, else the memory plan's for
    this model, its placement and the prompt's length (probe.graphs.batch_plan); `tangents`:
    per forward carrying tangents, of at most `rows` copies, `fraction` of the free memory."""
    if options.batch_size is not None:
        return BatchPlan(options.batch_size, f"{options.batch_size} prompt copies per backward "
                         "(graph.batch_size)")  # fmt: skip
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None) or 1
    eager = (getattr(config, "_attn_implementation", None) or "eager").endswith("_eager")
    element = next(model.parameters()).element_size()
    width = int(rep.parts.unembed.shape[1])
    shares = device_shares(rep.parts.mlps, rep.parts.embed)
    # no more copies than rows to attribute, where max_feature_nodes bounds them
    if rows is None and options.max_feature_nodes is not None:
        rows = options.max_logits + options.max_feature_nodes
    share = FRACTION if fraction is None else fraction
    return plan_batch(shares, n_pos, width, int(heads), element, eager, share, rows, tangents)


def token_ids(tokens) -> torch.Tensor:
    """A prompt's token ids as one 1-D int64 sequence (a single row is taken as it)."""
    ids = torch.as_tensor(tokens)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0 or ids.dtype.is_floating_point:
        raise ConfigError(
            f"graphs: a prompt is one sequence of token ids; got shape {tuple(ids.shape)} "
            f"({ids.dtype})"
        )
    return ids.long()


GEMMA3_IT_PREFIX = (2, 105, 2364, 107)  # <bos><start_of_turn>user\n in Gemma-3's vocabulary


def zeroed_positions(model, ids: torch.Tensor, zero_bos: bool = True) -> int:
    """How many first positions' features and errors are not nodes: 0 without `zero_bos`, else
    1, or circuit-tracer's 4 for an instruction-tuned Gemma-3 (its config's name has `gemma-3`
    and ends in `-it`), whose prompt must then start with the chat template's
    <bos><start_of_turn>user\n (a ConfigError otherwise, naming the tokens and the way out)."""
    if not zero_bos:
        return 0
    config = getattr(model, "config", None)
    name = str(getattr(config, "_name_or_path", "") or "").rstrip("/").lower()
    if "gemma-3" not in name or not name.endswith("-it"):
        return 1
    head = tuple(int(t) for t in ids[: len(GEMMA3_IT_PREFIX)].tolist())
    if head != GEMMA3_IT_PREFIX:
        raise ConfigError(
            f"graphs: {name} is an instruction-tuned Gemma-3, whose graphs leave out the chat "
            f"template's first four tokens <bos><start_of_turn>user\\n {list(GEMMA3_IT_PREFIX)}, "
            f"but the prompt starts {list(head)}: give the prompt through the tokenizer's chat "
            "template (apply_chat_template), or graph.zero_bos=false to keep every position"
        )
    return len(GEMMA3_IT_PREFIX)


def _check_context(model, ids: torch.Tensor) -> None:
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):  # multimodal: its LM's
        config = config.get_text_config()
    limit = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and ids.shape[0] > limit:
        raise ConfigError(
            f"graphs: the prompt has {ids.shape[0]} tokens, longer than the model's context of "
            f"{limit}; shorten it"
        )
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and (int(ids.max()) >= vocab or int(ids.min()) < 0):
        raise ConfigError(
            f"graphs: token id {int(ids.max()) if int(ids.max()) >= vocab else int(ids.min())} "
            f"is outside the model's vocabulary of {vocab}"
        )


def _lean(model) -> dict:
    """Keywords that spare the forward what a graph does not read: the logits of every position
    but the last (batch x positions x vocabulary floats) and the key/value cache."""
    params = inspect.signature(model.forward).parameters
    lean = {"logits_to_keep": 1, "use_cache": False}
    return {k: v for k, v in lean.items() if k in params}


def _logits_of(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out[0] if isinstance(out, tuple) else out


def _scan(transcoders: AnyTranscoders) -> list[str] | str | None:
    """circuit-tracer's scan of the graph: a set's transcoder ids, a CLT's name."""
    if isinstance(transcoders, CrossLayerTranscoder):
        return transcoders.scan
    return [transcoders.ids[k] for k in sorted(transcoders.ids)] or None


@torch.no_grad()
def _nodes(rep: LocalReplacement, transcoders: AnyTranscoders, zeroed: int) -> _Nodes:
    """The nodes' data; the first `zeroed` positions' features and errors are not nodes."""
    if isinstance(transcoders, CrossLayerTranscoder):
        return _clt_nodes(rep, transcoders, zeroed)
    layers, poss, feats, acts, decoders, encoders, errors, starts = [], [], [], [], [], [], [], []
    start = 0
    for layer in range(len(transcoders)):
        t = transcoders[layer]
        x = rep.captured.inputs[layer][0].to(t.W_enc.device)  # (the block's own device)
        a = t.encode(x)
        a[:zeroed] = 0
        pos, feat = torch.nonzero(a, as_tuple=True)
        values = a[pos, feat]
        recon = t.decode(a) + t.skip(x)
        error = rep.captured.mlp_values[layer][0].to(x.device).float() - recon.float()
        error[:zeroed] = 0
        starts.append(start)
        start += int(pos.shape[0])
        layers.append(torch.full_like(pos, layer))
        poss.append(pos)
        feats.append(feat)
        acts.append(values.float())
        decoders.append((values[:, None] * t.W_dec[feat]).float())
        encoders.append(t.W_enc[:, feat].T)
        errors.append(error)
    starts.append(start)
    assert rep.captured.embed is not None  # (the replacement's forward ran)
    embed = rep.captured.embed[0].detach().float().to(errors[0].device)
    writes = [
        _Writes(torch.arange(starts[layer], starts[layer + 1], device=poss[layer].device),
                poss[layer], decoders[layer])
        for layer in range(len(transcoders))
    ]  # fmt: skip
    return _Nodes(
        torch.cat(layers).cpu(), torch.cat(poss).cpu(), torch.cat(feats).cpu(),
        torch.cat(acts).cpu(), starts, writes, encoders, torch.stack(errors), embed,
    )  # fmt: skip


def _clt_nodes(rep: LocalReplacement, clt: CrossLayerTranscoder, zeroed: int) -> _Nodes:
    """A CLT's nodes (circuit-tracer's definitions): a feature per (layer, position, feature)
    active at its layer's input; its write into layer l' >= layer is activation x W_dec[layer]
    [feature, l' - layer]; layer l''s error is its MLP's output minus every write into it, b_dec
    and the skip path. The first `zeroed` positions' features and errors are dropped."""
    n = len(clt)
    device = clt.W_enc.device
    inputs = [rep.captured.inputs[layer][0].to(device) for layer in range(n)]
    acts = []
    for layer, x in enumerate(inputs):
        a = clt.encode(layer, x)
        a[:zeroed] = 0
        acts.append(a)
    recon = clt.decode(acts)
    layers, poss, feats, values, encoders, errors, starts = [], [], [], [], [], [], []
    found = []
    start = 0
    for layer, a in enumerate(acts):
        pos, feat = torch.nonzero(a, as_tuple=True)
        value = a[pos, feat]
        found.append((pos, feat, value, start))
        starts.append(start)
        start += int(pos.shape[0])
        layers.append(torch.full_like(pos, layer))
        poss.append(pos)
        feats.append(feat)
        values.append(value.float())
        encoders.append(clt.W_enc[layer][:, feat].T)
        out = recon[layer] + clt.skip(layer, inputs[layer])
        error = rep.captured.mlp_values[layer][0].to(device).float() - out.float()
        error[:zeroed] = 0
        errors.append(error)
    starts.append(start)
    writes = []
    for target in range(n):
        parts = [
            (torch.arange(s, s + len(pos), device=pos.device), pos,
             (value[:, None] * clt.W_dec[source][feat, target - source]).float())
            for source, (pos, feat, value, s) in enumerate(found[: target + 1])
        ]  # fmt: skip
        writes.append(_Writes(*(torch.cat(column) for column in zip(*parts, strict=True))))
    assert rep.captured.embed is not None  # (the replacement's forward ran)
    embed = rep.captured.embed[0].detach().float().to(device)
    return _Nodes(
        torch.cat(layers).cpu(), torch.cat(poss).cpu(), torch.cat(feats).cpu(),
        torch.cat(values).cpu(), starts, writes, encoders, torch.stack(errors), embed,
    )  # fmt: skip


def _encoder(nodes: _Nodes, active: int) -> torch.Tensor:
    layer = int(nodes.layer[active])
    return nodes.encoders[layer][active - nodes.starts[layer]]


def _salient_logits(logits: torch.Tensor, unembed: torch.Tensor, options: GraphOptions):
    """circuit-tracer's logit nodes: the fewest top tokens whose probabilities reach
    logit_prob, at most max_logits; their probabilities and demeaned unembedding rows."""
    probs = torch.softmax(logits, dim=-1)
    top_p, top_idx = torch.topk(probs, min(options.max_logits, probs.shape[0]))
    cutoff = int(torch.searchsorted(torch.cumsum(top_p, 0), options.logit_prob)) + 1
    ids = top_idx[:cutoff]
    w = unembed.detach()
    vecs = w[ids].float() - w.float().mean(0, keepdim=True)
    return ids, probs[ids], vecs


class _Reader:
    """Seeds one backward with up to B targets and reads their rows (B, n_cols) from the
    gradients at the MLP outputs and the embeddings."""

    def __init__(self, rep: LocalReplacement, nodes: _Nodes, n_cols: int, batch: int):
        self.rep, self.nodes, self.n_cols, self.batch = rep, nodes, n_cols, batch
        self.hooks = HookSet("attribution rows")
        self.buffer: torch.Tensor | None = None
        n_pos = nodes.tokens.shape[0]
        self.error_start = nodes.n_active
        self.token_start = nodes.n_active + len(nodes.writes) * n_pos
        self.n_pos = n_pos

    def register(self) -> None:
        cap = self.rep.captured
        assert cap.embed is not None  # (the replacement's forward ran)
        for layer, out in cap.outputs.items():
            self.hooks.tensor(out, self._mlp_reader(layer), name=f"mlp {layer} output")
        self.hooks.tensor(cap.embed, self._embed_reader, name="embeddings")

    def _mlp_reader(self, layer: int):
        nodes, n_pos = self.nodes, self.n_pos
        writes = nodes.writes[layer]
        device = nodes.errors.device
        pos, active = writes.pos.to(device), writes.active.to(device)
        cols = torch.arange(n_pos) + self.error_start + layer * n_pos

        def read(grad):
            g = grad.to(device, torch.float32)  # (a block of a device_map: its own device)
            buf = self.buffer
            assert buf is not None  # (rows() sets it for the backward that calls this)
            step = max(1, PIECE // max(1, g.shape[0] * g.shape[-1]))
            for s in range(0, int(pos.shape[0]), step):
                part = g[:, pos[s : s + step]]
                buf.index_add_(
                    1, active[s : s + step],
                    torch.einsum("bkd,kd->bk", part, writes.vectors[s : s + step]),
                )  # fmt: skip
            buf[:, cols] += torch.einsum("bpd,pd->bp", g, nodes.errors[layer])

        return read

    def _embed_reader(self, grad):
        cols = torch.arange(self.n_pos) + self.token_start
        assert self.buffer is not None  # (rows() sets it for the backward that calls this)
        g = grad.to(self.nodes.tokens.device, torch.float32)
        self.buffer[:, cols] += torch.einsum("bpd,pd->bp", g, self.nodes.tokens)

    def rows(self, seeds: list[Seed]) -> torch.Tensor:
        """The rows (len(seeds), n_cols) of targets `seeds`: (layer or "final", pos, vector)."""
        cap = self.rep.captured
        assert cap.final is not None  # (the replacement's forward ran)
        roots: dict = {}
        for b, (where, pos, vec) in enumerate(seeds):
            root = cap.final if where == "final" else cap.inputs[where]
            if where not in roots:
                roots[where] = (root, torch.zeros_like(root))
            roots[where][1][b, pos] = vec.to(root.device, root.dtype)
        device = self.nodes.errors.device  # (the transcoders' and the nodes')
        self.buffer = torch.zeros(self.batch, self.n_cols, device=device)
        tensors = [r for r, _ in roots.values()]
        grads = [g for _, g in roots.values()]
        torch.autograd.backward(tensors, grads, retain_graph=True)
        buf, self.buffer = self.buffer, None
        return buf[: len(seeds)].cpu()  # (the backward filled it)


def kept_by_floor(dense: torch.Tensor, floor: float) -> torch.Tensor:
    """(rows, columns) bool: each row's nonzero entries but its smallest ones whose |weight| sum
    stays under `floor` x the row's |weight| sum."""
    keep = dense != 0
    if floor <= 0:
        return keep
    a = dense.abs()
    order = torch.argsort(a, dim=1)
    below = torch.cumsum(torch.gather(a, 1, order).double(), 1)
    below = below < floor * below[:, -1:]  # the smallest entries, their sum under the bound
    return keep & ~torch.zeros_like(keep).scatter_(1, order, below)


class _Block:
    """Storage for `capacity` entries: int32 row (the attribution's row index) and column, float32
    weight; rows are appended whole, in order."""

    def __init__(self, capacity: int) -> None:
        self.row = torch.empty(capacity, dtype=torch.int32)
        self.col = torch.empty(capacity, dtype=torch.int32)
        self.val = torch.empty(capacity, dtype=torch.float32)
        self.used = 0

    @property
    def capacity(self) -> int:
        return int(self.row.shape[0])


class _Rows:
    """The sparse rows attributed so far, in blocks (see the module docstring), with each row's
    node (an active feature's index, or n_cols + logit index), entry count and |weight| sum."""

    def __init__(self, n_cols: int, n_logits: int, logit_probs: torch.Tensor):
        self.n_cols, self.n_logits = n_cols, n_logits
        self.logit_probs = logit_probs.float().cpu()
        self.nodes: list[torch.Tensor] = []
        self.counts: list[torch.Tensor] = []
        self.sums: list[torch.Tensor] = []
        self.blocks: list[_Block] = []
        self.count = 0

    def add(self, nodes: torch.Tensor, dense: torch.Tensor, floor: float) -> None:
        keep = kept_by_floor(dense, floor)
        r, c = torch.nonzero(keep, as_tuple=True)
        n = int(r.shape[0])
        block = self._room(n)
        lo, hi = block.used, block.used + n
        block.row[lo:hi] = r + self.count
        block.col[lo:hi] = c
        block.val[lo:hi] = dense[r, c]
        block.used = hi
        self.nodes.append(nodes.long())
        self.counts.append(keep.sum(1))
        self.sums.append(dense.abs().mul_(keep).sum(1, dtype=torch.float64))
        self.count += int(dense.shape[0])

    def _room(self, n: int) -> _Block:
        """The block the next n entries go to: the last one, or a new one twice its size (at
        most BLOCK_MAX entries, at least n)."""
        last = self.blocks[-1] if self.blocks else None
        if last is not None and last.capacity - last.used >= n:
            return last
        size = min(BLOCK_MAX, 2 * last.capacity) if last is not None else BLOCK_MIN
        self.blocks.append(_Block(max(size, n)))
        return self.blocks[-1]

    def influence(self, max_iter: int = 128) -> torch.Tensor:
        """circuit-tracer's partial influences of every node on the logits, from the rows so far
        (row-normalised |weights|, the power series seeded with the logit probabilities)."""
        row_node = torch.cat(self.nodes)
        sums = torch.cat(self.sums).float().clamp(min=1e-8)
        total = self.n_cols + self.n_logits
        prod = torch.zeros(total)
        prod[-self.n_logits :] = self.logit_probs
        influence = torch.zeros(total)
        for _ in range(max_iter):
            per_row = prod[row_node] / sums
            prod = torch.zeros(total)
            for b in self.blocks:
                n = b.used
                prod.index_add_(0, b.col[:n], b.val[:n].abs() * per_row[b.row[:n]])
            if not prod.any():
                break
            influence += prod
        return influence

    def assemble(self, selected: torch.Tensor, n_active: int, n_layers: int, n_pos: int):
        """The adjacency in node order [selected features | errors | tokens | logits], sparse
        COO (target, source), coalesced: written block by block into its final place (each
        target's entries in source order), the blocks released as they are written."""
        n_sel = int(selected.shape[0])
        n_nodes = n_sel + (n_layers + 1) * n_pos + self.n_logits
        col_map = torch.full((self.n_cols,), -1, dtype=torch.long)
        col_map[selected] = torch.arange(n_sel)
        col_map[n_active:] = torch.arange(n_sel, n_sel + (n_layers + 1) * n_pos)
        if not self.nodes:
            empty = torch.zeros(2, 0, dtype=torch.long)
            return torch.sparse_coo_tensor(
                empty, torch.zeros(0), (n_nodes, n_nodes), check_invariants=False, is_coalesced=True
            )
        row_node = torch.cat(self.nodes)
        row_map = torch.full((n_active + self.n_logits,), -1, dtype=torch.long)
        row_map[selected] = torch.arange(n_sel)
        row_map[n_active:] = torch.arange(n_nodes - self.n_logits, n_nodes)
        node = torch.where(row_node >= self.n_cols, row_node - self.n_cols + n_active, row_node)
        target = row_map[node]  # each row's target node
        counts = torch.cat(self.counts)
        if n_sel < n_active:  # entries of features not selected go
            counts = torch.zeros(self.count, dtype=torch.long)
            for b in self.blocks:
                n = b.used
                counts.index_add_(0, b.row[:n], (col_map[b.col[:n]] >= 0).long())
        # each row's first place in the adjacency: rows in target order
        order = torch.argsort(target)
        first = torch.zeros(self.count, dtype=torch.long)
        first[order] = torch.cumsum(counts[order], 0) - counts[order]
        nnz = int(counts.sum())
        indices = torch.empty(2, nnz, dtype=torch.long)
        values = torch.empty(nnz, dtype=torch.float32)
        while self.blocks:
            b = self.blocks.pop(0)
            n = b.used
            row, source = b.row[:n].long(), col_map[b.col[:n]]
            keep = source >= 0
            rank = torch.cumsum(keep, 0) - keep.long()  # kept entries before each, in the block
            begins = torch.ones(n, dtype=torch.bool)  # each row's first entry (rows are whole)
            begins[1:] = row[1:] != row[:-1]
            start = torch.zeros(self.count, dtype=torch.long)  # each row's rank at its start
            start[row[begins]] = rank[begins]
            place = (first[row] + rank - start[row])[keep]
            indices[0, place] = target[row[keep]]
            indices[1, place] = source[keep]
            values[place] = b.val[:n][keep]
            del b, row, source, keep, rank, start, place
        return torch.sparse_coo_tensor(
            indices, values, (n_nodes, n_nodes), check_invariants=False, is_coalesced=True
        )


def _namer(tokenizer):
    if tokenizer is None:
        return str
    return lambda t: tokenizer.decode([int(t)])
