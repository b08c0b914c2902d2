"""Many runs in one process keep file handles and memory flat; a failed run leaves nothing behind:
no file, thread or hook, whichever hook owner failed to register or saw the run raise."""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import threading
from unittest.mock import patch

import h5py
import numpy as np
import pytest
import torch

import probe
from probe.errors import ModelError
from probe.hooks.backward import resolve_grads
from probe.hooks.capture import Capture
from probe.hooks.hookset import HookSet
from probe.hooks.module_select import select_modules
from probe.hooks.site_table import probe_specs
from probe.intervene.edit_hooks import EditHooks
from probe.intervene.edits import Edit
from probe.launch.run import run
from probe.testing.arrays import file_arrays
from probe.testing.compose import make_cfg
from probe.testing.models import TinyNet, assert_no_hooks, built_models, registrations
from tests.helpers import cli, hf

TINY = [
    "model=custom",
    "model.input_shape=[3,8,8]",
    "model.num_classes=10",
    "dataset.num_samples=6",
    "dataset.batch_size=2",
    "probes=everything",
]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def nothing_left_behind() -> None:
    gc.collect()
    kinds = h5py.h5f.OBJ_FILE | h5py.h5f.OBJ_DATASET | h5py.h5f.OBJ_GROUP | h5py.h5f.OBJ_ATTR
    assert h5py.h5f.get_obj_ids(types=kinds) == []  # no file, dataset, group or attribute open
    assert not [t for t in threading.enumerate() if t.name == "probe-writer"]
    for model in built_models():
        assert_no_hooks(model)


def test_a_thirty_run_sweep_keeps_handles_and_memory_flat(tmp_path):
    """`python -m probe -m seed=0,...,29`: Hydra's basic launcher runs the 30 jobs one after the
    other in one process; the model samples fds and RSS as each job starts."""
    log = tmp_path / "resources.txt"
    out = cli(
        *TINY,
        "model._target_=probe.testing.models.RecordsResources",
        f"+model.kwargs.log={log}",
        f"seed={','.join(map(str, range(30)))}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        "-m",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    samples = [tuple(map(int, line.split())) for line in log.read_text().splitlines()]
    assert len(samples) == 30
    assert len(list((tmp_path / "sweep").glob("*/probe.h5"))) == 30
    warm = samples[5:]  # after imports and allocator pools settle
    assert len({fds for fds, _ in warm}) == 1, samples
    growth_mib = (warm[-1][1] - warm[0][1]) / 1024
    assert growth_mib < 30, f"RSS grew {growth_mib:.1f} MiB over 25 jobs: {samples}"


@pytest.mark.parametrize("ok_calls", [0, 2], ids=["first-batch", "third-batch"])
def test_a_run_that_raises_leaves_no_hook_handle_or_thread(tmp_path, ok_calls):
    cfg = make_cfg(
        *TINY, "model._target_=probe.testing.models.Raises", f"+model.kwargs.ok_calls={ok_calls}"
    )
    fds = open_fds()
    with pytest.raises(ModelError, match="deliberate failure"):
        run(cfg, run_dir=tmp_path)
    nothing_left_behind()
    assert open_fds() == fds
    with h5py.File(tmp_path / "probe.h5") as f:
        assert int(f.attrs["num_samples"]) == 2 * ok_calls and not f.attrs["complete"]


# -- the edits' tensor hooks: gradient edits hang one on a tensor per forward --------------------
GRADS = {"p": {"layers": ["conv", "fc"], "capture": ["output", "grad_output"]}}


def captured(model, x, inside=None):
    """Capture's values of one forward and backward of `model` on x, each gradient site
    doubled by an edit (a tensor hook of the edits' own); `inside(out)` runs before the `with`
    ends."""
    selections = select_modules(model, probe_specs(GRADS))
    edits = [Edit("double", n, model.get_submodule(n), "grad_output", "scale",
                  lambda g, *_: 2 * g) for n in ("conv", "fc")]  # fmt: skip
    capture = Capture(selections)
    with EditHooks(edits, capture), capture:
        batch = capture.begin(len(x))
        out = model(x)
        resolve_grads(batch, out.sum(), selections)
        capture.end()
        if inside is not None:
            inside(out)
    return batch.values


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6], ids=lambda k: f"refused-{k}")
def test_capture_and_edits_leave_no_module_or_tensor_hook_and_the_next_batch_is_unchanged(k):
    """Registrations 1-2 are the edits' modules' and 3-4 the capture's (all or none on entry),
    5-6 the edits' tensors' (during the forward); then a raise inside the block, the forward's
    output kept."""
    model, x = TinyNet(), torch.randn(2, 3, 8, 8)
    want = captured(copy.deepcopy(model), x)
    with registrations(refuse=k), pytest.raises(RuntimeError, match="refused"):
        captured(model, x)
    assert_no_hooks(model)
    kept = []

    def raises(out):
        kept.append(out)
        assert out._backward_hooks  # the gradient edit's, while inside
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        captured(model, x, raises)
    assert_no_hooks(model, *kept)
    again = captured(model, x)
    assert again.keys() == want.keys() and ("fc", "grad_output") in want
    for key, value in want.items():
        torch.testing.assert_close(again[key], value, rtol=0, atol=0)


# -- every hook owner of a run, on a refused registration or a raise mid-run -----------------------
IDS = torch.randint(3, 50, (4, 6), generator=torch.Generator().manual_seed(3))
BLOCKS = ["transformer.h.0", "transformer.h.1"]
LOGIT = {"name": "logit", "index": 3}
RUNS = {  # probe.run keywords, and the hook owners (label and kind) each run has
    "grid": (
        {"intervene": {"noise": {"layers": ["transformer.wte"], "op": "noise", "std": 0.5, "seed": 7},
                       "grid": {"source": "clean", "direction": "noise", "positions": [1, -1],
                                "method": ["exact", "atp"]},
                       "metrics": ["kl"]}},
        {"edits forward", "capture (patch) forward", "intervene.grid forward",
         "intervene.grid atp forward"},
    ),
    "gradient edit": (
        {"probes": {"g": {"layers": BLOCKS, "capture": ["grad_output"]}}, "objective": LOGIT,
         "intervene": {"double": {"layers": ["transformer.h.1"], "site": "grad_output",
                                  "op": "scale", "factor": 2.0}}},
        {"capture (g) forward", "edits forward", "edits tensor"},
    ),
    "logit lens": ({"lens": "logit"}, {"lens forward"}),
    "dla": ({"lens": {"name": "dla", "tokens": [3, 4]}}, {"dla forward_pre", "dla forward"}),
    "integrated gradients": (
        {"probes": {"ig": {"layers": BLOCKS, "capture": ["ig_output"]}}, "objective": LOGIT,
         "attribution": {"baseline": "mean", "steps": 2}},
        {"attribution.baseline=mean forward", "capture (ig) forward", "ig_output forward"},
    ),
}  # fmt: skip


def api_run(model, out, keywords: dict):
    probe.run(model, [{"input_ids": IDS[:2]}, {"input_ids": IDS[2:]}], **{"probes": "none", **keywords},
              out=out, progress=False)  # fmt: skip
    with h5py.File(out / "probe.h5") as f:
        return file_arrays(f)


@contextlib.contextmanager
def owners():
    """{'<HookSet label> <kind>': the numbers of the registrations it made} (counted as
    probe.testing.models.registrations counts them) of what runs inside."""
    made: dict[str, list[int]] = {}
    add = HookSet._add

    def spied(self, kind, target, register):
        made.setdefault(f"{self.label} {kind}", []).append(len(calls) + 1)
        return add(self, kind, target, register)

    with registrations() as calls, patch.object(HookSet, "_add", spied):
        yield made


@contextlib.contextmanager
def raising_forward(module, at: int | None = None):
    """Counts `module`'s forward calls (no hook: its forward wrapped); call `at` raises."""
    calls = [0]
    forward = module.forward

    def counted(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at:
            raise RuntimeError(f"deliberate failure at call {at}")
        return forward(*args, **kwargs)

    module.forward = counted
    try:
        yield calls
    finally:
        del module.forward


@pytest.mark.parametrize("name", list(RUNS))
def test_a_refused_registration_or_a_raise_leaves_no_hook_and_the_next_run_is_unchanged(
    tmp_path, lm, name
):
    """For each hook owner of a run, its first and its last registration refused; the model's
    last block raising at its first and last call of the run: no hook is left, and a run on the
    same model afterwards writes what the first run wrote on the model as loaded."""
    keywords, expected = RUNS[name]
    model = hf(lm)
    last_block = model.transformer.h[-1]
    with owners() as made, raising_forward(last_block) as calls:
        first = api_run(model, tmp_path / "first", keywords)
    assert expected <= set(made), made
    for k in sorted({k for ks in made.values() for k in (ks[0], ks[-1])}):
        with registrations(refuse=k), pytest.raises(Exception, match=f"registration {k} refused"):
            api_run(model, tmp_path / f"refused{k}", keywords)
        assert_no_hooks(model)
    for at in (1, calls[0]):
        with raising_forward(last_block, at), pytest.raises(Exception, match="deliberate"):
            api_run(model, tmp_path / f"raised{at}", keywords)
        assert_no_hooks(model)
    again = api_run(model, tmp_path / "again", keywords)
    assert again.keys() == first.keys()
    for key, value in first.items():
        np.testing.assert_array_equal(again[key], value, err_msg=key)
