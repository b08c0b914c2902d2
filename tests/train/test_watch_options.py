"""The watch's options are declared once (probe.watch_options.WatchOptions): probe.watch's
keywords, both trainers' callbacks and `python -m probe.train` give the same options object
for the same settings; every option a user gives reaches each of them, and a field added to
the declaration without a sample here fails `test_the_samples_cover_every_option`."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir

import probe
from probe import config as schema
from probe.config import config_dir
from probe.errors import ConfigError
from probe.plan import parse_training
from probe.testing.trainings import cnn
from probe.train import trainer as trainer_module
from probe.train import watched_run
from probe.train.step_hooks import Watcher
from probe.watch_options import WatchOptions, names, user_options

CONVS = {"convs": {"layers": ["*"], "types": ["Conv2d"], "capture": ["output"]}}
TRAINER_SETS = {"optimizer", "scaler", "hook_optimizer"}


class Scaler:
    def get_scale(self) -> float:
        return 1024.0


def samples(out) -> dict:
    """A value other than the default for every option."""
    return {
        "out": out,
        "every": 3,
        "optimizer": None,  # (set per test: it is made on the model)
        "scaler": Scaler(),
        "probe_batch": torch.randn(2, 3, 8, 8),
        "probe_every": "log",
        "probe_stats": {"topk": 2},
        "edits": {
            "half": {"layers": ["conv1"], "site": "grad_output", "op": "scale", "value": 0.5}
        },
        "flush_every": 4,
        "fail_on_nonfinite": True,
        "seed": 7,
        "overwrite": True,
        "hook_optimizer": False,
    }


def test_the_samples_cover_every_option(tmp_path):
    """A new option needs a sample here, so the tests below carry it to every entry point."""
    assert set(samples(tmp_path)) == set(names())
    defaults = {f.name: f.default for f in dataclasses.fields(WatchOptions)}
    for name, value in samples(tmp_path).items():
        if name != "optimizer":
            assert value is not defaults[name] and value != defaults[name], name


def test_probe_watch_keywords_are_the_declared_options_with_their_defaults():
    params = inspect.signature(probe.watch).parameters
    keywords = [p for p in params.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert [p.name for p in keywords] == list(names())
    for p, f in zip(keywords, dataclasses.fields(WatchOptions), strict=True):
        assert p.default == (f.default if f.default is not dataclasses.MISSING else p.empty)


def test_probe_watch_gives_the_options_object_of_its_keywords(tmp_path):
    model = cnn()
    given = samples(tmp_path) | {"optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
    w = probe.watch(model, CONVS, **given)
    assert w.options == WatchOptions(**given)
    for name, value in given.items():
        assert getattr(w.options, name) is value, name
    assert isinstance(w.watcher, Watcher) and w.watcher.schedule.every == 3
    assert w.watcher.fail_on_nonfinite and not w.watcher.params_at_forward
    w.close()


def test_the_options_are_frozen(tmp_path):
    options = WatchOptions(out=tmp_path)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.every = 2  # type: ignore[misc]


CALLBACKS = [pytest.param("probe.integrations.hf", id="hf"),
             pytest.param("probe.integrations.lightning", id="lightning")]  # fmt: skip


@pytest.mark.parametrize("module", CALLBACKS)
def test_a_callback_takes_exactly_the_users_options(tmp_path, module):
    """Every option but those the trainer gives (its optimizer, its scaler, its step hooks):
    each reaches the watch the callback makes, which equals probe.watch's of the same settings
    with the trainer's optimizer and scaler and hook_optimizer=False."""
    ProbeCallback = pytest.importorskip(module).ProbeCallback
    params = inspect.signature(ProbeCallback.__init__).parameters
    assert params["every"].default == WatchOptions(out=tmp_path).every
    given = {k: v for k, v in samples(tmp_path).items() if k not in TRAINER_SETS}
    assert set(given) == set(user_options())
    cb = ProbeCallback(CONVS, **given)
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = Scaler()
    w = cb.driven.start(model, opt, 0, scaler)
    try:
        expected = probe.watch(
            model, CONVS, **given, optimizer=opt, scaler=scaler, hook_optimizer=False
        )
        assert w.options == expected.options
        for name, value in given.items():
            assert getattr(w.options, name) is value, name
    finally:
        cb.driven.close(complete=False)
    for name in TRAINER_SETS:
        with pytest.raises(ConfigError, match=f"ProbeCallback got {name}; it takes probes"):
            ProbeCallback(CONVS, out=tmp_path, **{name: samples(tmp_path)[name]})


@pytest.mark.parametrize("module", CALLBACKS)
def test_a_callbacks_bad_option_is_said_when_it_is_made(tmp_path, module):
    ProbeCallback = pytest.importorskip(module).ProbeCallback
    with pytest.raises(ConfigError, match=re.escape("flush_every=0: give an int >= 1")):
        ProbeCallback(CONVS, out=tmp_path, flush_every=0)


def compose_train(*overrides: str):
    with initialize_config_dir(version_base="1.3", config_dir=config_dir()):
        return compose("train", overrides=list(overrides))


ARGS = ["train.steps=1", "dataset.num_samples=8", "dataset.batch_size=8", "model.width=8"]


def test_the_cli_keys_are_options_with_their_defaults():
    """config.WatchKeys and conf/train.yaml's watch: each key an option of that name, its
    default the option's."""
    defaults = {f.name: f.default for f in dataclasses.fields(WatchOptions)}
    keys = {f.name: f.default for f in dataclasses.fields(schema.WatchKeys)}
    assert keys == {k: defaults[k] for k in keys}
    shipped = yaml.safe_load((Path(config_dir()) / "train.yaml").read_text())
    assert shipped["watch"] == keys


def test_the_cli_gives_the_options_object_of_its_keys(tmp_path, monkeypatch):
    """The Watch `python -m probe.train` makes (in process, its Watch recorded) has the options
    probe.watch gives for the same every, flush_every, optimizer, out and overwrite."""
    made = []

    class Recorded(watched_run.Watch):
        def __init__(self, model, probes, options, **kwargs):
            super().__init__(model, probes, options, **kwargs)
            made.append(self)

    monkeypatch.setattr(watched_run, "Watch", Recorded)
    plan = parse_training(compose_train(*ARGS, "watch.every=2", "watch.flush_every=3",
                                        "overwrite=true"))  # fmt: skip
    trainer_module.train(plan, tmp_path)
    (w,) = made
    expected = WatchOptions(out=tmp_path, every=2, flush_every=3, optimizer=w.options.optimizer,
                            overwrite=True)  # fmt: skip
    assert isinstance(w.options.optimizer, torch.optim.SGD)
    assert w.options == expected
    assert trainer_module.watch_options(plan, tmp_path, w.options.optimizer) == expected


@pytest.mark.parametrize(
    ("key", "value", "said"),
    [("every", "0", "watch.every=0: give an int >= 1 (record every N-th step"),
     ("every", "sometimes", "watch.every='sometimes': give an int >= 1"),
     ("flush_every", "0", "watch.flush_every=0: give an int >= 1, the recorded steps between")],
)  # fmt: skip
def test_a_bad_cli_key_gets_the_options_message_under_its_key(key, value, said):
    with pytest.raises(ConfigError, match=re.escape(said)):
        parse_training(compose_train(*ARGS, f"watch.{key}={value}"))
    with pytest.raises(ConfigError, match=re.escape(said.removeprefix("watch."))):
        WatchOptions(out="x", **{key: int(value) if value.isdigit() else value})
