"""The checks a run's config takes before torch is imported or a model is built: its data,
probes, edits, grid, objective, lens, store and run options (the model's: probe.model_checks).

probe.plan calls them, once, on the typed objects it parses; nothing else does. Each raises the
error a user sees (docs/errors.md holds the messages). The name lists are probe.config's.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path

from probe.choices import NUMBA_MISSING
from probe.config import (
    ATTENTION_SITES,
    BACKWARD_SITES,
    CIRCUIT_ABLATIONS,
    CIRCUIT_SELECTS,
    DATA_FILES,
    DATASETS,
    DIRECTIONS,
    DTYPES,
    EDIT_SITES,
    FEATURE_OPS,
    FEATURE_SITE,
    GRAD_EDIT_SITES,
    GRAPH_EDGES,
    GRAPH_QK_SOURCES,
    GRID_AXES,
    GRID_METHODS,
    IG_METHODS,
    LABEL_SUBTOKENS,
    LENSES,
    LOGIT_INDICES,
    METRICS,
    OBJECTIVES,
    OPS,
    OPTIMIZERS,
    PATCH_SOURCES,
    REDUCTIONS,
    ROWS,
    SITES,
    TEXT_SUFFIXES,
    TOKEN_REDUCTIONS,
    require_target,
)
from probe.errors import ConfigError, DataError
from probe.shared_checks import check_steps, choice, circuit_methods
from probe.specs import (
    AttributionSpec,
    CircuitSpec,
    DataSpec,
    EditSpec,
    GraphSpec,
    GridSpec,
    InterventionSpec,
    LensSpec,
    ModelSpec,
    ObjectiveSpec,
    ProbeSpec,
    RunOptions,
    StatsSpec,
    StoreSpec,
    TrainSpec,
    WatchSpec,
)
from probe.watch_options import check_keys

SEED_LIMIT = 1 << 40
# the device types torch.device parses (the pinned torch's list; `auto` is probe's own)
DEVICE_TYPES = (
    "cpu", "cuda", "ipu", "xpu", "mkldnn", "opengl", "opencl", "ideep", "hip", "ve", "fpga",
    "maia", "xla", "lazy", "vulkan", "mps", "meta", "hpu", "mtia", "privateuseone",
)  # fmt: skip
DEVICE = re.compile(rf"^(?:{'|'.join(DEVICE_TYPES)})(?::(?:0|[1-9][0-9]*))?$")


# -- the words every check is made of ------------------------------------------------------------
# (`choice` is probe.shared_checks', where the checks the library functions share live)
def at_least(key: str, value, least: int = 1, note: str = "") -> None:
    """A ConfigError naming `key` where `value` is below `least` (None: unset, accepted)."""
    if value is not None and value < least:
        raise ConfigError(f"{key}={value} must be at least {least}{note}")


def check_training(train: TrainSpec, watch: WatchSpec, probes: Mapping[str, ProbeSpec]) -> None:
    """`python -m probe.train`'s train.* and watch.* keys (those by the watch's option
    declaration, probe.watch_options), and that it watches something."""
    choice("train.optimizer", train.optimizer, OPTIMIZERS)
    for key in ("lr", "momentum", "weight_decay"):
        value = getattr(train, key)
        if not math.isfinite(value) or value < 0:
            raise ConfigError(f"train.{key}={value!r}: give a finite number >= 0")
    at_least("train.steps", train.steps, note=" (the optimizer steps to run)")
    check_keys(dataclasses.asdict(watch), "watch.")  # (each as probe.watch checks its keyword)
    if not probes:
        raise ConfigError("the training watches no probe; choose probes=all_linear or add one")


def check_circuit(c: CircuitSpec, options: RunOptions) -> None:
    """circuit.* as far as the config decides (the methods' names are the registry's: the run
    checks them before it builds the model; probe.launch.circuit_pass checks the rest on the
    model and the pairs: the graph, the answers, exact's edges, the sizes, mean_source's file)."""
    if not c.method:
        return
    choice("circuit.ablation", c.ablation, CIRCUIT_ABLATIONS)
    circuit_methods(c.method, c.ablation)
    choice("circuit.select", c.select, CIRCUIT_SELECTS)
    choice("circuit.metric", c.metric, METRICS)
    check_steps(c.steps)
    if c.mean_source and c.ablation != "mean":
        raise ConfigError(
            f"circuit.mean_source={c.mean_source!r} gives means for circuit.ablation=mean; "
            f"the run asks circuit.ablation={c.ablation}: drop one of them"
        )
    if options.train_mode:
        raise ConfigError(
            "circuit.method needs train_mode=false: dropout would make the clean and the patched "
            "forwards differ"
        )


GRAPH_DATA = ("text", "tokens")


def check_graphs(g: GraphSpec, model: ModelSpec, data: DataSpec, options: RunOptions) -> None:
    """graph.* as far as the config decides (probe.launch.features.attribution_graphs reads
    the transcoders and checks them against the model): a language model of model=hf over
    dataset=text|tokens, the thresholds and the probability in [0, 1], the counts positive, the
    transcoder set's path there."""
    if not g.on:
        return
    if model.library != "hf":
        raise ConfigError(
            f"graph.transcoders={g.transcoders!r} traces a language model's features, and "
            f"model.library={model.library!r} is not one; use model=hf with a causal language "
            "model, or leave graph.transcoders unset"
        )
    if model.task != "causal_lm":
        raise ConfigError(
            f"graph.transcoders attributes the next token's logits, and model.task={model.task!r} "
            "has no language-model head; give model.task=causal_lm"
        )
    if data.name not in GRAPH_DATA:
        raise ConfigError(
            f"graph.transcoders computes one graph per prompt of dataset=text or dataset=tokens; "
            f"the run has dataset={data.name}: choose one of them, or leave graph.transcoders unset"
        )
    for key in ("logit_prob", "node_threshold", "edge_threshold"):
        value = getattr(g, key)
        if not (isinstance(value, int | float) and 0 <= value <= 1):
            raise ConfigError(f"graph.{key}={value} must lie in [0, 1], e.g. graph.{key}=0.8")
    if g.logit_prob == 0:
        raise ConfigError("graph.logit_prob=0 chooses no logit; give a probability in (0, 1]")
    at_least("graph.max_logits", g.max_logits, 1)
    at_least("graph.max_feature_nodes", g.max_feature_nodes, 1, " (null: every active feature)")
    at_least("graph.batch_size", g.batch_size, 1, " (null: the memory plan's)")
    at_least("graph.update_interval", g.update_interval, 1, " (batches between re-rankings)")
    at_least("graph.qk", g.qk, 0, " (key positions per head and query position; 0: off)")
    at_least("graph.qk_rows", g.qk_rows, 1, " (cells kept per decomposed pair; null: every one)")
    choice("graph.qk_sources", g.qk_sources, GRAPH_QK_SOURCES)
    if g.floor is not None and not (math.isfinite(g.floor) and 0 <= g.floor < 1):
        raise ConfigError(
            f"graph.floor={g.floor} must be a fraction in [0, 1): per row, the smallest edges "
            "are dropped only while their |weight| sum stays under that share of the row's "
            "|weight| sum (0: every edge; null: 0 for small graphs, else the attribution's "
            "default)"
        )
    choice("graph.edges", g.edges, GRAPH_EDGES)
    if not Path(str(g.transcoders)).expanduser().exists():
        raise ConfigError(
            f"graph.transcoders={g.transcoders!r} does not exist; give a transcoder set's YAML "
            "(circuit-tracer's: feature_input_hook, feature_output_hook, transcoders) or a folder "
            "holding one"
        )
    if options.train_mode:
        raise ConfigError(
            "graph.transcoders needs train_mode=false: dropout would make the replacement model "
            "differ from the model's forward"
        )


def check_seed(key: str, seed) -> None:
    """Seeds derived from `seed` (seed * 1_000_003 + sample, edit, layer) must fit torch's 64-bit
    generators; a larger one would fail deep in the data loader."""
    if seed is not None and not -SEED_LIMIT < seed < SEED_LIMIT:
        raise ConfigError(
            f"{key}={seed} is out of range: the seeds derived from it (per sample, per edit) must "
            f"fit torch's 64-bit generator; give |{key}| < 2**40 ({SEED_LIMIT}), e.g. {key}=0"
        )


# -- how the run runs ----------------------------------------------------------------------------
def check_run_options(options: RunOptions, store: StoreSpec, stats: StatsSpec) -> None:
    """The device, the statistics (stats.*, and the numba backend installed) and store.*.
    precision, store.model_output, stats.backend, store.mode and store.compression are Choices of
    the schema: Hydra refused any other value when it composed the config."""
    check_store(store, stats.during)
    for key in ("topk", "bottomk", "topk_quantiles"):
        at_least(f"stats.{key}", getattr(stats, key), 0, " (0: off)")
    check_device(options.device)
    if stats.backend == "numba" and importlib.util.find_spec("numba") is None:
        raise ConfigError(NUMBA_MISSING)


def check_device(name) -> None:
    """`device` names a torch device (cpu, cuda, cuda:N, ...) or auto."""
    if name != "auto" and not DEVICE.match(str(name)):
        raise ConfigError(f"device={name!r} is not a torch device; use cpu, cuda, cuda:N or auto")


def check_store(s: StoreSpec, during: str = "run") -> None:
    """store.* (and stats.during, which needs stored rows): the writer takes them as they are."""
    at_least("store.queue_batches", s.queue_batches)
    if s.mode == "stats" and during != "run":
        raise ConfigError(
            f"stats.during={during} needs store.mode=full: a statistics-only run keeps no rows to "
            "compute them from later; use stats.during=run"
        )
    at_least("store.chunk_bytes", s.chunk_bytes, note=" (bytes per HDF5 chunk; default 1048576)")
    at_least("store.flush_seconds", s.flush_seconds, 0, " (0 flushes after every batch)")
    name = str(s.filename)
    if not name or Path(name).is_absolute() or name.startswith("~") or ".." in Path(name).parts:
        raise ConfigError(
            f"store.filename={name!r} is outside the run directory: the file must live in the run "
            "directory (hydra.run.dir); give a relative name such as store.filename=probe.h5, and "
            "choose the folder with hydra.run.dir=DIR"
        )
    level = s.compression_level
    if s.compression == "gzip" and level is not None and not 0 <= level <= 9:
        raise ConfigError(
            f"store.compression_level={level} is out of range for gzip; give 0-9 "
            "(1 is fastest, 9 smallest)"
        )


# -- the dataset ---------------------------------------------------------------------------------
def check_data(d: DataSpec) -> None:
    """The dataset's sizes and name, and the files and folders its kind reads."""
    at_least("dataset.batch_size", d.batch_size)
    at_least("dataset.num_samples", d.num_samples, note=" (or null for all)")
    if d.name not in DATASETS:
        raise ConfigError(f"unknown dataset {d.name!r}; choose one of {', '.join(DATASETS)}")
    for key in ("image_size", "channels", "num_classes"):
        at_least(f"dataset.{key}", getattr(d, key), note=" (or null for the model's own)")
    at_least("dataset.num_workers", d.num_workers, 0, " (0 loads in the main process)")
    if d.name in ("text", "random_tokens"):
        at_least("dataset.seq_len", d.seq_len, note=" (tokens per row)")
    if d.name == "imagefolder":
        at_least("dataset.resize", d.resize, note=" (pixels)")
        at_least("dataset.crop", d.crop, note=" (pixels)")
        if any(v <= 0 for v in d.std):
            raise ConfigError(f"dataset.std={list(d.std)} must be > 0 (inputs are divided by it)")
        if d.root is None:
            raise ConfigError(
                "dataset=imagefolder needs dataset.root=DIR (a folder of class folders)"
            )
        check_root(d.root)
    if d.name in DATA_FILES:
        if d.path is None:
            raise ConfigError(f"dataset={d.name} needs dataset.path=FILE ({DATA_FILES[d.name]})")
        fix = "; fix its permissions" if d.name == "tensors" else ""
        check_data_file(d.path, DATA_FILES[d.name], fix)
    _check_file_kind(d)
    tok = str(d.tokenizer or "")  # a local folder (a hub name has at most one "/")
    local = tok.startswith(("/", ".", "~")) or tok.count("/") > 1
    if d.name in ("text", "pairs") and local and not Path(tok).expanduser().is_dir():
        raise DataError(
            f"dataset.tokenizer={tok!r} is not a directory; give a folder saved with "
            "tokenizer.save_pretrained(DIR), or leave it unset for the model's"
        )
    if d.name == "text":
        _check_labels(d)
        if d.prepend_bos and d.seq_len < 2:
            raise ConfigError(
                f"dataset.seq_len={d.seq_len} with dataset.prepend_bos=true leaves no room for "
                "text after the special token; give seq_len >= 2"
            )
    elif d.prepend_bos:
        raise ConfigError(
            f"dataset.prepend_bos=true applies to dataset=text (the ids of dataset={d.name} are "
            "taken as given); prepend the token to the ids yourself, or set it false"
        )


def _check_file_kind(d: DataSpec) -> None:
    """The suffixes dataset=text and dataset=pairs read."""
    suffix = Path(str(d.path)).suffix
    if d.name == "text" and suffix.lower() not in TEXT_SUFFIXES:
        raise DataError(
            f"dataset.path={str(d.path)!r} has the unsupported suffix {suffix!r}; dataset=text "
            f"reads {', '.join(TEXT_SUFFIXES)}"
        )
    if d.name == "pairs" and suffix.lower() not in (".jsonl", ".pt"):
        raise DataError(
            f"dataset.path={str(d.path)!r} has the unsupported suffix {suffix!r}; dataset=pairs "
            f"reads {DATA_FILES['pairs']}"
        )


def _check_labels(d: DataSpec) -> None:
    """dataset=text's labels: a way to put word labels on sub-tokens, and no packing."""
    names = [n for n in (d.label_field, d.word_labels_field) if n]
    if names and d.pack:
        raise ConfigError(
            f"dataset.pack=true joins documents, but labels ({', '.join(names)}) belong to one "
            "document each; set dataset.pack=false"
        )
    if not d.pack and d.label_subtokens not in LABEL_SUBTOKENS:
        raise DataError(
            f"dataset.label_subtokens={d.label_subtokens!r} is unknown; choose first or all"
        )


def check_root(root) -> Path:
    """dataset.root of dataset=imagefolder, which must be a directory."""
    p = Path(str(root))
    if not p.is_dir():
        raise DataError(
            f"dataset.root={str(root)!r} is not a directory; give a folder of class sub-folders"
        )
    return p


def check_data_file(path, what: str, fix: str = "") -> Path:
    """dataset.path, which must be a readable file; `what` says what it holds, `fix` how to
    mend permissions."""
    p = Path(str(path))
    if p.is_dir():
        raise DataError(f"dataset.path={str(path)!r} is a directory; give {what}")
    if not p.is_file():
        raise DataError(f"dataset.path={str(path)!r} does not exist; give {what}")
    if not os.access(p, os.R_OK):
        raise DataError(f"dataset.path={str(path)!r} cannot be read (permission denied){fix}")
    return p


# -- probes --------------------------------------------------------------------------------------
def check_probe(name: str, spec: ProbeSpec, sites: bool = True) -> None:
    """A probe's sites (unless `sites` is False: a caller with sites of its own checks them),
    reduction, dtype, rows, unit axis and layer matching."""
    for site in spec.capture if sites else ():
        if site not in SITES:
            raise ConfigError(
                f"probe {name!r}: capture site {site!r} is unknown; choose from {', '.join(SITES)}"
            )
    if sites and not spec.capture and not spec.transcoders:
        raise ConfigError(
            f"probe {name!r}: capture is empty; list sites from {', '.join(SITES)} (or give "
            "transcoders=SET for its features alone)"
        )
    for key, known in (("reduce", REDUCTIONS), ("dtype", DTYPES), ("rows", ROWS)):
        choice(f"probe {name!r}: {key}", getattr(spec, key), known)
    if spec.rows == "tokens" and spec.reduce != "none":
        raise ConfigError(
            f"probe {name!r}: rows: tokens keeps every token, so it takes reduce: none, not "
            f"{spec.reduce!r} (the token reductions {', '.join(TOKEN_REDUCTIONS)} give one row "
            "per sample)"
        )
    grid = spec.cam_grid
    if grid is not None and (len(grid) != 2 or any(int(g) < 1 for g in grid)):
        raise ConfigError(
            f"probe {name!r}: cam_grid={list(grid)} is not a grid; give [height, width] of the "
            "token grid, e.g. cam_grid: [14, 14] for a ViT-B/16 at 224 px"
        )
    at_least(f"probes.{name}.cam_skip_tokens", spec.cam_skip_tokens, 0)
    axis = spec.unit_axis
    if axis != "auto" and (isinstance(axis, bool) or not isinstance(axis, int) or axis == 0):
        raise ConfigError(
            f"probe {name!r}: unit_axis={axis!r} is neither auto nor a nonzero axis; give auto, "
            "1 (channels of N, C, H, W) or -1 (features of N, T, C)"
        )
    check_match(f"probe {name!r}", spec.where.match)


def check_match(label: str, match: str) -> None:
    """`match` of a probe, edit or grid: all or any of its layer patterns."""
    if match not in ("all", "any"):
        raise ConfigError(f"{label}: match={match!r} is unknown; choose all or any")


# -- edits, grid, metrics ------------------------------------------------------------------------
def check_interventions(iv: InterventionSpec) -> None:
    """The edits, the grid, the metrics and where they read; the patches' direction (the run
    feeds one half of each pair)."""
    for name, spec in iv.edits.items():
        check_edit(name, spec)
    if iv.grid is not None:
        check_grid(iv.grid)
    for name in iv.metrics:
        if name not in METRICS:
            raise ConfigError(
                f"intervene.metrics: {name!r} is unknown; choose from {', '.join(METRICS)}"
            )
    position = iv.position
    if position is not None and (isinstance(position, bool) or not isinstance(position, int)):
        raise ConfigError(f"intervene.position={position!r} must be a token position (an int)")
    if iv.grid is not None and not iv.metrics:
        raise ConfigError("intervene=patch_grid needs intervene.metrics, e.g. [logit_diff]")
    patches = [e for e in iv.edits.values() if e.op == "patch"]
    found = {e.direction for e in patches} | ({iv.grid.direction} if iv.grid else set())
    if len(found) > 1:
        raise ConfigError(
            "intervene: the patches disagree on direction (denoise and noise); the run feeds one "
            "half of each pair, so give them one direction"
        )


def check_edit(name: str, spec: EditSpec) -> None:
    """An edit's site, op and the op's arguments."""
    choice(f"intervene {name!r}: site", spec.site, (*EDIT_SITES, FEATURE_SITE))
    if spec.site == FEATURE_SITE:
        _check_feature_edit(name, spec)
        return
    choice(f"intervene {name!r}: op", spec.op, OPS)
    check_match(f"intervene {name!r}", spec.where.match)
    if spec.op == "clamp" and spec.min is None and spec.max is None:
        raise ConfigError(
            f"intervene {name!r}: op=clamp needs min and/or max (e.g. +intervene.{name}.max=1.0)"
        )
    check_seed(f"intervene.{name}.seed", spec.seed)
    if spec.op == "noise" and spec.std < 0:
        raise ConfigError(f"intervene {name!r}: std={spec.std} must be >= 0")
    if spec.op == "mean":
        _check_mean(name, spec)
    if spec.op == "patch" or (spec.op == "add" and spec.vector):
        _check_patch(name, spec)


def _check_feature_edit(name: str, spec: EditSpec) -> None:
    """site=feature: op zero|scale|clamp, a block `layer` and a `feature` index; no keys of the
    other sites' ops."""
    choice(f"intervene {name!r}: op (site=feature)", spec.op, FEATURE_OPS)
    for key in ("layer", "feature"):
        value = getattr(spec, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(
                f"intervene {name!r}: site=feature needs {key}, an index >= 0 (got {value!r}), "
                f"e.g. +intervene.{name}.layer=1 +intervene.{name}.feature=42"
            )
    other = [k for k in ("min", "max", "channels", "units", "heads", "source", "vector")
             if getattr(spec, k) is not None]  # fmt: skip
    if other:
        raise ConfigError(
            f"intervene {name!r}: site=feature takes layer, feature, positions, op (zero, scale "
            f"with factor, clamp with value) and transcoders, not {', '.join(other)}"
        )


def _check_mean(name: str, spec: EditSpec) -> None:
    if spec.site not in ("input", "output"):
        raise ConfigError(
            f"intervene {name!r}: op=mean applies to input/output sites, not {spec.site}"
        )
    if not spec.source:
        raise ConfigError(
            f"intervene {name!r}: op=mean needs a source of means: source=first_pass (an extra pass "
            "over the dataset) or source=PATH of an earlier run's probe.h5 that captured this site"
        )
    if spec.source != "first_pass" and not Path(spec.source).is_file():
        raise DataError(
            f"intervene {name!r}: source={spec.source!r} is not a file; give the probe.h5 of an "
            "earlier run that captured this site, or source=first_pass"
        )


def _check_patch(name: str, spec: EditSpec) -> None:
    """op=patch, or op=add with a steering vector."""
    if spec.site not in ("input", "output"):
        raise ConfigError(
            f"intervene {name!r}: op={spec.op} edits input or output sites, not {spec.site}"
        )
    if spec.channels is not None:
        raise ConfigError(
            f"intervene {name!r}: op={spec.op} takes units (and positions, heads), not channels"
        )
    if spec.heads is not None and spec.site != "input":
        raise ConfigError(
            f"intervene {name!r}: heads split the input of an attention output projection into "
            "the model's heads; give site: input on it (e.g. attn.c_proj, self_attn.o_proj)"
        )
    if spec.direction not in DIRECTIONS:
        raise ConfigError(
            f"intervene {name!r}: direction={spec.direction!r} is unknown; choose denoise or noise"
        )
    if spec.op == "patch" and (not spec.source or spec.source == "first_pass"):
        raise ConfigError(
            f"intervene {name!r}: op=patch needs a source: pair (the other half of "
            "dataset=pairs), clean (the unedited input) or an earlier run's directory"
        )
    if spec.op == "add" and spec.vector == "mean_diff" and (not spec.plus or not spec.minus):
        raise ConfigError(
            f"intervene {name!r}: vector=mean_diff needs plus=RUN and minus=RUN, two earlier "
            "runs that captured this site"
        )


def check_grid(spec: GridSpec, label: str = "intervene.grid") -> None:
    """A patching grid's axes, site, direction, source, cells per forward and methods."""
    over = list(spec.over)
    if "layer" not in over or any(a not in GRID_AXES for a in over) or len(set(over)) != len(over):
        raise ConfigError(
            f"{label}.over={over} must list layer, then position and/or head: [layer], "
            "[layer,position], [layer,head] or [layer,position,head]"
        )
    if spec.site not in ("output", "input", *ATTENTION_SITES):
        raise ConfigError(
            f"{label}.site={spec.site!r} must be output, input, query or key (the last two "
            "at attention modules: '@attn')"
        )
    if spec.direction not in DIRECTIONS:
        raise ConfigError(f"{label}.direction={spec.direction!r}: choose denoise or noise")
    if spec.stack is not None and spec.stack < 1:
        raise ConfigError(f"{label}.stack={spec.stack} must be at least 1 (or null)")
    if spec.site in ATTENTION_SITES and str(spec.source) not in PATCH_SOURCES:
        raise ConfigError(
            f"{label}: site {spec.site} takes its source from the pair or the clean input, "
            f"not from a run file ({str(spec.source)!r})"
        )
    if "head" in over and spec.site not in ("input", *ATTENTION_SITES):
        raise ConfigError(
            f"{label}: a grid over heads patches the input of attention output projections; "
            "give site: input and their layers (e.g. '@blocks.attn.c_proj')"
        )
    methods = [spec.method] if isinstance(spec.method, str) else list(spec.method)
    for m in methods:
        if m not in GRID_METHODS:
            raise ConfigError(
                f"{label}.method={m!r} is unknown; choose from {', '.join(GRID_METHODS)}"
            )
    if not methods:
        raise ConfigError(f"{label}.method is empty; give exact, atp or atp_star (or a list)")
    check_match(label, spec.where.match)


# -- the objective, integrated gradients, the lens -----------------------------------------------
def wants_gradients(probes: Mapping[str, ProbeSpec], edits: Mapping[str, EditSpec]) -> bool:
    """Whether the run differentiates: a gradient site of a probe that must select something, or
    a gradient edit."""
    return any(
        s in BACKWARD_SITES for p in probes.values() if not p.allow_empty for s in p.capture
    ) or any(e.site in GRAD_EDIT_SITES for e in edits.values())


def check_objective(o: ObjectiveSpec, num_outputs: int | None) -> None:
    """The objective's name, a logit's index (below `num_outputs` where it is known) and a custom
    one's `_target_`."""
    if o.name not in OBJECTIVES:
        raise ConfigError(f"unknown objective {o.name!r}; choose one of {', '.join(OBJECTIVES)}")
    if o.name in ("logit", "logprob"):
        k = o.index
        if k is None:
            raise ConfigError(
                f"objective={o.name} needs the class to explain: add objective.index=K (0 for the "
                "first output), objective.index=target (each sample's label) or "
                "objective.index=predicted (the model's argmax)"
            )
        if isinstance(k, str) and k in LOGIT_INDICES:
            return
        if isinstance(k, bool) or not isinstance(k, int):
            raise ConfigError(
                f"objective.index={k!r} is neither a class number nor one of "
                f"{', '.join(LOGIT_INDICES)}"
            )
        if num_outputs is not None and not -num_outputs <= k < num_outputs:
            raise ConfigError(
                f"objective.index={k} is out of range for a model output of {num_outputs} logits; "
                f"give 0 <= index < {num_outputs}"
            )
    if o.name == "custom":
        require_target("objective._target_", o._target_)


def check_attribution(a: AttributionSpec) -> None:
    """attribution.* of integrated gradients (ig_output)."""
    if a.steps < 2:
        raise ConfigError(
            f"attribution.steps={a.steps} must be at least 2 (points between the baseline and "
            "the activation; 32 by default, more for a smaller completeness gap)"
        )
    choice("attribution.method", a.method, IG_METHODS)
    at_least("attribution.internal_batch_size", a.internal_batch_size, note=" (rows per pass)")
    base = str(a.baseline)
    if base not in ("zeros", "mean") and not (Path(base) / "probe.h5").is_file():
        raise ConfigError(
            f"attribution.baseline={base!r} is neither zeros, mean nor a run directory holding "
            "probe.h5; give zeros, mean (this run's mean of the layer) or an earlier run's "
            "directory that captured the layer's output"
        )


def check_lens(lens: LensSpec) -> None:
    """Which reader of the residual stream the run has."""
    if lens.name not in LENSES:
        raise ConfigError(f"lens={lens.name!r} is unknown; choose from {', '.join(LENSES)}")
