"""The frozen, typed objects a run's plan is made of (probe.plan parses a config into them).

Each spec is the frozen form of its schema dataclass in probe.config, field by field and in the
same order (ModelConfig -> ModelSpec, DatasetConfig -> DataSpec, ...): lists become tuples,
mappings read-only FrozenDicts, the schema's Choices their plain names, an unset `???` None.
Probes, edits and the grid keep their layer selection (layers, types, exclude, match) in one
Selector, `where`, their first field. tests/test_plan.py holds each spec to its schema's fields
and defaults, so a key added to the schema and not here fails there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class FrozenDict(dict[K, V]):
    """A read-only mapping of the plan (a dict to json, isinstance and printing)."""

    def _read_only(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError(f"{type(self).__name__} is read-only")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _read_only
    __ior__ = _read_only

    def __hash__(self) -> int:  # type: ignore[override]  # (dict's is None: unhashable)
        return hash(tuple(sorted(self.items(), key=repr)))

    def __reduce__(self) -> tuple[type[FrozenDict], tuple[dict[K, V]]]:
        return (FrozenDict, (dict(self),))


@dataclass(frozen=True)
class Selector:
    """Which modules a probe, an edit, the grid or the lens takes: fnmatch globs over qualified
    module names (`@blocks` and the anatomy's aliases expanded), class names (base classes count
    too), globs to leave out, and whether every layer pattern must match (all) or one (any)."""

    layers: tuple[str, ...] = ("*",)
    types: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    match: str = "all"


@dataclass(frozen=True)
class SaeSpec:
    """A probe's `sae`: the SAE's folder and how it acts on the layer (probe.hooks.sae_site)."""

    path: str
    dense: bool = False
    splice: bool = False
    error_term: bool = False
    max_active: int = 0  # 0: the SAE's k (TopK), else probe.hooks.sae_site.MAX_ACTIVE


@dataclass(frozen=True)
class ModelSpec:
    """probe.config.ModelConfig parsed: frozen, checked. Which network to build: `library` says
    where `name` comes from (a `_target_` class is always custom); hf and timm take
    `pretrained`, hf also `task` and `config` overrides."""

    name: str | None = None  # (None: the config left it `???`)
    library: str = "torchvision"
    _target_: str | None = None
    weights: str | None = None
    checkpoint: str | None = None
    checkpoint_prefix: str | None = None
    num_classes: int = 1000
    input_shape: tuple[int, ...] = (3, 224, 224)
    kwargs: FrozenDict[str, Any] = FrozenDict()
    pretrained: bool | None = None
    task: str = "base"
    config: FrozenDict[str, Any] = FrozenDict()
    device_map: Any = None  # a strategy, a device, a GPU index or a FrozenDict module -> device
    max_memory: Any = None  # a FrozenDict device -> size
    offload_folder: str | None = None
    dtype: str = "float32"
    low_cpu_mem_usage: bool = False
    anatomy: FrozenDict[str, Any] = FrozenDict()
    width: int | None = None
    depth: int | None = None


@dataclass(frozen=True)
class DataSpec:
    """probe.config.DatasetConfig parsed: frozen, checked. Where the samples come from; they are
    always visited in a fixed order."""

    name: str | None = None  # (None: the config left it `???`)
    batch_size: int = 8
    num_samples: int | None = None
    image_size: int | None = None
    channels: int | None = None
    num_classes: int | None = None
    root: str | None = None
    path: str | None = None
    resize: int = 256
    crop: int = 224
    mean: tuple[float, ...] = (0.485, 0.456, 0.406)
    std: tuple[float, ...] = (0.229, 0.224, 0.225)
    num_workers: int = 0
    tokenizer: str | None = None
    seq_len: int = 128
    pack: bool = False
    prepend_bos: bool = False
    text_field: str = "text"
    label_field: str | None = None
    word_labels_field: str | None = None
    label_subtokens: str = "first"
    vocab_size: int | None = None


@dataclass(frozen=True)
class ProbeSpec:
    """probe.config.ProbeSpec parsed: frozen, checked, the layer selection in `where`. One named
    probe: which modules (globs over qualified names, class names) and what to keep."""

    where: Selector = Selector()
    capture: tuple[str, ...] = ("output",)
    reduce: str = "none"
    dtype: str = "float32"
    allow_empty: bool = False
    leaves_only: bool = False
    unedited: bool = False
    unit_axis: int | str = "auto"  # auto, or a nonzero axis
    rows: str = "samples"
    cam_grid: tuple[int, ...] | None = None
    cam_skip_tokens: int = 0
    sae: SaeSpec | None = None  # (the parse turns the config's folder or mapping into one)
    transcoders: str | None = None  # a transcoder set: its features (probe.hooks.transcoder_site)


@dataclass(frozen=True)
class EditSpec:
    """probe.config.EditSpec parsed: frozen, checked, the layer selection in `where`. One named
    intervention: modules selected like a probe, a site, an op and its arguments."""

    where: Selector = Selector()
    site: str = "output"
    op: str | None = None  # (None: the config left it `???`; the parse refuses that)
    factor: float = 1.0
    value: float = 0.0
    min: float | None = None
    max: float | None = None
    std: float = 0.0
    seed: int | None = None
    channels: tuple[int, ...] | None = None
    source: str | None = None
    _target_: str | None = None
    positions: tuple[int, ...] | None = None
    units: tuple[int, ...] | None = None
    heads: tuple[int, ...] | None = None
    direction: str = "denoise"
    vector: str | None = None
    plus: str | None = None
    minus: str | None = None
    layer: int | None = None
    feature: int | None = None
    transcoders: str | None = None


@dataclass(frozen=True)
class GridSpec:
    """probe.config.GridSpec parsed: frozen, checked, the layer selection in `where`. A patching
    grid: one patched forward per cell of layers x positions x heads."""

    where: Selector = Selector(layers=("@blocks",))
    site: str = "output"
    over: tuple[str, ...] = ("layer", "position")
    positions: str | tuple[int, ...] = "all"
    heads: str | tuple[int, ...] = "all"
    source: str = "pair"
    direction: str = "denoise"
    stack: int | None = None
    method: str | tuple[str, ...] = "exact"


@dataclass(frozen=True)
class ObjectiveSpec:
    """probe.config.ObjectiveConfig parsed: frozen, checked. What a gradient run differentiates:
    one value per sample, summed over the batch. `index` of logit and logprob: a class number,
    `target` (the sample's label) or `predicted` (the model's argmax)."""

    name: str = "cross_entropy"
    index: int | str | None = None
    position: int | None = None
    _target_: str | None = None


@dataclass(frozen=True)
class AttributionSpec:
    """probe.config.AttributionConfig parsed: frozen, checked. Integrated gradients
    (`ig_output`): `steps` points between the baseline (zeros, the run's mean of the layer, or
    an earlier run's directory) and the activation, by `method`, in passes of at most
    `internal_batch_size` rows (None: the batch's own size)."""

    steps: int = 32
    baseline: str = "zeros"
    method: str = "riemann_trapezoid"
    internal_batch_size: int | None = None


@dataclass(frozen=True)
class LensSpec:
    """probe.config.LensConfig parsed: frozen, checked. Reading the residual stream of a language
    model (probe.attribute.lens, .dla): none, logit (the final norm and unembedding at each of
    `layers`), tuned (with the translators of `path` first) or dla (direct logit attribution of
    every component at the answer position)."""

    name: str = "none"
    layers: tuple[str, ...] = ("@blocks",)
    path: str | None = None
    position: int | None = None
    tokens: tuple[int, ...] | None = None
    samples: int = 4
    topk: int = 5
    positions: str = "all"


@dataclass(frozen=True)
class StoreSpec:
    """probe.config.StoreConfig parsed: frozen, checked. How captures are kept: `full` writes
    tensors, `stats` only streaming statistics."""

    mode: str = "full"
    compression: str = "none"
    compression_level: int | None = None
    chunk_bytes: int = 1 << 20
    queue_batches: int = 2
    filename: str = "probe.h5"
    model_output: str = "auto"
    flush_seconds: float | None = None
    direct_io: bool = True


@dataclass(frozen=True)
class StatsSpec:
    """probe.config.StatsConfig parsed: frozen, checked. How statistics are computed: `backend`
    auto, torch (the reference, on the capture's device) or numba (a compiled CPU accelerator,
    the `fast` extra); see probe.stats.backend."""

    backend: str = "auto"
    during: str = "run"
    topk: int = 0
    bottomk: int = 0
    topk_quantiles: int = 0


@dataclass(frozen=True)
class CircuitSpec:
    """probe.config.CircuitConfig parsed: frozen, checked. Edge scores and circuits over
    dataset=pairs (probe.circuits, docs/circuits.md): `method` a list of eap, eap_ig_inputs,
    eap_ig_activations, exact, or one of them alone (empty: no circuit); the ablation (counterfactual, mean over the
    run's pairs or `mean_source` an earlier run's directory, zero); circuits of `sizes` percent
    of the edges cut by `select` (topn, greedy) on absolute or signed scores and evaluated for
    faithfulness (sizes empty: none); `metric` at `position` as the patching metrics are
    named."""

    method: str | tuple[str, ...] = ()
    steps: int = 5
    ablation: str = "counterfactual"
    mean_source: str | None = None
    sizes: tuple[float, ...] = (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50)
    select: str = "topn"
    absolute: bool = True
    max_exact: int | None = 10000
    metric: str = "logit_diff"
    position: int | None = None


@dataclass(frozen=True)
class GraphSpec:
    """probe.config.GraphConfig parsed: frozen, checked. Attribution graphs through transcoders
    (probe.graphs, docs/graphs.md), one per prompt of dataset=text|tokens, when `transcoders`
    names a transcoder set (None: off); the salient logits (`logit_prob`, `max_logits`), the
    features attributed (`max_feature_nodes`, None: all), pruning's thresholds, which edges
    graph_edges.csv holds (pruned, all), the attribution's `batch_size` and `floor` (None:
    its defaults), `zero_bos` and `update_interval` (GraphOptions'), and `prepend_bos`: a
    special token first in each prompt that does not start with one (prompt_tokens' rule);
    `examples` a run of the set's feature examples (probe.graphs.feature_files); `qk` and
    `qk_rows` the QK attribution's key positions (0: off) and rows per pair, `qk_sources` what
    each side is split into (position | nodes) (GraphOptions')."""

    transcoders: str | None = None
    logit_prob: float = 0.95
    max_logits: int = 10
    max_feature_nodes: int | None = None
    node_threshold: float = 0.8
    edge_threshold: float = 0.98
    edges: str = "pruned"
    batch_size: int | None = None
    floor: float | None = None
    zero_bos: bool = True
    update_interval: int = 4
    prepend_bos: bool = True
    examples: str | None = None
    qk: int = 0
    qk_rows: int | None = 20
    qk_sources: str = "position"

    @property
    def on(self) -> bool:
        """Whether the run computes graphs."""
        return bool(self.transcoders)


@dataclass(frozen=True)
class RunOptions:
    """probe.config.Config parsed: frozen, checked. The top-level keys that are no config group:
    seed, device, precision, train_mode, print_summary, progress, resume, overwrite,
    fail_on_nonfinite."""

    seed: int = 0
    device: str = "cpu"
    precision: str = "fp32"
    train_mode: bool = False
    print_summary: bool = True
    progress: bool = True
    resume: bool = False
    overwrite: bool = False
    fail_on_nonfinite: bool = False


@dataclass(frozen=True)
class InterventionSpec:
    """The intervene group: named edits (in config order), the metrics they are measured by and
    the token position they are read at, and a patching grid."""

    edits: FrozenDict[str, EditSpec] = FrozenDict()
    metrics: tuple[str, ...] = ()
    position: int | None = None
    grid: GridSpec | None = None

    @property
    def direction(self) -> str:
        """The direction of the run's patches and grid (probe.checks holds them to one): with
        denoise the run's own input is a pair's corrupt half (clean values are patched in), with
        noise (also when there are none) its clean half."""
        found = {e.direction for e in self.edits.values() if e.op == "patch"}
        if self.grid is not None:
            found.add(self.grid.direction)
        return found.pop() if found else "noise"


@dataclass(frozen=True)
class TrainSpec:
    """probe.config.TrainKeys parsed: frozen, checked. `python -m probe.train`'s training
    (probe.train.trainer turns it into a TrainSpec)."""

    optimizer: str = "sgd"
    lr: float = 0.1
    steps: int = 5
    momentum: float = 0.0
    weight_decay: float = 0.0
    fix_batch: bool = False
    seed: int = 0


@dataclass(frozen=True)
class WatchSpec:
    """probe.config.WatchKeys parsed: frozen, checked. `python -m probe.train`'s watch:
    probe.watch's `every` and `flush_every`."""

    every: int | str = 1  # an int >= 1 or "log"
    flush_every: int = 10
