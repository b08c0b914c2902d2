"""The one parse of a run's config: `parse(cfg)` turns the config Hydra composed (the command
line's, or the one `probe.run` composes from its keywords) into a RunPlan of frozen, typed
objects, and runs every check the config alone decides, once (probe.checks, probe.model_checks).
Nothing below this module reads the raw config: the builders, the writer, the loop and the finish
take these objects. What needs the model or torch is checked where the model is, on them.

The specs (probe.specs, named here too) are the frozen form of their schema dataclasses in
probe.config, field by field (ModelConfig -> ModelSpec, DatasetConfig -> DataSpec, ...): lists
become tuples, mappings read-only FrozenDicts (`plain` gives a library the dicts and lists it
takes), an unset `???` None. Probes, edits and the grid keep their layer selection (layers,
types, exclude, match) in one Selector, `where`.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields
from enum import Enum
from typing import TYPE_CHECKING, Any, TypeVar, cast

from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from probe import checks, model_checks
from probe import config as schema
from probe.errors import ConfigError
from probe.specs import (  # (named here too: callers import the specs from probe.plan)
    AttributionSpec,
    CircuitSpec,
    DataSpec,
    EditSpec,
    FrozenDict,
    GraphSpec,
    GridSpec,
    InterventionSpec,
    LensSpec,
    ModelSpec,
    ObjectiveSpec,
    ProbeSpec,
    RunOptions,
    SaeSpec,
    Selector,
    StatsSpec,
    StoreSpec,
    TrainSpec,
    WatchSpec,
)

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

SELECTOR_KEYS = ("layers", "types", "exclude", "match")
GROUPS = ("model", "dataset", "probes", "intervene", "objective", "attribution", "lens", "store",
          "stats", "circuit", "graph")  # fmt: skip
SAE_KEYS = ("path", "dense", "splice", "error_term", "max_active")
Spec = TypeVar("Spec", bound="DataclassInstance")


def frozen(value):
    """`value` with lists as tuples and mappings as FrozenDicts, all the way down; `???` None."""
    if isinstance(value, Mapping):
        return FrozenDict({k: frozen(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(frozen(v) for v in value)
    if isinstance(value, Enum):  # (the schema's Choices)
        return value.value
    return None if value == "???" else value


def plain(value):
    """The plain form of a plan value: dicts and lists all the way down, as a library's keyword
    arguments take them."""
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def _values(schema_cls: type, container: Mapping[str, Any]) -> dict[str, Any]:
    """The schema's fields found in `container` (a `+key` nothing reads is left out), frozen."""
    names = {f.name for f in fields(schema_cls)}
    return {k: frozen(v) for k, v in container.items() if k in names}


def _build(cls: type[Spec], schema_cls: type, container: Mapping[str, Any]) -> Spec:
    """`cls` (the spec of `schema_cls`) from a typed node's container."""
    values = _values(schema_cls, container)
    if any(f.name == "where" for f in fields(cls)):
        where = {k: values.pop(k) for k in SELECTOR_KEYS if k in values}
        values["where"] = Selector(**where)
    return cls(**values)


@dataclass(frozen=True)
class RunPlan:
    """Everything a run is told, parsed and checked. `text` is the config as parsed, resolved
    YAML (the file's `config` attribute); `unread` names the keys added with `+` that nothing
    reads; `in_hand` says the caller brings the model and the batches (probe.run)."""

    model: ModelSpec
    data: DataSpec
    probes: FrozenDict[str, ProbeSpec]  # name -> spec, in config order
    intervene: InterventionSpec
    objective: ObjectiveSpec
    attribution: AttributionSpec
    lens: LensSpec
    store: StoreSpec
    stats: StatsSpec
    options: RunOptions
    text: str = ""
    unread: tuple[str, ...] = ()
    in_hand: bool = False
    circuit: CircuitSpec = CircuitSpec(method=())  # (method empty: no circuit phase)
    graph: GraphSpec = GraphSpec()  # (transcoders unset: no attribution graphs)


def parse(cfg, *, in_hand: bool = False) -> RunPlan:
    """The RunPlan of composed config `cfg`, every check the config alone decides passed (a
    ProbeError or OmegaConf's error names the bad value). With `in_hand` the caller brings the
    model and the batches (probe.run): model.* and dataset.* describe them and are not checked
    as something to build."""
    raw_probes = _typed_probes(cfg.get("probes"))
    probes = FrozenDict({name: _probe(name, node) for name, node in raw_probes.items()})
    intervene = _interventions(cfg.get("intervene"))
    lens = _group(LensSpec, schema.LensConfig, cfg.lens)
    if lens.name == "tuned":
        OmegaConf.select(cfg, "lens.path", throw_on_missing=True)  # `???`: name it
    plan = RunPlan(
        model=_group(ModelSpec, schema.ModelConfig, cfg.model),
        data=_group(DataSpec, schema.DatasetConfig, cfg.dataset),
        probes=probes,
        intervene=intervene,
        objective=_group(ObjectiveSpec, schema.ObjectiveConfig, cfg.objective),
        attribution=_group(AttributionSpec, schema.AttributionConfig, cfg.attribution),
        lens=lens,
        store=_group(StoreSpec, schema.StoreConfig, cfg.store),
        stats=_group(StatsSpec, schema.StatsConfig, cfg.stats),
        circuit=_group(CircuitSpec, schema.CircuitConfig, cfg.circuit),
        graph=_group(GraphSpec, schema.GraphConfig, cfg.graph),
        options=_build(RunOptions, schema.Config, _container(cfg, GROUPS)),
        text=_text(cfg, raw_probes),
        unread=tuple(unread_keys(cfg)),
        in_hand=in_hand,
    )
    _check(plan)
    return plan


def model_spec(cfg) -> ModelSpec:
    """The ModelSpec of a config's `model` node alone (a run's stored config: what built the
    run's model, e.g. for `python -m probe.fit`'s loss measures)."""
    return _group(ModelSpec, schema.ModelConfig, cfg.model)


@dataclass(frozen=True)
class TrainingPlan:
    """Everything `python -m probe.train` is told (conf/train.yaml), parsed and checked: a run's
    model, dataset, objective (the loss) and probes (their sites the watch's: probe.train.watched_sites),
    how to train and how to watch."""

    model: ModelSpec
    data: DataSpec
    objective: ObjectiveSpec
    probes: FrozenDict[str, ProbeSpec]
    train: TrainSpec
    watch: WatchSpec
    device: str = "cpu"  # or cuda, cuda:N, auto (the GPU where there is one)
    overwrite: bool = False


def parse_training(cfg) -> TrainingPlan:
    """The TrainingPlan of a composed `python -m probe.train` config (the TrainConfig schema),
    every check the config alone decides passed; the same specs `parse` builds for a run."""
    plan = TrainingPlan(
        model=_group(ModelSpec, schema.ModelConfig, cfg.model),
        data=_group(DataSpec, schema.DatasetConfig, cfg.dataset),
        objective=_group(ObjectiveSpec, schema.ObjectiveConfig, cfg.objective),
        probes=probe_specs(cfg.get("probes"), run_sites=False),
        train=_group(TrainSpec, schema.TrainKeys, cfg.train),
        watch=_group(WatchSpec, schema.WatchKeys, cfg.watch),
        device=str(cfg.device),
        overwrite=bool(cfg.overwrite),
    )
    checks.check_seed("train.seed", plan.train.seed)
    checks.check_device(plan.device)
    model_checks.check_model(plan.model)
    checks.check_data(plan.data)
    m = plan.model
    checks.check_objective(
        plan.objective, m.num_classes if m.library in ("torchvision", "timm") else None
    )
    checks.check_training(plan.train, plan.watch, plan.probes)
    return plan


def _check(plan: RunPlan) -> None:
    """Every check of the config, once, in the order a reader meets the keys."""
    checks.check_seed("seed", plan.options.seed)
    if not plan.in_hand:
        model_checks.check_model(plan.model)
        checks.check_data(plan.data)
    checks.check_run_options(plan.options, plan.store, plan.stats)
    checks.check_interventions(plan.intervene)
    if checks.wants_gradients(plan.probes, plan.intervene.edits):
        m = plan.model
        checks.check_objective(
            plan.objective, m.num_classes if m.library in ("torchvision", "timm") else None
        )
    if any("ig_output" in p.capture for p in plan.probes.values()):
        checks.check_attribution(plan.attribution)
    checks.check_lens(plan.lens)
    checks.check_circuit(plan.circuit, plan.options)
    checks.check_graphs(plan.graph, plan.model, plan.data, plan.options)


def _container(node: DictConfig, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    values = cast("dict[str, Any]", OmegaConf.to_container(node, resolve=True, enum_to_str=True))
    return {k: v for k, v in values.items() if k not in skip}


def _group(cls: type[Spec], schema_cls: type, node: DictConfig) -> Spec:
    return _build(cls, schema_cls, _container(node))


# -- probes --------------------------------------------------------------------------------------
def probe_specs(probes, *, run_sites: bool = True) -> FrozenDict[str, ProbeSpec]:
    """Probes typed and checked, name -> ProbeSpec. `probes` is a mapping name -> spec (a probe
    file's content, the composed config's probes, a plan's probes) or the name of a shipped
    probe file. `run_sites=False` leaves the capture sites to the caller (a watched training
    has sites of its own: probe.train.watched_sites)."""
    if isinstance(probes, Mapping) and all(isinstance(p, ProbeSpec) for p in probes.values()):
        return FrozenDict(probes)  # (parsed already)
    return FrozenDict(
        {name: _probe(name, node, run_sites) for name, node in _typed_probes(probes).items()}
    )


def spec_config(spec: ProbeSpec | EditSpec | GridSpec) -> dict[str, Any]:
    """A parsed ProbeSpec (or EditSpec, GridSpec) as a probe file writes it: plain values, the
    layer selection's keys at the top level."""
    out = {}
    for f in fields(spec):
        value = getattr(spec, f.name)
        if isinstance(value, Selector | SaeSpec):
            value = dataclasses.asdict(value)
            if f.name == "where":
                out.update(plain(value))
                continue
        out[f.name] = plain(value)
    return out


def _typed_probes(probes) -> dict[str, DictConfig]:
    """Each probe merged onto the ProbeSpec schema: a misspelt key is a ConfigError naming it and
    ProbeSpec's keys (one added on the command line composes untyped)."""
    if probes is None:
        return {}
    if isinstance(probes, str):
        from probe.shipped import shipped_probes

        probes = shipped_probes(probes)
    if not hasattr(probes, "items"):
        raise ConfigError(
            f"probes is a {type(probes).__name__}; give a mapping name -> spec, such as "
            "{'convs': {'types': ['Conv2d']}}, or a shipped probe file's name"
        )
    for name, node in probes.items():  # `+probes.head.layers=fc` composes a string, not a list
        for key, value in node.items() if isinstance(node, DictConfig) else ():
            if key in ("layers", "types", "exclude", "capture") and isinstance(value, str):
                raise ConfigError(
                    f"probe {name!r}: {key}={value!r} is not a list; write it in brackets: "
                    f"probes.{name}.{key}=[{value}]"
                )
    return {
        str(name): typed(schema.ProbeSpec, node, f"probe {name!r}") for name, node in probes.items()
    }


def _probe(name: str, node: DictConfig, run_sites: bool = True) -> ProbeSpec:
    spec = _build(ProbeSpec, schema.ProbeSpec, _container(node))
    checks.check_probe(name, spec, sites=run_sites)
    return dataclasses.replace(spec, sae=sae_spec(spec.sae, name))


def sae_spec(value, probe: str) -> SaeSpec | None:
    """A probe's `sae`: a folder, or {path, dense, splice, error_term, max_active}."""
    if value is None or isinstance(value, SaeSpec):
        return value
    if isinstance(value, str):
        return SaeSpec(value)
    value = plain(value)
    unknown = sorted(set(value) - set(SAE_KEYS))
    if unknown or "path" not in value:
        raise ConfigError(
            f"probe {probe!r}: sae={value} needs path and takes only {', '.join(SAE_KEYS)}"
            + (f" (not {', '.join(unknown)})" if unknown else "")
        )
    slots = value.get("max_active", 0)
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 0:
        raise ConfigError(
            f"probe {probe!r}: sae.max_active={slots!r} is not a whole number >= 0 (the active "
            "latents kept a row; 0: the SAE's k, or 128)"
        )
    dense, splice, error_term = (bool(value.get(k, False)) for k in SAE_KEYS[1:4])
    return SaeSpec(str(value["path"]), dense, splice, error_term, max_active=slots)


# -- the intervene group -------------------------------------------------------------------------
def edit_specs(edits) -> FrozenDict[str, EditSpec]:
    """Named edits (a mapping name -> edit spec, as the intervene group holds them beside its
    own keys), each typed as an EditSpec; the intervene group's checks run on them in the parse
    (probe.checks.check_edit), and here for a caller's own mapping (probe.watch's edits)."""
    out = {}
    for name, edit in (edits or {}).items():
        if name in schema.INTERVENE_KEYS:
            continue
        typed_edit = typed(schema.EditSpec, edit, f"intervene {name!r}")
        OmegaConf.select(typed_edit, "op", throw_on_missing=True)  # `???`: name it
        out[str(name)] = _build(EditSpec, schema.EditSpec, _container(typed_edit))
    return FrozenDict(out)


def checked_edits(edits) -> FrozenDict[str, EditSpec]:
    """`edit_specs`, each edit checked as the parse checks the intervene group's (a caller's
    own mapping: probe.watch's edits)."""
    specs = edit_specs(edits)
    for name, spec in specs.items():
        checks.check_edit(name, spec)
    return specs


def _interventions(node) -> InterventionSpec:
    """The named edits (each typed as an EditSpec) and the group's own keys."""
    node = node or {}
    edits = edit_specs(node)
    grid = node.get("grid")
    if grid is not None:
        grid = _build(
            GridSpec, schema.GridSpec, _container(typed(schema.GridSpec, grid, "intervene.grid"))
        )
    metrics, position = node.get("metrics"), node.get("position")
    if OmegaConf.is_config(metrics):
        metrics = OmegaConf.to_container(metrics, resolve=True)
    return InterventionSpec(edits, frozen(list(metrics or [])), position, grid)


def typed(schema_cls, node, label: str, *updates):
    """`node` (then `updates`) merged onto the structured `schema_cls`: a misspelt key or a wrong
    type or value becomes a ConfigError naming `label`, the key and the schema's keys."""
    try:
        return OmegaConf.merge(OmegaConf.structured(schema_cls), node, *updates)
    except OmegaConfBaseException as e:
        keys = [f.name for f in fields(schema_cls)]
        first = str(e).splitlines()[0]
        if getattr(e, "full_key", None):
            first = f"{e.full_key}: {first}"
        if isinstance(e, ConfigKeyError) and e.key is not None:
            close = difflib.get_close_matches(str(e.key), keys, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            first = f"key {e.key!r} is not a key of {schema_cls.__name__}{hint}"
        raise ConfigError(
            f"{label}: {first}; {schema_cls.__name__}'s keys: {', '.join(keys)}"
        ) from None


# -- what the file records -----------------------------------------------------------------------
def _text(cfg, probes: dict[str, DictConfig]) -> str:
    """The config as the file's `config` attribute holds it: resolved YAML, each probe in its
    typed form (ProbeSpec's defaults written out for one added on the command line)."""
    cfg = copy.deepcopy(cfg)
    if cfg.get("probes") is not None:
        untyped = [
            n for n in probes if OmegaConf.get_type(cfg.probes._get_node(n)) is not schema.ProbeSpec
        ]
        if untyped:
            with read_write(cfg.probes), open_dict(cfg.probes):
                for name in untyped:
                    cfg.probes[name] = probes[name]
    return OmegaConf.to_yaml(cfg, resolve=True)


def config_values(text: str) -> dict[str, Any]:
    """The values of a config's YAML text (the file's `config` attribute, a plan's `text`), as
    OmegaConf reads it."""
    return cast("dict[str, Any]", OmegaConf.to_container(OmegaConf.create(text)))


def unread_keys(cfg) -> list[str]:
    """A message per key of `cfg` that the schema (probe.config.Config) does not have: Hydra's
    `+key=` adds any key, even a misspelt one, which nothing would read. Dict-typed fields
    (model.kwargs, model.config, probes and intervene, typed elsewhere) are free-form and not
    looked into."""
    return list(_unread(cfg, schema.Config, ""))


def _unread(node, schema_cls, prefix: str):
    hints = typing.get_type_hints(schema_cls)
    for key in node:
        if not prefix and key == "hydra":
            continue
        path = f"{prefix}{key}"
        if key not in hints:
            close = difflib.get_close_matches(str(key), list(hints), n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            yield f"{path} is not a key probe reads{hint}; it has no effect"
            continue
        child = node._get_node(key)
        nested = isinstance(child, DictConfig) and not child._is_missing() and not child._is_none()
        if nested and dataclasses.is_dataclass(hints[key]):
            yield from _unread(child, hints[key], f"{path}.")
