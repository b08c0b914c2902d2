"""Reading a watched training: while it runs (another process, HDF5's SWMR mode), after it,
with probe.open_run, probe.summarize and plain h5py; a deepcopy of the watched model is not
the training."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import h5py
import numpy as np
import pandas as pd
import pytest
import torch

import probe
from probe.errors import ConfigError
from probe.read.summaries import main as summarize_main
from probe.store.steps_file import CSV_COLUMNS, STAT_COLUMNS
from probe.testing.trainings import cnn, image_batches, image_loss
from tests.helpers import ROOT

READER = """
import sys, probe
with probe.open_run(sys.argv[1]) as run:
    print(run.state, sorted(run.train()["step"].unique().tolist()), list(run.train_scalars()["step"]))
"""


def python(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip


def test_a_training_is_read_while_it_runs_and_after(tmp_path, capfd):
    """Flushed every 2 recorded steps: after 5 steps another process reads steps 0-3 ("in
    progress"); after the watch closes, all 6 and `probe.summarize` prints the last step's
    table. train.csv's columns are `step`, summary.csv's, then `norm`."""
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probes = {"net": {"layers": ["conv1", "fc"], "capture": ["output", "param_grad"]}}
    with probe.watch(model, probes, out=tmp_path, optimizer=opt, flush_every=2) as w:
        for step, batch in enumerate(image_batches(6)):
            opt.zero_grad()
            loss = image_loss(model, batch)
            loss.backward()
            w.loss(loss)
            opt.step()
            if step == 4:
                live = python("-c", READER, str(tmp_path))
    assert live.returncode == 0, live.stderr
    assert live.stdout.split("\n")[0] == "in progress [0, 1, 2, 3] [0, 1, 2, 3]"
    with probe.open_run(tmp_path) as run:
        assert run.complete and sorted(run.train()["step"].unique()) == list(range(6))

    capfd.readouterr()
    assert summarize_main([str(tmp_path)]) == 0  # python -m probe.summarize RUN
    lines = capfd.readouterr().out.strip().split("\n")
    assert lines[0].split() == ["step", *CSV_COLUMNS[1:]]
    assert [line.split()[0] for line in lines[1:-1]] == ["5"] * 5  # 5 sites at step 5
    assert lines[-1].endswith("complete, a watched training, 6 steps, 6 recorded, the last 5")

    table = pd.read_csv(tmp_path / "train.csv")
    assert list(table.columns) == list(CSV_COLUMNS)
    from probe.read.tables import COLUMNS

    assert list(CSV_COLUMNS) == ["step", *COLUMNS, "norm"]
    with h5py.File(tmp_path / "probe.h5") as f:  # plain h5py once it is closed
        assert f.attrs["complete"] and f.attrs["store_mode"] == "watch"
        rows = f["train/sites/fc/output"][:]
        assert rows.shape == (6, len(STAT_COLUMNS))
        assert list(f["train/step"][:]) == list(range(6))
    with probe.open_run(tmp_path) as run:  # appended at each flush, as pandas writes the table
        assert (tmp_path / "train.csv").read_text() == run.train().to_csv(index=False)
    fc = table[(table.layer == "fc") & (table.site == "output")]
    np.testing.assert_array_equal(fc[list(STAT_COLUMNS)].to_numpy(dtype=float), rows)


def test_a_deepcopy_of_the_watched_model_is_not_the_training(tmp_path):
    """An EMA copy made while watched copies the hooks (torch copies a module's hooks): it copies
    without the watch's file, and its forwards under no_grad are not recorded."""
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probes = {"fc": {"layers": ["fc"], "capture": ["output"]}}
    with probe.watch(model, probes, out=tmp_path, optimizer=opt):
        x, y = image_batches(1)[0]
        opt.zero_grad()
        image_loss(model, (x, y)).backward()
        ema = copy.deepcopy(model)
        with torch.no_grad():
            ema(torch.randn(5, 3, 8, 8))
        opt.step()
    with probe.open_run(tmp_path) as run:
        assert list(run.train()["rows"]) == [8]  # the training's batch only


def test_a_watched_run_is_described_in_steps_wherever_it_is_described(tmp_path, capfd):
    """5 steps recorded every 2nd (0, 2, 4): `complete, 5 steps, 3 recorded, the last 4` (not
    `0 samples`) in probe.open_run's repr, probe.summarize's line, and the refusals of a second
    watch and of a probing run into the directory; counted here from the loop and the file's
    rows. A training stopped by an exception holds what it recorded, `partial`."""
    from probe.store.runfile import check_existing

    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probes = {"fc": {"layers": ["fc"], "capture": ["output"]}}
    out = tmp_path / "w"
    with probe.watch(model, probes, out=out, optimizer=opt, every=2) as w:
        for batch in image_batches(5):
            opt.zero_grad()
            image_loss(model, batch).backward()
            opt.step()
    with probe.open_run(out) as run:
        steps = sorted(run.train_scalars()["step"])
        said = f"complete, {w.step_count} steps, {len(steps)} recorded, the last {steps[-1]}"
        assert said == "complete, 5 steps, 3 recorded, the last 4"
        assert repr(run) == f"Run({str(out)!r}, complete, a watched training: {said[10:]})"
    capfd.readouterr()
    assert summarize_main([str(out)]) == 0
    assert (
        capfd.readouterr()
        .out.strip()
        .endswith(f"{out / 'probe.h5'}: complete, a watched training, {said[10:]}")
    )
    with pytest.raises(ConfigError) as again:
        probe.watch(model, probes, out=out, optimizer=opt).start()
    assert f"already holds a run ({said});" in str(again.value)
    with pytest.raises(ConfigError) as cli:  # python -m probe hydra.run.dir=<it>
        check_existing(out / "probe.h5", resume=False, overwrite=False)
    assert f"already holds probe.h5 ({said});" in str(cli.value)
    assert "samples" not in str(again.value) + str(cli.value)

    stopped = tmp_path / "stopped"
    with pytest.raises(RuntimeError), probe.watch(model, probes, out=stopped, optimizer=opt):
        for step, batch in enumerate(image_batches(4)):
            opt.zero_grad()
            image_loss(model, batch).backward()
            opt.step()
            if step == 2:
                raise RuntimeError("the training stopped")
    with probe.open_run(stopped) as run:
        held = sorted(run.train_scalars()["step"])
        assert repr(run).endswith(f"partial, a watched training: {len(held)} recorded steps, "
                                  f"the last {held[-1]})")  # fmt: skip
