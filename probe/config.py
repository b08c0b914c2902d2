"""Typed config schemas, registered in Hydra's ConfigStore, and the names of the values keys take.

The YAML files under conf/ merge onto these dataclasses, so a misspelt key or a wrong type fails at
compose time with Hydra's own message; probe.plan then parses the composed config into frozen
objects of the same fields and checks their values.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from probe.choices import (
    Compression,
    ModelOutput,
    Precision,
    StatsBackend,
    StatsDuring,
    StoreMode,
)

# the site families are defined in probe.site_keys; the checks take them from here
from probe.site_keys import BACKWARD_SITES as BACKWARD_SITES
from probe.site_keys import EDIT_SITES as EDIT_SITES
from probe.site_keys import GRAD_EDIT_SITES as GRAD_EDIT_SITES
from probe.site_keys import PROBE_SITES

SITES = PROBE_SITES  # what a probe captures (probes.<name>.capture)

IG_METHODS = ("riemann_trapezoid", "gausslegendre")
LOGIT_INDICES = ("target", "predicted")  # objective.index besides a class number
REDUCTIONS = ("none", "spatial_mean", "token_mean", "first_token", "last_token")
TOKEN_REDUCTIONS = ("token_mean", "first_token", "last_token")
ROWS = ("samples", "tokens")
DTYPES = ("float32", "float16")
WEIGHT_DTYPES = ("float32", "bfloat16", "float16")  # model.dtype: the weights' dtype
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")  # accelerate's strategies
LIBRARIES = ("torchvision", "hf", "timm", "custom")
HF_TASKS = ("base", "causal_lm", "masked_lm", "sequence_classification", "token_classification")
TOKEN_DATASETS = ("tokens", "text", "random_tokens")
DATASETS = ("synthetic", "fakedata", "imagefolder", "tensors", *TOKEN_DATASETS, "pairs")
OBJECTIVES = ("cross_entropy", "logit", "logprob", "logit_diff", "output_sum", "lm_loss", "custom")
OPS = ("zero", "scale", "add", "clamp", "noise", "mean", "custom", "patch")
FEATURE_SITE = "feature"  # an edit of one transcoder feature (probe.intervene.feature_edit)
FEATURE_OPS = ("zero", "scale", "clamp")  # its ops: clamp sets the activation to `value`
PATCH_SOURCES = ("pair", "clean")  # a patch's source besides an earlier run's directory
DIRECTIONS = ("denoise", "noise")  # which half of a pair the run feeds (patches, grids)
ATTENTION_SITES = ("query", "key")  # grid sites inside attention modules ('@attn')
GRID_AXES = ("layer", "position", "head")
GRID_METHODS = ("exact", "atp", "atp_star")
METRICS = ("logit_diff", "answer_logprob", "answer_prob", "kl", "output_change")
LENSES = ("none", "logit", "tuned", "dla")
TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
LABEL_SUBTOKENS = ("first", "all")
# what dataset.path holds, for the datasets that read a file
DATA_FILES = {
    "tensors": "a .pt file of inputs",
    "tokens": "a .pt file of token ids",
    "text": "a .txt, .jsonl or .parquet file of text",
    "pairs": "a .jsonl file of clean/corrupt pairs or a .pt dict {clean_ids, corrupt_ids, ...}",
}


# what a `_target_` key's messages give as an example
TARGET_EXAMPLES = {
    "model._target_": "probe.models.zoo.LeNet",
    "objective._target_": "my_losses.per_sample_loss",
}


@dataclass
class ModelConfig:
    """Which network to build: `library` says where `name` comes from (a `_target_` class is
    always custom); hf and timm take `pretrained`, hf also `task` and `config` overrides."""

    name: str = MISSING
    library: str = "torchvision"
    _target_: str | None = None
    weights: str | None = None
    checkpoint: str | None = None
    # a prefix every checkpoint key carries (a DDP `module.`, a Lightning `model.`): only the keys
    # under it are loaded, without it
    checkpoint_prefix: str | None = None
    num_classes: int = 1000
    input_shape: list[int] = field(default_factory=lambda: [3, 224, 224])
    kwargs: dict[str, Any] = field(default_factory=dict)
    pretrained: bool | None = None  # None: hf loads weights, timm starts from random init
    task: str = "base"  # hf: which Auto class (HF_TASKS)
    config: dict[str, Any] = field(default_factory=dict)  # hf: config fields to set or override
    # where the weights live (probe.models.placement): None, one of DEVICE_MAPS, a device, or a
    # mapping module name -> device (cpu and disk offload); max_memory per device ({0: 10GiB,
    # cpu: 64GiB}), offload_folder for disk; the weights' dtype (WEIGHT_DTYPES)
    device_map: Any = None
    max_memory: Any = None
    offload_folder: str | None = None
    dtype: str = "float32"
    low_cpu_mem_usage: bool = False  # hf: load weights without a second copy in memory
    # the transformer anatomy for a family probe.models.anatomy does not know: attn_out and
    # mlp_out (suffixes below each block), final_norm, unembed (names), heads
    anatomy: dict[str, Any] = field(default_factory=dict)
    # the widths of a model that takes them (the shipped mlp: hidden units and hidden layers)
    width: int | None = None
    depth: int | None = None


@dataclass
class DatasetConfig:
    """Where the samples come from; they are always visited in a fixed order."""

    name: str = MISSING
    batch_size: int = 8
    num_samples: int | None = None
    image_size: int | None = None  # None: the model's input_shape
    channels: int | None = None  # None: the model's input_shape
    num_classes: int | None = None  # None: model.num_classes
    root: str | None = None
    path: str | None = None
    resize: int = 256
    crop: int = 224
    mean: list[float] = field(default_factory=lambda: [0.485, 0.456, 0.406])
    std: list[float] = field(default_factory=lambda: [0.229, 0.224, 0.225])
    num_workers: int = 0
    # token data (dataset=tokens|text|random_tokens)
    tokenizer: str | None = None  # None: the model's
    seq_len: int = 128
    pack: bool = False  # text: concatenate documents into full rows instead of one row each
    prepend_bos: bool = False  # text: each row starts with a special token (circuit-tracer's rule)
    text_field: str = "text"  # .jsonl / .parquet column holding the text
    label_field: str | None = None  # text: a document's class -> /samples/target
    word_labels_field: str | None = None  # text: a label per word -> /tokens/label
    label_subtokens: str = "first"  # a word's label on its first sub-token, or on all of them
    vocab_size: int | None = None  # random_tokens: None means the model's vocabulary


@dataclass
class ProbeSpec:
    """One named probe: which modules (globs over qualified names, class names) and what to keep."""

    layers: list[str] = field(default_factory=lambda: ["*"])
    types: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    capture: list[str] = field(default_factory=lambda: ["output"])
    reduce: str = "none"
    dtype: str = "float32"
    allow_empty: bool = False
    leaves_only: bool = False
    unedited: bool = False  # at an edited site, also keep the value before the edit
    unit_axis: Any = "auto"  # auto, or the axis of units (per-unit statistics, spatial_mean)
    rows: str = "samples"  # or tokens: one row per non-padding token
    match: str = "all"  # all: every layer pattern must match; any: at least one must
    # CAM sites on token layouts (N, T, C): the (height, width) grid of the tokens after the
    # first cam_skip_tokens (a ViT's class token)
    cam_grid: list[int] | None = None
    cam_skip_tokens: int = 0
    sae: Any = (
        None  # an SAE on the output: a folder (SAELens layout) or {path, dense, splice, error_term}
    )
    # a transcoder set (its YAML or folder): its features at each selected module it reads
    transcoders: str | None = None


@dataclass
class EditSpec:
    """One named intervention: modules selected like a probe, a site, an op and its arguments."""

    layers: list[str] = field(default_factory=lambda: ["*"])
    types: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    site: str = "output"
    op: str = MISSING
    factor: float = 1.0
    value: float = 0.0
    min: float | None = None
    max: float | None = None
    std: float = 0.0
    seed: int | None = None  # None: the run's seed
    channels: list[int] | None = None  # None: every unit; else indices along axis 1
    # op=mean: "first_pass" or an earlier run's probe.h5; op=patch: pair, clean or an earlier run
    source: str | None = None
    _target_: str | None = None  # op=custom: a callable tensor -> tensor
    positions: list[int] | None = None  # token positions (negative: from the last real token)
    units: list[int] | None = None  # indices along the unit axis
    heads: list[int] | None = None  # attention heads of an output projection's input
    direction: str = "denoise"  # dataset=pairs: denoise runs corrupt, patches clean; noise: reverse
    vector: str | None = None  # op=add: a .pt/.npy file, or mean_diff (of runs plus and minus)
    plus: str | None = None
    minus: str | None = None
    # site=feature: a transcoder feature (probe.intervene.feature_edit): the block `layer` and
    # the `feature` index; `transcoders` the set's YAML or folder (None: graph.transcoders)
    layer: int | None = None
    feature: int | None = None
    transcoders: str | None = None


@dataclass
class GridSpec:
    """A patching grid: one patched forward per cell of layers x positions x heads."""

    layers: list[str] = field(default_factory=lambda: ["@blocks"])
    types: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    site: str = "output"
    over: list[str] = field(default_factory=lambda: ["layer", "position"])
    positions: Any = "all"  # all, or a list (negative: from the last real token)
    heads: Any = "all"  # all, or a list
    source: str = "pair"
    direction: str = "denoise"
    match: str = "all"
    stack: int | None = None  # cells per forward; None: 1 on the CPU, 8 on a GPU
    # exact (patched forwards), atp (attribution patching: linear), atp_star (with the QK fix
    # for query and key sites); a list runs several on the same batches
    method: Any = "exact"


INTERVENE_KEYS = ("metrics", "position", "grid")  # the intervene group's keys that are no edit


@dataclass
class ObjectiveConfig:
    """What a gradient run differentiates: one value per sample, summed over the batch. `index`
    of logit and logprob: a class number, `target` (the sample's label) or `predicted` (the
    model's argmax)."""

    name: str = "cross_entropy"
    index: Any = None
    position: int | None = None  # logit of a token model: None means the last non-padding token
    _target_: str | None = None


@dataclass
class AttributionConfig:
    """Integrated gradients (`ig_output`): `steps` points between the baseline (zeros, the run's
    mean of the layer, or an earlier run's directory) and the activation, by `method`, in passes
    of at most `internal_batch_size` rows (None: the batch's own size)."""

    steps: int = 32
    baseline: str = "zeros"
    method: str = "riemann_trapezoid"
    internal_batch_size: int | None = None


@dataclass
class LensConfig:
    """Reading the residual stream of a language model (probe.attribute.lens, .dla): none,
    logit (the final norm and unembedding at each of `layers`), tuned (with the translators of
    `path` first) or dla (direct logit attribution of every component at the answer position)."""

    name: str = "none"
    layers: list[str] = field(default_factory=lambda: ["@blocks"])
    path: str | None = None  # tuned: a tuned lens folder (params.pt)
    position: int | None = None  # the answer's position (negative: from the last real token)
    tokens: list[int] | None = None  # dla: [answer id, wrong id] without a pairs dataset
    samples: int = 4  # first samples whose top-k tokens per layer and position are kept
    topk: int = 5
    positions: str = "all"  # all real tokens, or last: each sample's answer position alone


CIRCUIT_ABLATIONS = ("counterfactual", "mean", "zero")
CIRCUIT_SELECTS = ("topn", "greedy")


@dataclass
class CircuitConfig:
    """Edge scores and circuits over dataset=pairs (probe.circuits, docs/circuits.md): `method`
    one of the registry's methods (probe.circuits.scores.METHODS: eap, eap_ig_inputs,
    eap_ig_activations, exact, and any registered) or a list of them (empty: no circuit;
    probe.shared_checks.circuit_methods reads either form); the ablation
    (counterfactual, mean over the run's pairs or `mean_source` an earlier run's directory,
    zero); circuits of `sizes` percent of the edges cut by `select` (topn, greedy) on absolute or
    signed scores and evaluated for faithfulness (sizes empty: none); `metric` at `position` as
    the patching metrics are named."""

    method: Any = field(default_factory=list)  # a list, or one method (circuit.method=eap)
    steps: int = 5  # eap_ig_*: integration steps
    ablation: str = "counterfactual"
    mean_source: str | None = None
    sizes: list[float] = field(default_factory=lambda: [0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50])
    select: str = "topn"
    absolute: bool = True
    max_exact: int | None = 10000  # exact patches one forward per edge: refuse more edges
    metric: str = "logit_diff"
    position: int | None = None  # None: each pair's last real token


GRAPH_EDGES = ("pruned", "all")
# probe.graphs.attribution.QK_SOURCES: nodes by the cheaper direction, or the one named
GRAPH_QK_SOURCES = ("position", "nodes", "nodes_forward", "nodes_backward")


@dataclass
class GraphConfig:
    """Attribution graphs through transcoders (probe.graphs, docs/graphs.md): one graph per
    prompt of dataset=text|tokens when `transcoders` names a transcoder set (its YAML, or a
    folder holding one; null or empty: off). The salient logits are the fewest top tokens whose
    probability sums to `logit_prob`, at most `max_logits`; `max_feature_nodes` caps the features
    attributed (null: all active ones); pruning keeps `node_threshold` of the node influence and
    `edge_threshold` of the edge influence; graph_edges.csv holds the pruned graph's edges or
    `all` of them; `batch_size` target rows per backward pass, and the node-traced QK table's
    prompt copies per pass, forward or backward (null: as many as each memory plan fits, at
    most 64, probe.graphs.batch_plan) and `floor` the share of a row's |weight| sum under which
    its smallest edges are dropped (null: the attribution's default); `zero_bos` leaves
    position 0's features and error out of the nodes; `prepend_bos` puts the tokenizer's
    special token first in a prompt that does not start with one, the rule
    `probe.attribution_graph` follows (circuit-tracer's); `examples` names a run holding the
    set's features as a site with their top-k examples, from which each kept feature gets
    circuit-tracer's example file (probe.graphs.feature_files); `qk` (0: off) decomposes
    the attention scores of the `qk` key positions each head attends to most from each query
    position of the kept nodes, `qk_rows` the cells and marginals kept per pair (null: all),
    `qk_sources` each side split into the parts at its own position (position) or traced
    through the earlier layers' frozen patterns to the graph's nodes (nodes: by forward or
    backward passes, whichever costs less; nodes_forward, nodes_backward: the one named):
    graph_qk.csv (probe.graphs.qk_attribution)."""

    transcoders: str | None = None
    logit_prob: float = 0.95
    max_logits: int = 10
    max_feature_nodes: int | None = None
    node_threshold: float = 0.8
    edge_threshold: float = 0.98
    edges: str = "pruned"
    batch_size: int | None = None
    floor: float | None = None
    zero_bos: bool = True  # position 0's features and error are not nodes
    update_interval: int = 4  # batches between re-rankings of the features by influence
    prepend_bos: bool = True  # a special token first where a prompt starts without one
    examples: str | None = None  # a run holding the set's feature examples: the viewer's files
    qk: int = 0  # key positions per layer, head and query position whose scores are decomposed
    qk_rows: int | None = 20  # cells and marginals kept per decomposed pair (null: every one)
    qk_sources: str = "position"  # each side's parts at its position, or traced to the nodes


@dataclass
class StoreConfig:
    """How captures are kept: `full` writes tensors, `stats` only streaming statistics."""

    mode: StoreMode = StoreMode.full
    compression: Compression = Compression.none
    compression_level: int | None = None
    chunk_bytes: int = 1 << 20
    queue_batches: int = 2
    filename: str = "probe.h5"
    # /model/output: full, last (a token model's last non-padding position), none; auto: last
    # for token inputs (a language model's logits are vocabulary-wide per token), else full
    model_output: ModelOutput = ModelOutput.auto
    # 0: flush after every batch; >0: at most every so many seconds; None: 0 in full mode, and
    # STATS_FLUSH_SECONDS in stats mode, whose flush also writes /stats
    flush_seconds: float | None = None
    # full capture: whole chunks written with O_DIRECT where the OS and file system allow it
    # (probe.store.direct), else through HDF5; false: always through HDF5
    direct_io: bool = True


@dataclass
class StatsConfig:
    """How statistics are computed: `backend` auto, torch (the reference, on the capture's
    device) or numba (a compiled CPU accelerator, the `fast` extra); see probe.stats.backend."""

    backend: StatsBackend = StatsBackend.auto
    # when a full run computes them: run (in the hooks), close (from the stored rows once the
    # loop ends) or none (readers compute them from the rows where asked)
    during: StatsDuring = StatsDuring.run
    topk: int = 0  # per unit, the K largest values and their rows (/topk; 0: off)
    bottomk: int = 0  # the K smallest
    topk_quantiles: int = 0  # Q: a seeded sample of active rows in Q equal-count groups by rank


@dataclass
class Config:
    model: ModelConfig = MISSING
    dataset: DatasetConfig = MISSING
    # named probes, each a ProbeSpec: typed by `/schema/probe@NAME` in the probe files and by
    # probe.plan for one added on the command line (`+probes.head.layers=[fc]`), since OmegaConf
    # cannot add a key to a dict of dataclasses
    probes: dict[str, Any] = field(default_factory=dict)
    # named edits (EditSpec) and the keys of INTERVENE_KEYS: metrics, position, grid (GridSpec)
    intervene: dict[str, Any] = field(default_factory=dict)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    attribution: AttributionConfig = field(default_factory=AttributionConfig)
    lens: LensConfig = field(default_factory=LensConfig)
    circuit: CircuitConfig = field(default_factory=CircuitConfig)
    graph: GraphConfig = field(default_factory=GraphConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    stats: StatsConfig = field(default_factory=StatsConfig)
    seed: int = 0
    device: str = "cpu"
    precision: Precision = Precision.fp32  # fp32, or bf16/fp16 under torch.autocast
    train_mode: bool = False
    print_summary: bool = True
    progress: bool = True
    resume: bool = False  # continue an interrupted run in the same run directory
    overwrite: bool = False  # replace a probe.h5 already in the run directory (else refused)
    fail_on_nonfinite: bool = False  # stop at the first layer that produces NaN or Inf


OPTIMIZERS = ("sgd", "adam", "adamw")  # python -m probe.train's train.optimizer


@dataclass
class TrainKeys:
    """`python -m probe.train`'s training (probe.train.trainer turns it into a TrainSpec)."""

    optimizer: str = "sgd"  # sgd, adam, adamw
    lr: float = 0.1
    steps: int = 5
    momentum: float = 0.0  # sgd's
    weight_decay: float = 0.0
    fix_batch: bool = False  # every step on the dataset's first batch (mup's coordinate check)
    seed: int = 0  # the model's init, the data and the training's random state


@dataclass
class WatchKeys:
    """`python -m probe.train`'s watch: probe.watch's `every` and `flush_every`, each a field of
    probe.watch_options.WatchOptions of the same name and default, checked by its check
    (tests/train/test_watch_options.py holds them to it)."""

    every: Any = 1  # an int >= 1 or "log"
    flush_every: int = 10


@dataclass
class TrainConfig:
    """The root of `python -m probe.train` (conf/train.yaml): a run's model, dataset, probes and
    objective (the loss), and the training and watch keys."""

    model: ModelConfig = MISSING
    dataset: DatasetConfig = MISSING
    probes: dict[str, Any] = field(default_factory=dict)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    train: TrainKeys = field(default_factory=TrainKeys)
    watch: WatchKeys = field(default_factory=WatchKeys)
    device: str = "cpu"
    overwrite: bool = False


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    cs.store(name="train_config", node=TrainConfig)
    # typed edits in the intervene group: `defaults: [/schema/edit@NAME]` in its files
    cs.store(group="schema", name="edit", node=EditSpec)
    cs.store(group="schema", name="probe", node=ProbeSpec)
    cs.store(group="schema", name="grid", node=GridSpec)


register_configs()


def run_suffix() -> str:
    """`MICROSECONDS-PID`: with `${now:%H-%M-%S}` in front, a default run directory is unique for
    jobs started in the same second and still sorts by time (OmegaConf resolver `run_suffix`)."""
    import datetime
    import os

    return f"{datetime.datetime.now().microsecond:06d}-{os.getpid()}"


def register_resolvers() -> None:
    """`${run_suffix:}` in the default run directories, cached per config like Hydra's `now`;
    registered on import, before anything composes conf/."""
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("run_suffix", run_suffix, use_cache=True, replace=True)


register_resolvers()


def config_dir() -> str:
    """The conf/ folder: the checkout's top-level one, else the installed `probe.conf` package."""
    checkout = Path(__file__).resolve().parent.parent / "conf"
    if (checkout / "config.yaml").is_file() and (checkout / "__init__.py").is_file():
        return str(checkout)
    spec = importlib.util.find_spec("probe.conf")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("probe's config files are missing: reinstall the package")
    return str(next(iter(spec.submodule_search_locations)))


def library_of(model) -> str:
    """Which library builds model config (or spec) `model`: custom where a `_target_`,
    model.name=custom or model.library=custom says so, else model.library."""
    if model._target_ or model.name == "custom" or model.library == "custom":
        return "custom"
    return model.library or "torchvision"


def require_target(key: str, target: str | None, example: str | None = None) -> None:
    """A ConfigError naming `key` where `target` is None: nothing to import. `example` defaults
    to the key's in TARGET_EXAMPLES."""
    from probe.errors import ConfigError

    if target is None:
        raise ConfigError(
            f"{key} is missing; name what to import, e.g. {key}={_example(key, example)}"
        )


def _example(key: str, example: str | None) -> str:
    return example or TARGET_EXAMPLES.get(key, "pkg.mod.name")


def import_target(key: str, target: str | None, example: str | None = None):
    """The object a `_target_` names (configs are code: any importable callable), or a ConfigError
    naming the key."""
    from hydra.utils import get_object

    from probe.errors import ConfigError

    require_target(key, target, example)
    try:
        return get_object(str(target))
    except Exception as e:
        raise ConfigError(
            f"{key}={target!r} cannot be imported ({e}); give a dotted path importable from this "
            f"environment, e.g. {_example(key, example)}"
        ) from None
