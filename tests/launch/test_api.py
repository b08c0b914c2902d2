"""`probe.run(model, data, probes, out=...)`: the same files as the CLI from the same work, a
caller's batches of every kind, no hook left behind, and bad input named."""

from __future__ import annotations

import re

import h5py
import numpy as np
import pandas as pd
import pytest
import torch

import probe
from probe.data.batches import build_batches
from probe.errors import ConfigError, DataError
from probe.models.build import build_model
from probe.plan import parse
from probe.testing.compose import make_cfg
from probe.testing.models import assert_no_hooks
from probe.testing.tiny_lms import make_tiny
from tests.helpers import assert_same_arrays, cli, cloned_outputs

ONE_THREAD = {"OMP_NUM_THREADS": "1"}
TINY = ["model=resnet18", "dataset.image_size=32", "dataset.num_samples=5", "dataset.batch_size=2"]


def _model_and_batches(*overrides: str):
    """The model and the batches the CLI builds for these overrides."""
    cfg = make_cfg(*overrides)
    torch.manual_seed(cfg.seed)
    model = build_model(parse(cfg).model, cfg.seed)
    return model, list(build_batches(parse(cfg).data, parse(cfg).model, cfg.seed, model))


def _summary(path) -> pd.DataFrame:
    return pd.read_csv(path / "summary.csv")


def test_the_api_writes_what_the_cli_writes_from_the_same_work(tmp_path):
    """Full capture with gradients (grads_all_convs): equal datasets and equal summaries.
    Both on one thread: on two, torch's CPU backward of the one-sample batch differs between
    two runs of the same process in the last bits (docs/reliability.md, Determinism)."""
    out = cli(*TINY, "probes=grads_all_convs", f"hydra.run.dir={tmp_path / 'cli'}", env=ONE_THREAD)
    assert out.returncode == 0, out.stderr[-2000:]
    model, batches = _model_and_batches(*TINY)
    data = [(b.inputs, b.targets) for b in batches]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run = probe.run(
            model.train(), data, "grads_all_convs", out=tmp_path / "api", progress=False
        )
    finally:
        torch.set_num_threads(threads)
    assert run.complete
    run.close()
    assert assert_same_arrays(tmp_path / "cli" / "probe.h5", tmp_path / "api" / "probe.h5") >= 40
    pd.testing.assert_frame_equal(_summary(tmp_path / "cli"), _summary(tmp_path / "api"))
    with h5py.File(tmp_path / "api" / "probe.h5") as f:
        assert f.attrs["complete"] and f.attrs["num_samples"] == 5
    assert_no_hooks(model)
    assert model.training  # run in eval mode (train_mode=False), given back


def test_a_token_model_with_dict_batches_equals_the_cli_on_the_same_ids(tmp_path):
    lm = make_tiny("gpt2", tmp_path / "gpt2", vocab_size=40)
    ids = torch.randint(1, 40, (4, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    torch.save({"input_ids": ids, "attention_mask": mask}, tmp_path / "ids.pt")
    args = ["model=hf", f"model.name={lm}", "model.task=causal_lm", "probes=residual"]
    data_args = ["dataset=tokens", f"dataset.path={tmp_path / 'ids.pt'}", "dataset.batch_size=2"]
    out = cli(*args, *data_args, f"hydra.run.dir={tmp_path / 'cli'}")
    assert out.returncode == 0, out.stderr[-2000:]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(lm)
    batches = [{"input_ids": ids[i : i + 2], "attention_mask": mask[i : i + 2]} for i in (0, 2)]
    probe.run(model, batches, "residual", out=tmp_path / "api", progress=False).close()
    assert assert_same_arrays(tmp_path / "cli" / "probe.h5", tmp_path / "api" / "probe.h5") >= 3
    pd.testing.assert_frame_equal(_summary(tmp_path / "cli"), _summary(tmp_path / "api"))


def test_a_generator_of_bare_tensors_stores_every_row_a_forward_gives(tmp_path):
    model, batches = _model_and_batches(*TINY)
    inputs = [b.inputs for b in batches]
    model.eval()
    probes = {"head": {"layers": ["layer4.1.conv2", "fc"]}}
    with probe.run(model, (x for x in inputs), probes, out=tmp_path, progress=False) as run:
        want = cloned_outputs(model, ["layer4.1.conv2", "fc"], inputs)
        for name, values in want.items():
            np.testing.assert_allclose(run.array(name)[:], values, rtol=1e-6, atol=1e-6)
    assert not model.training
    assert_no_hooks(model)


def test_a_run_stopped_by_bad_data_leaves_no_hook_and_the_mode_it_found(tmp_path):
    model, batches = _model_and_batches(*TINY)
    data = (x for x in [batches[0].inputs, "not a batch", batches[1].inputs])  # found mid-run
    with pytest.raises(DataError, match="data yielded a str"):
        probe.run(model.eval(), data, "all_convs", out=tmp_path, progress=False)
    assert_no_hooks(model)
    assert not model.training
    with h5py.File(tmp_path / "probe.h5") as f:  # the batch before it is written
        assert f.attrs["num_samples"] == 2 and not f.attrs["complete"]


@pytest.mark.parametrize(
    ("probes", "data", "error", "words"),
    [
        ({"head": {"layrs": ["fc"]}}, None, ConfigError, "'layrs' is not a key of ProbeSpec"),
        ("all_convz", None, ConfigError, "probes='all_convz' is not a shipped probes file"),
        ("all_convs", [3], DataError, "data yielded a int"),
        ("all_convs", [(1, 2, 3)], DataError, "a tuple of 3 items"),
        ("all_convs", [], DataError, "data holds no batch"),
        ("all_convs", 7, DataError, "data is a int, not an iterable of batches"),
    ],
)
def test_bad_input_names_the_bad_value(tmp_path, probes, data, error, words):
    model = build_model(parse(make_cfg(*TINY)).model, 0)
    data = [torch.randn(2, 3, 32, 32)] if data is None else data
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        probe.run(model, data, probes, out=tmp_path / "run", progress=False)
    assert_no_hooks(model)


@pytest.mark.parametrize(
    ("keywords", "words"),
    [
        ({"stats": "bogus"}, "stats.backend=bogus; Invalid value 'bogus', expected one of [auto, "),
        ({"store": {"compression": "zip"}}, "store: compression: Invalid value 'zip'"),
        ({"store": {"chunk_bytes": "big"}}, "store: chunk_bytes: Value 'big' of type 'str'"),
        ({"precision": "float8"}, "precision='float8': Invalid value 'float8', expected one of"),
        ({"train_mode": "maybe"}, "train_mode='maybe': Value 'maybe' is not a valid bool"),
    ],
)
def test_a_bad_keyword_value_names_the_keyword_and_the_choices(tmp_path, keywords, words):
    model = build_model(parse(make_cfg(*TINY)).model, 0)
    with pytest.raises(ConfigError, match=re.escape(words)):
        probe.run(model, [torch.randn(2, 3, 32, 32)], "all_convs", out=tmp_path, **keywords)
    assert_no_hooks(model)
    assert not (tmp_path / "probe.h5").exists()


def test_an_out_that_holds_a_run_is_refused(tmp_path):
    model = build_model(parse(make_cfg(*TINY)).model, 0)
    x = [torch.randn(2, 3, 32, 32)]
    probe.run(model, x, "all_convs", out=tmp_path, store="stats", progress=False).close()
    with pytest.raises(ConfigError, match="already holds a run"):
        probe.run(model, x, "all_convs", out=tmp_path, progress=False)


def test_options_are_the_clis_keys(tmp_path):
    """store/stats/seed as keywords reach the file as the CLI's keys would."""
    model = build_model(parse(make_cfg(*TINY)).model, 0)
    x = [torch.randn(2, 3, 32, 32)]
    store = {"mode": "stats", "flush_seconds": 0}
    with probe.run(model, x, "all_convs", out=tmp_path, store=store, stats="torch", seed=3) as run:
        cfg = run.config
        assert (cfg.store.mode, cfg.store.flush_seconds, cfg.stats.backend, cfg.seed) == (
            "stats", 0.0, "torch", 3,
        )  # fmt: skip
    with h5py.File(tmp_path / "probe.h5") as f:
        assert f.attrs["store_mode"] == "stats" and f.attrs["stats_backend"] == "torch"
