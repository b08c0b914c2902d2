"""`python -m probe.train` against mup's coordinate check: `mup.coord_check.get_coord_data`
(mup=False, SGD, 3 steps, the CPU) on MLPs of several widths gives per (width, module, t) the
`l1` that the watched training of the same models and batch stores as abs_mean at step t-1, in
process and through the CLI's multirun and `python -m probe.plot SWEEP coord`. Bad input is named,
exit 2."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir

from probe.config import config_dir
from probe.errors import ConfigError
from probe.plan import parse_training
from probe.train.trainer import train
from tests.helpers import ROOT

coord_check = pytest.importorskip("mup.coord_check")

WIDTHS = (32, 64, 128)
LR = 0.05  # (not conf/train.yaml's default: the key must be read)
ARGS = ["train.steps=3", "train.fix_batch=true", f"train.lr={LR}", "watch.every=1",
        "probes=all_linear", "dataset.num_samples=16", "dataset.batch_size=8"]  # fmt: skip


def compose_train(*overrides: str):
    with initialize_config_dir(version_base="1.3", config_dir=config_dir()):
        return compose("train", overrides=list(overrides))


@pytest.fixture(scope="module")
def mup_table():
    """mup's (width, module, t, l1) of the Linear layers, on the models and first batch
    probe.train builds."""
    from probe.data.batches import build_batches
    from probe.models.build import build_model

    models, batch = {}, None
    for width in WIDTHS:
        plan = parse_training(compose_train(*ARGS, f"model.width={width}"))
        models[width] = lambda plan=plan: build_model(plan.model, plan.train.seed)
        if batch is None:
            first = next(iter(build_batches(plan.data, plan.model, plan.train.seed)))
            batch = (first.inputs, first.targets)
    table = coord_check.get_coord_data(models, [batch], optimizer="sgd", lr=LR, mup=False,
                                       nsteps=3, cuda=False, show_progress=False)  # fmt: skip
    names = {"hidden.0", "hidden.1", "hidden.2", "readout"}
    table = table[table.module.isin(names)]
    return table.set_index(["width", "module", "t"])["l1"].sort_index()


def as_mup(table: pd.DataFrame) -> pd.Series:
    """probe's (width, layer, step, abs_mean) indexed as mup's (width, module, t)."""
    table = table.assign(t=table["step"] + 1).rename(columns={"layer": "module"})
    return table.set_index(["width", "module", "t"])["abs_mean"].sort_index()


def test_watched_training_stores_mups_l1(mup_table, tmp_path):
    from probe.read.train_series import first_sites

    rows = []
    for width in WIDTHS:
        plan = parse_training(compose_train(*ARGS, f"model.width={width}"))
        train(plan, tmp_path / str(width))
        out = first_sites(pd.read_csv(tmp_path / str(width) / "train.csv"), "output")
        rows.append(out.assign(width=width))
    got = as_mup(pd.concat(rows))
    assert list(got.index) == list(mup_table.index) and len(got) == 3 * 4 * 3
    np.testing.assert_allclose(got.to_numpy(), mup_table.to_numpy(), rtol=1e-5)


def run_cli(module: str, *args: str, cwd=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          cwd=cwd or ROOT, env=env, timeout=600)  # fmt: skip


def test_cli_multirun_and_coord_plot_reproduce_mups_table(mup_table, tmp_path):
    widths = ",".join(map(str, WIDTHS))
    done = run_cli("probe.train", "-m", f"model.width={widths}", *ARGS,
                   f"hydra.sweep.dir={tmp_path}", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    done = run_cli("probe.plot", str(tmp_path), "coord")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "coord.png").is_file()
    got = as_mup(pd.read_csv(tmp_path / "coord.csv"))
    assert list(got.index) == list(mup_table.index)
    np.testing.assert_allclose(got.to_numpy(), mup_table.to_numpy(), rtol=1e-5)


@pytest.mark.parametrize(
    ("override", "named"),
    [("train.lr=-0.1", "train.lr=-0.1"), ("train.optimizer=rmsprop", "'rmsprop' is unknown"),
     ("watch.every=0", "watch.every=0")],
)  # fmt: skip
def test_bad_input_is_named_with_exit_2(override, named, tmp_path):
    done = run_cli("probe.train", override, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert named in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "run" / "probe.h5").exists()


def test_a_bad_device_is_named_before_anything_trains():
    with pytest.raises(ConfigError, match="device='gpu0' is not a torch device"):
        parse_training(compose_train(*ARGS, "device=gpu0"))


@pytest.mark.parametrize(
    "optimizer",
    [["train.optimizer=adamw", "train.lr=0.003", "train.weight_decay=0.01"],
     ["train.optimizer=sgd", "train.lr=0.05", "train.momentum=0.9"]],
    ids=["adamw", "sgd-momentum"],
)  # fmt: skip
def test_the_trainer_equals_a_hand_loop_of_the_keys_it_is_given(tmp_path, optimizer):
    """model.width, model.depth, train.seed, train.optimizer, lr, momentum, weight_decay,
    train.steps and watch.every: probe.train's losses and train.csv equal a hand loop's (the
    MLP built by hand with that seed, torch's optimizer with those settings, probe.watch at that
    every) over the same batches."""
    from probe.data.batches import build_batches
    from probe.models.zoo import MLP
    from probe.testing.trainings import image_loss
    from probe.testing.trainings import train as hand_train

    keys = ["model.width=48", "model.depth=2", "train.seed=3", "train.steps=5", "watch.every=2",
            "probes=all_linear", "dataset.num_samples=16", "dataset.batch_size=8", *optimizer]  # fmt: skip
    plan = parse_training(compose_train(*keys))
    losses = train(plan, tmp_path / "probe")
    batches = [(b.inputs, b.targets) for b in build_batches(plan.data, plan.model, 3)]
    torch.manual_seed(3)
    model = MLP(width=48, depth=2).train()
    kind, settings = optimizer[0].split("=")[1], dict(k.split("=") for k in optimizer[1:])
    hyper = {k.split(".")[1]: float(v) for k, v in settings.items()}
    opt = (torch.optim.AdamW if kind == "adamw" else torch.optim.SGD)(model.parameters(), **hyper)
    watch = {"probes": "all_linear", "out": tmp_path / "hand", "every": 2}
    want = hand_train(model, opt, [batches[s % 2] for s in range(5)], image_loss, watch, seed=3)
    np.testing.assert_allclose(losses, want, rtol=1e-6)  # (a mean of per-sample losses)
    got, hand = (pd.read_csv(tmp_path / d / "train.csv") for d in ("probe", "hand"))
    assert sorted(got["step"].unique()) == [0, 2, 4]
    assert set(got["layer"]) == {"hidden.0", "hidden.1", "readout"}
    pd.testing.assert_frame_equal(got, hand, rtol=1e-5)


def test_token_data_is_refused_before_the_watch_is_made(tmp_path, tiny_gpt2):
    """python -m probe.train feeds the model one tensor per batch: a token dataset (dicts of
    input_ids) is a ConfigError naming the ways that do train on it, before any file is made."""
    model_dir, _ = tiny_gpt2
    plan = parse_training(compose_train(
        "model=hf", f"model.name={model_dir}", "model.task=causal_lm", "dataset=random_tokens",
        "dataset.num_samples=4", "dataset.batch_size=2", "dataset.vocab_size=40",
        "objective=lm_loss", "train.steps=1",
    ))  # fmt: skip
    with pytest.raises(ConfigError, match="dataset=random_tokens gives token batches.*probe.watch"):
        train(plan, tmp_path / "run")
    assert not (tmp_path / "run").exists()
