"""The one parse: every check of the config runs once, in probe.plan.parse, for the command
line and for probe.run alike; the plan is frozen; the command line and the Python API give equal
plans for the same settings; nothing below the parse reads the raw config."""

from __future__ import annotations

import dataclasses
import logging
import re
import sys
from pathlib import Path

import pytest
import torch

import probe
from probe import checks, model_checks, specs
from probe import config as schema
from probe import plan as plans
from probe.__main__ import main
from probe.data.user_batches import UserBatches
from probe.launch.api import run_plan
from probe.plan import GROUPS, SELECTOR_KEYS, FrozenDict, RunPlan, frozen, parse, plain
from probe.testing.compose import QUIET, make_cfg
from probe.testing.models import TinyNet

PACKAGE = Path(probe.__file__).parent
TINYNET = ["model=custom", "model._target_=probe.testing.models.TinyNet",
           "model.input_shape=[3,8,8]", "model.num_classes=10", "dataset.num_samples=4",
           "dataset.batch_size=2", "probes=everything"]  # fmt: skip
# each runs once per parse, whatever the config holds
ONCE = {
    checks: ("check_seed", "check_data", "check_run_options", "check_interventions", "check_lens"),
    model_checks: ("check_model",),
}


@pytest.fixture
def counted(monkeypatch):
    """Calls of the checks in ONCE, by name."""
    calls: dict[str, int] = {}
    for module, names in ONCE.items():
        for name in names:
            real = getattr(module, name)

            def counting(*args, _real=real, _name=name, **kwargs):
                calls[_name] = calls.get(_name, 0) + 1
                return _real(*args, **kwargs)

            monkeypatch.setattr(module, name, counting)
    return calls


def test_the_command_line_runs_every_check_once(tmp_path, monkeypatch, counted):
    monkeypatch.setattr(sys, "argv", ["probe", *QUIET, *TINYNET, f"hydra.run.dir={tmp_path}"])
    try:
        main()
    finally:  # Hydra's handlers write to this test's captured streams: drop them
        for handler in logging.root.handlers[:]:
            logging.root.removeHandler(handler)
            handler.close()
    assert (tmp_path / "probe.h5").is_file()
    assert counted == dict.fromkeys([n for names in ONCE.values() for n in names], 1)


def test_the_python_api_runs_the_same_checks_once(tmp_path, counted):
    data = [torch.randn(2, 3, 8, 8) for _ in range(2)]
    probe.run(TinyNet(), data, "everything", out=tmp_path, progress=False).close()
    # (the caller's model and data are no config to check: in_hand)
    assert counted == {n: 1 for n in ONCE[checks] if n != "check_data"}


def test_only_the_parse_imports_the_checks_and_reads_the_raw_config():
    """The builders, the writer, the loop and the finish take plan objects: no module but
    probe.plan imports the checks, and DictConfig is named only where the config is composed
    and parsed (and where a finished run's stored config is read back)."""
    composing = {"config.py", "plan.py", "shipped.py", "__main__.py", "train/__main__.py", "launch/api.py",
                 "hooks/site_table.py", "read/runs.py"}  # fmt: skip
    for path in PACKAGE.rglob("*.py"):
        name = path.relative_to(PACKAGE).as_posix()
        text = path.read_text()
        if name not in ("plan.py", "model_checks.py"):
            assert not re.search(r"^\s*from probe(\.| import )(model_)?checks", text, re.M), name
        if name not in composing and not name.startswith("testing/"):  # (tests compose)
            assert "DictConfig" not in text, name


def test_the_plan_is_frozen_and_typed():
    plan = parse(make_cfg(*TINYNET, "+model.kwargs.width=[4,8]", "intervene=zero_layer4"))
    assert isinstance(plan, RunPlan)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.options.seed = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.probes["everything"].where.layers = ("conv",)
    for mapping in (plan.probes, plan.model.kwargs, plan.intervene.edits):
        assert isinstance(mapping, FrozenDict)
        with pytest.raises(TypeError, match="read-only"):
            mapping["x"] = 1
    assert plan.model.kwargs["width"] == (4, 8) and plain(plan.model.kwargs) == {"width": [4, 8]}
    edit = plan.intervene.edits["zero_layer4"]  # the layer selection, shared by edits and probes
    assert type(edit.where) is type(plan.probes["everything"].where)
    assert (edit.where.layers, edit.op, edit.where.match) == (("layer4",), "zero", "all")
    assert (plan.store.mode, plan.stats.during, plan.options.precision) == ("full", "run", "fp32")
    assert type(plan.store.mode) is str  # the schema's Choices as their plain names


@pytest.mark.parametrize(
    ("cli_args", "api_probes"),
    [
        (["probes=all_convs"], "all_convs"),
        (
            ["probes=none", "+probes.head={layers: [fc], dtype: float16}"],
            {"head": {"layers": ["fc"], "dtype": "float16"}},
        ),
    ],  # fmt: skip
    ids=["shipped", "mapping"],
)
def test_the_cli_and_the_api_give_equal_plans(cli_args, api_probes):
    cli_plan = parse(make_cfg(
        *cli_args, "store=stats", "stats.topk=2", "objective=logit", "objective.index=1",
        "intervene=zero_layer4", "seed=3", "precision=bf16", "lens=none",
    ))  # fmt: skip
    batches = UserBatches([torch.randn(2, 3, 8, 8)])
    api_plan = run_plan(
        TinyNet(), batches, api_probes, store="stats", stats={"topk": 2},
        objective={"name": "logit", "index": 1}, intervene="zero_layer4", seed=3,
        precision="bf16", device="cpu", progress=False, print_summary=False,
    )  # fmt: skip
    for part in ("probes", "intervene", "objective", "attribution", "lens", "store", "stats",
                 "options"):  # fmt: skip
        assert getattr(api_plan, part) == getattr(cli_plan, part), part
    assert api_plan.in_hand and not cli_plan.in_hand  # (the model and the data are the caller's)


def test_the_config_text_is_the_composed_config_with_added_probes_typed():
    """`text` (the file's `config` attribute) is the composed config resolved, a probe added on
    the command line written out with ProbeSpec's defaults."""
    from omegaconf import OmegaConf

    from probe.config import ProbeSpec

    cfg = make_cfg(*TINYNET, "+probes.head.layers=[fc]")
    expected = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    expected["probes"]["head"] = dataclasses.asdict(ProbeSpec(layers=["fc"]))
    assert OmegaConf.to_container(OmegaConf.create(parse(cfg).text)) == expected


# each spec of probe.specs, the schema dataclass in probe.config it is the frozen form of, and
# the schema's fields the parse leaves out of it (RunOptions: Config less its groups)
MIRRORS = [
    (specs.ModelSpec, schema.ModelConfig, ()),
    (specs.DataSpec, schema.DatasetConfig, ()),
    (specs.ProbeSpec, schema.ProbeSpec, ()),
    (specs.EditSpec, schema.EditSpec, ()),
    (specs.GridSpec, schema.GridSpec, ()),
    (specs.ObjectiveSpec, schema.ObjectiveConfig, ()),
    (specs.AttributionSpec, schema.AttributionConfig, ()),
    (specs.LensSpec, schema.LensConfig, ()),
    (specs.StoreSpec, schema.StoreConfig, ()),
    (specs.StatsSpec, schema.StatsConfig, ()),
    (specs.CircuitSpec, schema.CircuitConfig, ()),
    (specs.GraphSpec, schema.GraphConfig, ()),
    (specs.RunOptions, schema.Config, GROUPS),
    (specs.TrainSpec, schema.TrainKeys, ()),
    (specs.WatchSpec, schema.WatchKeys, ()),
]
NOT_MIRRORS = {specs.Selector, specs.SaeSpec, specs.InterventionSpec}  # (the parse's own)


def _schema_default(f: dataclasses.Field):
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


@pytest.mark.parametrize(("spec", "config", "skip"), MIRRORS, ids=[m[0].__name__ for m in MIRRORS])
def test_each_spec_has_its_schemas_fields_in_order_with_their_defaults(spec, config, skip):
    """The spec written out in probe.specs and its schema cannot drift: the same names in the
    same order (a probe's, an edit's and the grid's selector keys gathered into `where`, first),
    each default the schema's frozen (a list a tuple, `???` None, a Choice its name)."""
    expected, where = {}, {}
    has_where = "where" in {f.name for f in dataclasses.fields(spec)}
    for f in dataclasses.fields(config):
        if f.name in skip:
            continue
        value = frozen(_schema_default(f))
        if has_where and f.name in SELECTOR_KEYS:
            where[f.name] = value
        else:
            expected[f.name] = value
    if has_where:
        expected = {"where": specs.Selector(**where), **expected}
    got = {f.name: f.default for f in dataclasses.fields(spec)}
    assert list(got) == list(expected)
    assert repr(got) == repr(expected)  # (the values and their types: 1 and 1.0 apart)


def test_every_spec_of_the_plan_is_held_to_its_schema():
    written = {
        cls
        for cls in vars(specs).values()
        if isinstance(cls, type)
        and dataclasses.is_dataclass(cls)
        and cls.__module__ == specs.__name__
    }
    assert written - NOT_MIRRORS == {m[0] for m in MIRRORS}
    for spec, _, _ in MIRRORS:  # frozen, and named from probe.plan as before
        assert spec.__dataclass_params__.frozen and getattr(plans, spec.__name__) is spec
