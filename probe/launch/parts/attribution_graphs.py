"""Attribution graphs as a run part (`graph.transcoders` set): after the run's loop, a pass
over the run's batches again (probe.launch.replay), one graph per prompt of the dataset (each
sample of dataset=text|tokens, its padding dropped), attributed through the transcoder set
(probe.graphs.attribution), pruned (probe.graphs.pruning) and appended to `/graph` through the
run's sink as it is made (a keyed group: probe.graphs.graph_h5's GRAPH), so memory holds one
prompt's graph; at the finish the tables (probe.graphs.graph_tables).

A prompt is in the file once its row of /graph/prompts is, so a stop (SIGINT, SIGTERM: after
the prompt in flight) or a kill loses at most that prompt, and `resume=true` continues after the
last whole one (graph.* must be the same). At the finish, each prompt's pruned graph also goes
into graph_json/ as circuit-tracer's frontend JSON (probe.graphs.graph_json), the folder its
viewer serves. With graph.qk, each prompt's QK attribution (probe.graphs.qk_attribution) goes
into /graph_qk before its graph (a resumed run keeps those there), and graph_qk.csv and the
JSON's qk_tracing_results are written from it at the finish. Under torchrun each rank attributes the prompts of its block of batches into its
own file (probe.rankR.h5); the stitch concatenates them, in rank order, into the run's probe.h5,
where rank 0 writes the tables.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator, Sized
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from probe.errors import ConfigError, ProbeError
from probe.graphs.graph_h5 import GRAPH, append_graph
from probe.graphs.qk_h5 import QK_GRAPH, append_qk
from probe.launch.replay import Replay
from probe.launch.run_part import Finished, RunPart, RunSetup
from probe.plan import RunPlan
from probe.specs import GraphSpec
from probe.store.groups import GroupTables
from probe.store.sink import Sink

if TYPE_CHECKING:
    from probe.graphs.attribution_graph import AttributionGraph
    from probe.models.cross_layer_transcoder import AnyTranscoders

# The graphs' machinery (the replacement model, the attribution, pruning, the tables, the
# transcoders' files) is imported where a run asks for graphs: every other run's start would
# import it for nothing.

log = logging.getLogger("probe")


# -- the computation (one place each, so a test can stand in for them) ---------------------------
def load_transcoder_set(path: str) -> AnyTranscoders:
    """The transcoder set (or cross-layer transcoder) of graph.transcoders (checked against the
    model in `start`)."""
    from probe.models.transcoder_files import load_transcoders

    return load_transcoders(path)


def graph_options(spec: GraphSpec):
    """probe.graphs.attribution's GraphOptions from the graph.* keys it has (a key left null
    where its own default is not null: that default)."""
    from probe.graphs.attribution import GraphOptions

    values = {}
    for f in dataclasses.fields(GraphOptions):
        value = getattr(spec, f.name, dataclasses.MISSING)
        if value is dataclasses.MISSING or (value is None and f.default is not None):
            continue
        values[f.name] = value
    return GraphOptions(**values)


def check_transcoders(model: torch.nn.Module, transcoders, overrides: dict | None) -> None:
    """Before the loop: the model's replacement parts (a post-norm model or a family the
    anatomy does not know refused by name) and the set's layers and widths against it."""
    from probe.graphs.replacement import check_widths, replacement_parts

    check_widths(replacement_parts(model, overrides), transcoders)


def attribute_prompt(model, tokens: torch.Tensor, transcoders, spec: GraphSpec, tokenizer,
                     overrides: dict | None = None):  # fmt: skip
    """One prompt's attributed graph (probe.graphs.attribution.attribute); `overrides` the
    model.anatomy keys."""
    from probe.graphs.attribution import attribute

    return attribute(
        model, tokens, transcoders, graph_options(spec), tokenizer=tokenizer, overrides=overrides
    )


def qk_of(model, graph: AttributionGraph, transcoders, spec: GraphSpec, overrides=None):
    """The QK attribution table of `graph` (probe.graphs.qk_attribution) at graph.qk,
    graph.qk_rows and graph.qk_sources."""
    from probe.graphs.qk_attribution import qk_table

    return qk_table(model, graph, transcoders, keys=spec.qk, rows=spec.qk_rows,
                    overrides=overrides, zero_bos=spec.zero_bos,
                    sources=spec.qk_sources, batch=spec.batch_size)  # fmt: skip


def prune_graph(graph: AttributionGraph, spec: GraphSpec) -> AttributionGraph:
    """`graph` pruned at graph.node_threshold and graph.edge_threshold."""
    from probe.graphs.pruning import prune

    return prune(graph, spec.node_threshold, spec.edge_threshold)


# -- the feature ---------------------------------------------------------------------------------
class AttributionGraphs(RunPart):
    """`graph.transcoders` set (with dataset=text|tokens and a causal language model)."""

    name = "attribution_graphs"
    after = (GRAPH, QK_GRAPH)  # each rank's prompts, concatenated in rank order by the stitch

    setup: RunSetup  # this run's, given by `start`

    def __init__(self, spec: GraphSpec, transcoders, tokenizer, overrides=None) -> None:
        self.spec, self.transcoders, self.tokenizer = spec, transcoders, tokenizer
        self.overrides = overrides  # model.anatomy

    @classmethod
    def prepare(cls, setup: RunSetup) -> AttributionGraphs | None:
        """The transcoder set read and checked against the model (a bad file, a post-norm model,
        a set of other layers or widths named before the loop), the tokenizer that names the
        tokens (None: token ids as names)."""
        spec = setup.plan.graph
        if not spec.on:
            return None
        transcoders = load_transcoder_set(str(spec.transcoders))
        overrides = _overrides(setup.plan)
        check_transcoders(setup.model, transcoders, overrides)
        if spec.examples:
            _check_examples(str(spec.examples))
        return cls(spec, transcoders, _tokenizer(setup.plan), overrides)

    def per_batch(self) -> bool:
        return False

    def start(self, setup: RunSetup) -> None:
        self.setup = setup

    def group_attrs(self) -> dict[str, str]:
        """/graph's attributes: graph.* (checked on resume), the transcoders' source and ids."""
        source = getattr(self.transcoders, "source", None) or self.spec.transcoders
        ids = getattr(self.transcoders, "ids", None)  # {layer: id}
        scan = [ids[k] for k in sorted(ids)] if isinstance(ids, dict) and ids else None
        return {
            "options": json.dumps(dataclasses.asdict(self.spec), sort_keys=True),
            "transcoders": str(source),
            "scan": json.dumps(scan),
        }

    def after_loop(self, replay: Replay, sink: Sink) -> None:
        """Every rank: a graph per prompt of its block into its file's /graph (a resumed run
        keeps the whole prompts there and continues after them)."""
        attrs = self.group_attrs()
        out = sink.groups(GRAPH, attrs, keep=bool(self.setup.plan.options.resume))
        _check_same_options(out, attrs, sink.path)
        have = set(out.keys)
        qk = (
            sink.groups(QK_GRAPH, {}, keep=bool(self.setup.plan.options.resume))
            if self.spec.qk
            else None
        )
        qk_have = set(qk.keys) if qk is not None else set()
        total = self.prompt_count(replay)
        if have:
            log.info("graph: resuming after %d prompts", len(have))
        count = 0
        for prompt, tokens in self.prompts(replay):
            count += 1
            if prompt in have:
                continue
            graph = self.graph_of(tokens)
            if qk is not None and prompt not in qk_have:
                table = qk_of(self.setup.model, graph, self.transcoders, self.spec, self.overrides)
                append_qk(qk, prompt, table)
            written = append_graph(out, prompt, graph)
            _log_graph(prompt, graph)
            if count == len(have) + 1:  # the first graph made here: the file's size projected
                _log_projection(written, total - len(have))
            replay.check("attributing graphs", count, total, "prompts")
        out.mark(True)
        if qk is not None:
            qk.mark(True)

    def graph_of(self, tokens: torch.Tensor) -> AttributionGraph:
        """One prompt's graph, attributed and pruned, its text decoded."""
        graph = attribute_prompt(
            self.setup.model, tokens.to(self.setup.device), self.transcoders, self.spec,
            self.tokenizer, self.overrides,
        )  # fmt: skip
        graph = prune_graph(graph, self.spec)
        if graph.prompt is None and self.tokenizer is not None:
            graph.prompt = self.tokenizer.decode(tokens.tolist())
        return graph

    def prompts(self, replay: Replay) -> Iterator[tuple[int, torch.Tensor]]:
        """(the dataset's sample index, its token ids without padding, a special token first by
        `first_special`) of this rank's samples."""
        index = replay.shard.samples.start
        for _, batch in replay.batches():
            inputs = batch.inputs
            ids = inputs["input_ids"] if isinstance(inputs, dict) else inputs
            mask = inputs.get("attention_mask") if isinstance(inputs, dict) else None
            for row in range(len(ids)):
                tokens = ids[row] if mask is None else ids[row][mask[row].bool()]
                yield index, self.first_special(tokens.long().cpu())
                index += 1

    def first_special(self, tokens: torch.Tensor) -> torch.Tensor:
        """The prompt's tokens by the API's rule (prompt_tokens): a special token first where
        graph.prepend_bos and the prompt starts without one."""
        from probe.graphs.prompt_graph import prompt_tokens

        return prompt_tokens(tokens, self.tokenizer, self.spec.prepend_bos)

    def prompt_count(self, replay: Replay) -> int:
        """This rank's prompts."""
        samples = len(replay.shard.samples)
        if samples:
            return samples
        dataset = self.setup.dataset  # (a torchrun rank without samples: the whole dataset's)
        if not isinstance(dataset, Sized):  # (the command line's datasets have their length)
            raise RuntimeError("graph: the run's dataset has no length")
        return len(dataset)

    def finish(self, done: Finished) -> None:
        """Rank 0, on the run's file (a torchrun job's stitched one): the tables."""
        from probe.graphs.graph_tables import write_graph_tables
        from probe.graphs.qk_h5 import write_qk_csv
        from probe.graphs.run_json import GRAPH_JSON_DIR, write_run_graph_json

        written = write_graph_tables(done.h5_path, done.run_dir, self.spec.edges)
        qk_csv = write_qk_csv(done.h5_path, done.run_dir) if self.spec.qk else None
        if qk_csv is not None:
            written.append(qk_csv)
        source = None
        if self.spec.examples:
            from probe.graphs.feature_files import LOCAL_SOURCE

            source = LOCAL_SOURCE
        folder = write_run_graph_json(done.h5_path, done.run_dir / GRAPH_JSON_DIR, source)
        written.append(folder)
        if self.spec.examples:
            self.write_feature_files(done.run_dir, folder)
        log.info("wrote /graph in %s and %s", done.h5_path.name, ", ".join(p.name for p in written))

    def write_feature_files(self, run_dir: Path, folder: Path) -> None:
        """Each kept feature's example file (graph.examples) beside the viewer's JSON."""
        import pandas as pd

        from probe.graphs.feature_files import FeatureFiles
        from probe.graphs.replacement import replacement_parts

        nodes = pd.read_csv(run_dir / "graph_nodes.csv")
        kept = nodes[(nodes["kind"] == "feature") & nodes["kept"]]
        features = sorted(set(zip(kept["layer"].astype(int), kept["feature"].astype(int),
                                  strict=True)))  # fmt: skip
        from probe.read.runs import open_run

        model = self.setup.model
        parts = replacement_parts(model, self.overrides)
        files = FeatureFiles(model, parts, self.transcoders, self.tokenizer)
        with open_run(str(self.spec.examples)) as run:
            count = files.write(run, features, folder)
        log.info("graph: %d features' example files in %s", count, folder / "features")


def _log_projection(first: int, prompts: int) -> None:
    """The run plan's part for graphs, known once one is made: its rows' bytes times the
    prompts to make (the run's other data, graph_json/ and the csv tables besides)."""
    from probe.launch.size_plan import human

    log.info("graph: the first prompt's graph is %s in /graph; %d prompts project to about %s",
             human(first), prompts, human(first * prompts))  # fmt: skip


def _check_examples(path: str) -> None:
    """graph.examples: a run holding transcoder features, named before the loop."""
    from probe.graphs.feature_files import feature_modules
    from probe.read.runs import open_run

    try:
        with open_run(path) as run:
            feature_modules(run)
    except ProbeError:
        raise
    except OSError as e:
        raise ConfigError(
            f"graph.examples={path!r} is not a run directory ({e}); give a run of the model over "
            "a dataset with a probe of transcoders=SET and stats.topk=K"
        ) from None


# graph.* keys that leave every graph's values as they are (the backward's batch, also the
# prompt copies of a node-traced QK table: the same values up to the rounding of products of
# another batch shape; the example files written at the finish for every prompt): a resume may
# change them
SAME_GRAPHS = frozenset({"batch_size", "examples"})


def _check_same_options(out: GroupTables, attrs: dict[str, str], path: Path) -> None:
    """A resumed /graph must hold graphs of the same graph.* settings (a key the file does not
    name, written before the key existed, had its default)."""
    old = json.loads(str(out.group.attrs.get("options", "{}")))
    new = json.loads(attrs["options"])
    defaults = {f.name: f.default for f in dataclasses.fields(GraphSpec)}
    changed = sorted(
        k for k in old.keys() | new.keys()
        if k not in SAME_GRAPHS and old.get(k, defaults.get(k)) != new.get(k, defaults.get(k))
    )  # fmt: skip
    if changed:
        raise ConfigError(
            f"resume=true but {path.name} holds the attribution graphs of other graph.* settings "
            f"({', '.join(f'graph.{k}' for k in changed)}); resume with the same settings, or "
            "start a new run (overwrite=true or a new hydra.run.dir)"
        )


def _overrides(plan: RunPlan) -> dict | None:
    """model.anatomy's keys (None: the anatomy's own)."""
    anatomy = getattr(plan.model, "anatomy", None)
    return dict(anatomy) if anatomy else None


def _tokenizer(plan: RunPlan):
    """The tokenizer of dataset.tokenizer or model.name, where one loads (None: none)."""
    from probe.data.text import TOKENIZER_FILES

    name = getattr(plan.data, "tokenizer", None) or plan.model.name
    if not name:
        return None
    folder = Path(str(name)).expanduser()
    if folder.is_dir() and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        return None  # (transformers would build an empty tokenizer from a config.json alone)
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(name))
    except Exception:  # noqa: BLE001 - a model without tokenizer files: ids name the tokens
        log.info("graph: no tokenizer at %s; tokens are named by their ids", name)
        return None


def _log_graph(prompt: int, graph: AttributionGraph) -> None:
    kept_nodes = int(graph.node_kept.sum()) if graph.node_kept is not None else graph.n_nodes
    kept_edges = int(graph.edge_kept.sum()) if graph.edge_kept is not None else -1
    log.info(
        "graph: prompt %d, %d tokens: %d nodes (%d kept), %d edges (%d kept), replacement "
        "%.3f, completeness %.3f",
        prompt, graph.n_pos, graph.n_nodes, kept_nodes, int(graph.adjacency._nnz()), kept_edges,
        graph.scores.get("replacement", float("nan")),
        graph.scores.get("completeness", float("nan")),
    )  # fmt: skip
