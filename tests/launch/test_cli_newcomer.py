"""What a new user meets first: a probe added on the command line, config mistakes reported at
once (and no empty run folder), keys nothing reads, checkpoint prefixes, synthetic targets of a
custom model, and --help. Real Hydra composition and the real CLI in a subprocess."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import warnings

import h5py
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from probe import checks
from probe import plan as plans
from probe.config import ProbeSpec
from probe.data.batches import SyntheticImages, build_batches
from probe.errors import CheckpointError, ProbeError
from probe.hooks.module_select import select_modules
from probe.models.build import build_model, key_prefix
from probe.plan import parse, unread_keys
from probe.testing.compose import make_cfg
from tests.helpers import ROOT, cli

TINY = ["model=resnet18", "dataset.image_size=32", "dataset.num_samples=4", "dataset.batch_size=2"]
TINYNET = [
    "model=custom",
    "model._target_=probe.testing.models.TinyNet",
    "model.input_shape=[3,8,8]",
    "dataset.num_samples=4",
    "dataset.batch_size=2",
]
GRADS = "probes=grads_all_convs"


def _inputs(n: int = 4, shape=(3, 32, 32)) -> torch.Tensor:
    data = SyntheticImages(n, shape, 1000, seed=0)
    return torch.stack([data[i][0] for i in range(n)])


# -- 1. a new probe from the command line --------------------------------------------------------
@pytest.mark.parametrize(
    "args",
    [
        ["+probes.head.layers=[fc]"],
        ["probes=none", "+probes.head={layers: [fc], capture: [output]}"],
    ],
    ids=["key", "dict"],
)
def test_a_probe_added_on_the_command_line_stores_the_layer(tmp_path, args):
    out = cli(*TINY, *args, f"hydra.run.dir={tmp_path}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    net = build_model(parse(make_cfg(*TINY)).model, 0)
    with torch.no_grad():
        expected = net(_inputs()).numpy()  # fc is resnet's last layer: its output is the model's
    with h5py.File(tmp_path / "probe.h5") as f:
        np.testing.assert_allclose(f["layers/fc/output"][:], expected, rtol=1e-5, atol=1e-5)
        assert f["layers/fc/output"].dtype == np.float32  # ProbeSpec's default dtype
        assert ("layers/conv1" in f) == (args[0] != "probes=none")  # beside the default probe


def test_an_added_probe_is_typed_with_probespec_defaults_before_select():
    cfg = make_cfg("probes=none", "+probes.head={layers: [fc], capture: [output]}")
    assert OmegaConf.get_type(cfg.probes.head) is dict  # OmegaConf composes it untyped
    plan = parse(cfg)
    head = plan.probes["head"]
    assert isinstance(head, plans.ProbeSpec)
    assert head.reduce == "none" and head.where.types == ()
    assert "reduce: none" in plan.text.split("head:")[1]  # the file's config holds it typed
    (sel,) = select_modules(build_model(plan.model, 0), plan.probes)
    assert (sel.name, sel.sites, sel.reduce, sel.rows) == ("fc", ("output",), "none", "samples")


def test_shipped_probe_files_and_their_overrides_stay_typed_at_compose_time():
    cfg = make_cfg("probes=all_convs", "probes.convs.layers=[layer4.*]")
    assert OmegaConf.get_type(cfg.probes.convs) is ProbeSpec
    assert list(cfg.probes.convs.layers) == ["layer4.*"] and cfg.probes.convs.dtype == "float32"
    everything = make_cfg("probes=everything").probes.everything
    assert OmegaConf.get_type(everything) is ProbeSpec and everything.dtype == "float16"


def test_a_misspelt_key_of_a_new_probe_names_it_and_probespec_keys(tmp_path):
    out = cli(*TINY, "+probes.head.layrs=[fc]", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert (
        "probe 'head': key 'layrs' is not a key of ProbeSpec (did you mean layers?)" in out.stderr
    )
    assert "ProbeSpec's keys: layers, types, exclude, capture, reduce" in out.stderr
    assert not (tmp_path / "run").exists()


# -- 2. config errors before any heavy work, no empty run folder ----------------------------------
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["dataset=imagefolder"], "dataset=imagefolder needs dataset.root=DIR"),
        (["objective=logit", GRADS], "objective=logit needs the class to explain"),
        (["store.filename=../x.h5"], "store.filename='../x.h5' is outside the run directory"),
        (
            ["dataset=tensors", "dataset.path=/nonexistent.pt"],
            "dataset.path='/nonexistent.pt' does not",
        ),
        (["device=gpu"], "device='gpu' is not a torch device"),
        (["probes.convs.capture=[outptu]"], "probe 'convs': capture site 'outptu' is unknown"),
    ],
    ids=["root", "logit", "store", "path", "device", "site"],  # store: a check across values
)
def test_a_config_error_comes_before_torch_and_leaves_no_run_folder(tmp_path, args, message):
    run_dir = tmp_path / "run"
    out = cli(*TINY, *args, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"probe: error: {message}" in out.stderr
    assert not run_dir.exists()


def test_no_torch_import_and_no_outputs_folder_with_the_default_run_dir(tmp_path):
    out = cli(*TINY, "dataset=imagefolder", cwd=tmp_path, env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert out.returncode == 2
    assert "dataset=imagefolder needs dataset.root=DIR" in out.stderr
    assert re.search(r"\|\s+probe\.checks$", out.stderr, re.M)  # profiled; torch is not in it
    assert not re.search(r"\|\s+torch$", out.stderr, re.M)
    assert list(tmp_path.iterdir()) == []  # outputs/<date>/<time> and its empty parents are gone


def test_an_existing_run_folder_is_kept(tmp_path):
    run_dir = tmp_path / "mine"
    run_dir.mkdir()
    out = cli(*TINY, "dataset=imagefolder", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert out.returncode == 2 and run_dir.is_dir()


EDIT = ["intervene=edit", "intervene.edit.layers=[conv1]"]
MISTAKES = {
    "batch_size": (["dataset.batch_size=0"], "dataset.batch_size=0 must be at least 1"),
    "num_samples": (["dataset.num_samples=0"], "dataset.num_samples=0 must be at least 1 (or"),
    "name": (["dataset.name=imagenet"], "unknown dataset 'imagenet'; choose one of synthetic"),
    "channels": (["dataset.channels=0"], "dataset.channels=0 must be at least 1 (or null for"),
    "root": (["dataset=imagefolder"], "dataset=imagefolder needs dataset.root=DIR"),
    "no-root": (
        ["dataset=imagefolder", "dataset.root=/nonexistent"],
        "dataset.root='/nonexistent' is not a directory",
    ),
    "path": (["dataset=tensors"], "dataset=tensors needs dataset.path=FILE (a .pt file of"),
    "no-path": (
        ["dataset=tensors", "dataset.path=/nonexistent.pt"],
        "dataset.path='/nonexistent.pt' does not exist; give a .pt file of inputs",
    ),
    "dir-path": (
        ["dataset=tensors", "dataset.path=/"],
        "dataset.path='/' is a directory; give a .pt file of inputs",
    ),
    "library": (["model.library=jax"], "model.library='jax' is not one of torchvision, hf"),
    "target": (["model=custom"], "model._target_ is missing; name what to import"),
    "checkpoint": (
        ["model.checkpoint=/nonexistent.pt"],
        "model.checkpoint='/nonexistent.pt' does not exist",
    ),
    "device": (["device=cuda:x"], "device='cuda:x' is not a torch device"),
    "site": (["probes.convs.capture=[outptu]"], "probe 'convs': capture site 'outptu' is unknown"),
    "reduce": (["probes.convs.reduce=mean"], "probe 'convs': reduce='mean' is unknown"),
    "tokens": (
        ["probes.convs.rows=tokens", "probes.convs.reduce=spatial_mean"],
        "rows: tokens keeps every token, so it takes reduce: none, not 'spatial_mean'",
    ),
    "unit_axis": (["probes.convs.unit_axis=0"], "unit_axis=0 is neither auto nor a nonzero axis"),
    "match": (["probes.convs.match=some"], "probe 'convs': match='some' is unknown"),
    "objective": (["objective.name=nope", GRADS], "unknown objective 'nope'"),
    "logit": (["objective=logit", GRADS], "objective=logit needs the class to explain"),
    "logit-range": (
        ["objective=logit", "objective.index=1000", GRADS],
        "objective.index=1000 is out of range for a model output of 1000 logits",
    ),
    "custom": (["objective=custom", GRADS], "objective._target_ is missing"),
    "op": ([*EDIT, "intervene.edit.op=explode"], "intervene 'edit': op='explode' is unknown"),
    "edit-site": (
        [*EDIT, "intervene.edit.op=zero", "intervene.edit.site=weights"],
        "intervene 'edit': site='weights' is unknown",
    ),
    "clamp": ([*EDIT, "intervene.edit.op=clamp"], "op=clamp needs min and/or max"),
    "noise": (
        [*EDIT, "intervene.edit.op=noise", "intervene.edit.std=-1"],
        "intervene 'edit': std=-1.0 must be >= 0",
    ),
    "mean": (
        [*EDIT, "intervene.edit.op=mean", "intervene.edit.source=/no/probe.h5"],
        "source='/no/probe.h5' is not a file",
    ),
    "mean-site": (
        [*EDIT, "intervene.edit.op=mean", "intervene.edit.site=grad_output"],
        "op=mean applies to input/output sites, not grad_output",
    ),
}


@pytest.mark.parametrize("case", sorted(MISTAKES))
def test_the_parse_names_each_config_mistake(case):
    """What the config alone decides is refused by probe.plan.parse, before a model or the data
    is built (the builders take only parsed plans: tests/test_plan.py holds that they check
    nothing again)."""
    args, words = MISTAKES[case]
    with pytest.raises(ProbeError) as e:
        parse(make_cfg(*args))
    assert words in str(e.value)


def test_every_precision_of_the_schema_has_a_torch_dtype():
    """The schema's Choice names the precisions; probe.hooks.device maps each to torch's dtype."""
    from probe import choices
    from probe.hooks import device

    assert tuple(device.PRECISIONS) == choices.PRECISIONS


def test_the_early_device_pattern_is_what_torch_parses():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that mkldnn is deprecated
        for name in [*checks.DEVICE_TYPES, "cuda:0", "cpu:1"]:
            torch.device(name)
            assert checks.DEVICE.match(name)
    for name in ("gpu", "cuda:x", "cuda:-1", "cuda:01", "CUDA"):
        assert not checks.DEVICE.match(name)


def test_every_shipped_config_passes_the_early_checks():
    for group, option in [("model", "lenet"), ("dataset", "fakedata"), ("intervene", "patch_grid"),
                          ("probes", "residual"), ("store", "stats"), ("model", "gpt2")]:  # fmt: skip
        parse(make_cfg(f"{group}={option}"))
    parse(make_cfg(GRADS, "objective=logit", "objective.index=3"))


# -- 3. keys nothing reads ------------------------------------------------------------------------
def test_a_key_nothing_reads_is_named_with_the_close_one(tmp_path):
    """Hydra's hint for a misspelt key (+key=) adds it; the run warns and takes the default. The
    custom TinyNet (10 outputs) also gets the synthetic-targets warning of item 5."""
    out = cli(*TINYNET, "probes=all_linear", "+dataset.num_sample=8", f"hydra.run.dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    words = "dataset.num_sample is not a key probe reads (did you mean dataset.num_samples?)"
    assert words in out.stdout and words in (tmp_path / "probe.log").read_text()  # Hydra's console
    assert "[probe][WARNING]" in out.stdout.split(words)[0].splitlines()[-1]
    with h5py.File(tmp_path / "probe.h5") as f:
        assert f.attrs["num_samples"] == 4  # dataset.num_samples, untouched
    assert "'fc' has 10 outputs: set model.num_classes=10" in out.stdout


def test_free_form_keys_are_not_reported():
    cfg = make_cfg(
        "model=custom",
        "model._target_=probe.models.zoo.LeNet",
        "+model.kwargs.width=64",
        "+model.config.n_layer=2",
        "+intervene.mine.op=zero",
        "+probes.head.layers=[fc]",
        "+sed=1",
        "+stats.backendd=torch",
    )
    assert unread_keys(cfg) == [
        "stats.backendd is not a key probe reads (did you mean stats.backend?); it has no effect",
        "sed is not a key probe reads (did you mean seed?); it has no effect",
    ]


# -- 4. checkpoints: logged, and a wrapper's prefix -----------------------------------------------
def _prefixed(tmp_path, prefix: str):
    torch.manual_seed(123)  # weights unlike the run's seeded init
    import torchvision

    original = torchvision.models.resnet18()
    path = tmp_path / f"{prefix.strip('.') or 'plain'}.pt"
    torch.save({f"{prefix}{k}": v for k, v in original.state_dict().items()}, path)
    return original.eval(), path


def test_a_prefixed_checkpoint_names_the_prefix_and_loads_with_it(tmp_path):
    original, path = _prefixed(tmp_path, "model.")  # Lightning's
    out = cli(*TINY, f"model.checkpoint={path}", f"hydra.run.dir={tmp_path / 'bad'}", cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "every key carries the prefix 'model.'" in out.stderr
    assert "model.checkpoint_prefix=model." in out.stderr
    assert not (tmp_path / "bad").exists()
    run_dir = tmp_path / "run"
    out = cli(
        *TINY,
        "probes=none",
        "+probes.head.layers=[fc]",
        f"model.checkpoint={path}",
        "model.checkpoint_prefix=model.",
        "device=auto",
        f"hydra.run.dir={run_dir}",
    )
    assert out.returncode == 0, out.stderr
    log = (run_dir / "probe.log").read_text()
    assert f"loaded checkpoint {path}: 122 tensors into ResNet" in log
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert f"device {device} (device=auto)" in log
    with torch.no_grad():
        expected = original(_inputs()).numpy()
    with h5py.File(run_dir / "probe.h5") as f:
        np.testing.assert_allclose(f["layers/fc/output"][:], expected, rtol=1e-4, atol=1e-4)


def test_checkpoint_prefix_loads_every_weight(tmp_path, caplog):
    original, path = _prefixed(tmp_path, "module.")  # DDP's
    plan = parse(make_cfg(f"model.checkpoint={path}", "model.checkpoint_prefix=module."))
    with caplog.at_level(logging.INFO, logger="probe"):
        model = build_model(plan.model, plan.options.seed)
    for k, v in original.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    assert f"loaded checkpoint {path}" in caplog.text
    with pytest.raises(CheckpointError, match=r"checkpoint_prefix='model\.': no key .* starts"):
        prefixed = make_cfg(f"model.checkpoint={path}", "model.checkpoint_prefix=model.")
        build_model(parse(prefixed).model, 0)


def test_key_prefix_finds_only_a_prefix_that_makes_the_keys_fit():
    wanted = ["conv.weight", "fc.bias"]
    assert key_prefix(["module._orig_mod.conv.weight", "module._orig_mod.fc.bias"], wanted) == (
        "module._orig_mod."
    )
    assert key_prefix(["model.conv.weight", "loss.fc.bias"], wanted) is None
    assert key_prefix(["model.conv.weight", "model.head.bias"], wanted) is None


# -- 5. synthetic targets of a custom model -------------------------------------------------------
def test_synthetic_targets_of_a_custom_model_warn_with_its_width(caplog):
    plan = parse(make_cfg(*TINYNET))
    model = build_model(plan.model, 0)  # TinyNet: 10 classes, model.num_classes left at 1000
    with caplog.at_level(logging.WARNING, logger="probe"):
        targets = torch.cat([b.targets for b in build_batches(plan.data, plan.model, 0, model)])
    assert int(targets.max()) >= 10  # what the warning is about
    assert "dataset=synthetic draws its targets below 1000 (model.num_classes)" in caplog.text
    assert "last Linear layer 'fc' has 10 outputs: set model.num_classes=10" in caplog.text
    caplog.clear()
    plan = parse(make_cfg(*TINYNET, "model.num_classes=10"))
    with caplog.at_level(logging.WARNING, logger="probe"):
        targets = torch.cat([b.targets for b in build_batches(plan.data, plan.model, 0, model)])
    assert int(targets.max()) < 10 and caplog.text == ""


# -- 6. --help and tab completion -----------------------------------------------------------------
def test_help_says_what_probe_is(tmp_path):
    out = cli("--help", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    for words in (
        "probe: declarative model probing for PyTorch",
        "python -m probe '+probes.head.layers=[fc]'",
        "python -m probe -m model=resnet18,vgg11",
        "python -m probe.sites model=resnet18",
        "python -m probe.summarize",
        "(or the `probe` command)",
        "probes: all_activations, all_convs",  # $APP_CONFIG_GROUPS
        "checkpoint_prefix: null",  # $CONFIG
        'eval "$(probe -sc install=bash)"',
    ):
        assert words in out.stdout, words
    assert list(tmp_path.iterdir()) == []


def test_tab_completion_names_the_keys(tmp_path):
    """What the script of `eval "$(probe -sc install=bash)"` asks the command for a word."""
    line = "probe dataset.num_s"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COMP_LINE": line, "COMP_POINT": str(len(line))}
    out = subprocess.run(
        [sys.executable, "-m", "probe", "-sc", "query=bash"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "dataset.num_samples=" in out.stdout.split()


# -- 7. runs that ask for no probe, and what the log says of statistics ---------------------------
@pytest.mark.parametrize(
    "extra", [["intervene=patch_grid"], ["lens=logit"]], ids=["patch_grid", "lens"]
)
def test_a_run_without_probes_warns_of_nothing_and_writes_no_summary(tmp_path, lm, caplog, extra):
    """The documented `probes=none intervene=patch_grid` and `probes=none lens=logit` commands:
    probes=none asks for no module, so nothing is missing; no statistics table of no layer."""
    import pandas as pd
    from transformers import AutoConfig

    from probe.launch.run import run

    model, path, _ = lm
    args = ["model=hf", f"model.name={model}", "model.task=causal_lm", "dataset=pairs",
            f"dataset.path={path}", "dataset.batch_size=2", "probes=none", *extra]  # fmt: skip
    with caplog.at_level(logging.INFO, logger="probe"):
        run(make_cfg(*args), run_dir=tmp_path)
    assert "no module selected" not in caplog.text
    assert "stats.during=none" not in caplog.text
    assert not (tmp_path / "summary.csv").exists()
    blocks = [f"transformer.h.{i}" for i in range(AutoConfig.from_pretrained(model).n_layer)]
    if extra == ["intervene=patch_grid"]:  # every block at each of the pairs' 6 positions
        table = pd.read_csv(tmp_path / "patching.csv")
        assert sorted(set(zip(table.layer, table.position, strict=True))) == [
            (b, p) for b in blocks for p in range(6)
        ]
    else:
        assert list(pd.read_csv(tmp_path / "lens.csv").layer) == blocks


@pytest.mark.parametrize("during", ["run", "none"])
def test_the_log_speaks_of_statistics_only_where_they_are_left_out(tmp_path, caplog, during):
    """The default run writes summary.csv, a row per conv, and says nothing of stats.during;
    stats.during=none says that it leaves them out, and writes none."""
    import pandas as pd
    import torchvision

    from probe.launch.run import run

    with caplog.at_level(logging.INFO, logger="probe"):
        run(make_cfg(*TINY, f"stats.during={during}"), run_dir=tmp_path)
    said = "stats.during=none: no statistics and no summary.csv" in caplog.text
    assert said == (during == "none")
    assert (tmp_path / "summary.csv").exists() == (during == "run")
    if during == "run":
        convs = [n for n, m in torchvision.models.resnet18().named_modules()
                 if isinstance(m, torch.nn.Conv2d)]  # fmt: skip
        assert list(pd.read_csv(tmp_path / "summary.csv").layer) == convs
