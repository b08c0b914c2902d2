"""A watched training on 2 ranks under torchrun (gloo, CPU) writes one file, equal to the same
training in one process over the same global batches: DDP (activation statistics merged over
the ranks' batches, gradients after the all-reduce) and FSDP2 (parameters, gradients and
updates from each rank's shard, merged into the unsharded model's). The one-process training
and the ranks' programs are tests.train.distributed_training."""

from __future__ import annotations

import os
import subprocess
import sys

import h5py
import numpy as np
import pandas as pd
import pytest
import torch
import yaml

import probe
from probe.testing.trainings import one_thread
from tests.helpers import ROOT
from tests.train import distributed_training

KEYS = ["step", "layer", "site", "module_type", "shape", "dtype"]
COUNTS = ["rows", "n", "nan_count", "inf_count", "units"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    with one_thread():
        distributed_training.single(out)
    return out


def torchrun(mode: str, out) -> None:
    """The ranks' training on 2 processes; torchrun's --standalone takes a free port."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "tests.train.distributed_training", mode, str(out)]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def assert_same_training(ranks, single) -> pd.DataFrame:
    """The ranks' run directory holds one file whose rows and scalars equal the one process's
    (1e-6 relative), and the trainings end with the same parameters."""
    assert sorted(p.name for p in (ranks / "watch").iterdir()) == [
        "probe.h5", "probe.log", "train.csv", "watch.yaml"
    ]  # fmt: skip
    got, want = (
        pd.read_csv(ranks / "watch" / "train.csv"),
        pd.read_csv(single / "watch" / "train.csv"),
    )
    assert (
        len(got) == len(want) == 3 * 37
    )  # 5 modules x (output, input, their gradients) + 17 param sites, less layer 0's grad_input
    pd.testing.assert_frame_equal(got[KEYS + COUNTS], want[KEYS + COUNTS])
    for column in got.columns.difference(KEYS + COUNTS):
        np.testing.assert_allclose(got[column], want[column], rtol=1e-6, atol=1e-9, err_msg=column)
    # the statistics of every site of every step, as probe.open_run reads them
    table, reference = (
        probe.open_run(ranks / "watch").train(),
        probe.open_run(single / "watch").train(),
    )
    assert table[["step", "layer", "site"]].equals(reference[["step", "layer", "site"]])
    with (
        h5py.File(ranks / "watch" / "probe.h5") as f,
        h5py.File(single / "watch" / "probe.h5") as g,
    ):
        assert list(f["train/scalars"].attrs["columns"]) == [
            "loss",
            "grad_norm",
            "grad_norm_preclip",
            "grad_scale",
            "lr.0",
        ]
        mine, one = f["train/scalars"][:], g["train/scalars"][:]
        # (the one-process training divides its gradients after the backward: its norm at the
        # end of the backward is not the ranks'; nothing clips, so the ranks' is grad_norm)
        preclip = list(f["train/scalars"].attrs["columns"]).index("grad_norm_preclip")
        np.testing.assert_allclose(mine[:, preclip], mine[:, preclip - 1], rtol=1e-12)
        mine[:, preclip] = one[:, preclip] = 0
        np.testing.assert_allclose(mine, one, rtol=1e-6)
        assert f.attrs["complete"]
    assert yaml.safe_load((ranks / "watch" / "watch.yaml").read_text())["world_size"] == 2
    final, reference = torch.load(ranks / "final.pt"), torch.load(single / "final.pt")
    assert final.keys() == reference.keys()
    for name in final:
        torch.testing.assert_close(final[name], reference[name], rtol=1e-6, atol=1e-7)
    return got


def test_ddp_on_two_ranks_equals_one_process(single, tmp_path):
    torchrun("ddp", tmp_path)
    rows = assert_same_training(tmp_path, single)
    # each rank saw 4 of the step's 8 rows: the merged activation sites count all 8
    assert set(rows.loc[rows.site == "output", "rows"]) == {8}


def test_fsdp2_on_two_ranks_equals_the_unsharded_model(single, tmp_path):
    torchrun("fsdp", tmp_path)
    rows = assert_same_training(tmp_path, single)
    # the first layer's 7 output units lie 4 on rank 0 and 3 on rank 1: joined, in order
    weight = rows[(rows.layer.astype(str) == "0") & (rows.site == "param_grad.weight")]
    assert set(weight["shape"]) == {"1x7x6"} and set(weight["units"]) == {7}
    assert set(rows.loc[rows.site.str.startswith("param"), "rows"]) == {1}
    # the FullyShardedDataParallel wrapper (FSDP1) flattens parameters: a named refusal
    said = (tmp_path / "fsdp1.txt").read_text()
    assert "FullyShardedDataParallel (FSDP1)" in said and "fully_shard" in said, said
    # a watch made before fully_shard would read the replaced parameters: refused at start
    for rank in (0, 1):
        said = (tmp_path / f"early{rank}.txt").read_text()
        assert "layer '0' parameter 'weight' is no longer one of the model's" in said, said
    assert not (tmp_path / "early").exists()
    # a probe batch, evaluated by rank 0 alone, would wait forever on the other rank: refused
    for rank in (0, 1):
        said = (tmp_path / f"probe_batch{rank}.txt").read_text()
        assert "probe_batch is evaluated by rank 0 alone" in said and "FSDP" in said, said
