"""torchrun with 2 CPU processes: the stitched probe.h5 equals a single-process run, and a
stitched file with a shard gone says it is incomplete."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pandas as pd
import pytest
import torch

import probe
from probe.errors import DataError
from probe.launch.run import run
from probe.read.summaries import summarize_file
from probe.store.stitch import IncompleteFileError, is_complete, open_checked, read_stats
from probe.testing.compose import QUIET, make_cfg
from tests.helpers import ROOT, assert_same_arrays

# 7 samples in batches of 2: rank 0 gets batches 0-1 (samples 0-3), rank 1 batches 2-3 (samples
# 4-6, the last batch short). Outputs, output gradients and per-batch parameter gradients.
CASE = [
    "model=resnet18",
    "dataset.image_size=32",
    "dataset.num_samples=7",
    "dataset.batch_size=2",
    "probes=all_convs",
    "probes.convs.layers=[layer4.*,conv1]",
    "probes.convs.capture=[output,grad_output,param_grad]",
    "stats.topk=3",  # examples per unit, merged across ranks (compared decoded, by file_arrays)
    "stats.bottomk=2",
    "stats.topk_quantiles=2",
]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def single_process(run_dir, *args) -> None:
    """The same run in this process on one thread, as each torchrun rank runs (the reference a
    stitched file is compared with, value for value)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run(make_cfg(*args), run_dir=run_dir)
    finally:
        torch.set_num_threads(threads)


def torchrun(run_dir, *args):
    env = {**os.environ, "PYTHONPATH": str(ROOT), **ONE_THREAD}
    env.pop("HYDRA_FULL_ERROR", None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    return subprocess.run(
        [*command, "-m", "probe", *QUIET, *args, f"hydra.run.dir={run_dir}"],
        cwd=run_dir.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp")
    single_process(root / "single", *CASE)
    two = torchrun(root / "two", *CASE)
    assert two.returncode == 0, two.stderr + two.stdout
    return root / "single", root / "two"


def test_two_ranks_stitch_into_the_single_process_file(runs):
    single, two = runs
    assert sorted(p.name for p in two.glob("*.h5")) == [
        "probe.h5",
        "probe.rank0.h5",
        "probe.rank1.h5",
    ]
    # 6 convs x 3 sites, the sample index and targets, /model/output and the /stats arrays
    assert assert_same_arrays(two / "probe.h5", single / "probe.h5") > 6 * 3 + 3
    with h5py.File(two / "probe.h5") as f, h5py.File(two / "probe.rank1.h5") as r1:
        assert f.attrs["complete"] and f.attrs["num_samples"] == 7 and f.attrs["num_batches"] == 4
        assert f["layers/conv1/output"].is_virtual
        np.testing.assert_array_equal(r1["samples/index"][:], [4, 5, 6])  # rank 1's block
        assert r1["layers/conv1/param_grad.weight"].shape[0] == 2  # batches 2 and 3
    # the table: counts, extremes and layout exact; float sums merged across ranks to 1e-12
    a, b = pd.read_csv(two / "summary.csv"), pd.read_csv(single / "summary.csv")
    exact = [
        "layer",
        "site",
        "module_type",
        "shape",
        "dtype",
        "rows",
        "n",
        "min",
        "max",
        "nan_count",
        "inf_count",
        "frac_zero",
    ]
    pd.testing.assert_frame_equal(a[exact], b[exact])
    pd.testing.assert_frame_equal(a, b, check_exact=False, rtol=1e-12, atol=0)
    assert len(a) == 6 * 3  # 6 convs: output, grad_output, param_grad.weight


def test_a_missing_shard_makes_the_stitched_file_incomplete(runs, tmp_path):
    _, two = runs
    copy = tmp_path / "copy"
    shutil.copytree(two, copy)
    assert is_complete(copy / "probe.h5")
    with open_checked(copy / "probe.h5") as f:
        assert len(read_stats(f)) == 18
    (copy / "probe.rank1.h5").unlink()
    with h5py.File(copy / "probe.h5") as f:  # what a reader would silently get: fill values
        assert f.attrs["complete"] and np.isnan(f["layers/conv1/output"][4:]).all()
        with pytest.raises(IncompleteFileError, match=r"probe\.rank1\.h5 \(missing\)"):
            read_stats(f)
    assert not is_complete(copy / "probe.h5")
    with pytest.raises(DataError, match="Restore the shard files"):
        open_checked(copy / "probe.h5")
    # the summarizer does not count the fill values: its table comes from the merged /stats
    damaged, intact = summarize_file(copy / "probe.h5"), summarize_file(two / "probe.h5")
    assert damaged.state == "partial" and "probe.rank1.h5 (missing)" in damaged.message
    assert intact.state == "complete"
    pd.testing.assert_frame_equal(damaged.table, intact.table, check_exact=False, rtol=1e-12)
    with pytest.warns(UserWarning, match=r"probe\.rank1\.h5 \(missing\)"):
        run = probe.open_run(copy)
    with run:
        assert not run.complete


def test_blocks_are_numpy_array_split():
    from probe.launch.distributed import block

    for count in range(0, 12):
        for world in (1, 2, 3, 5):
            expected = [list(a) for a in np.array_split(np.arange(count), world)]
            assert [list(block(count, r, world)) for r in range(world)] == expected


@pytest.mark.parametrize("mode", ["stats", "full"])
def test_stitched_shards_hold_the_concatenated_data_and_its_statistics(tmp_path, mode):
    """Two shard files written by the writer (uneven blocks, one with NaN and Inf) stitch into
    statistics equal to numpy's over the concatenation, and (full) rows in order."""
    import torch

    from probe.hooks.record import Record
    from probe.plan import StoreSpec
    from probe.store.stitch import stitch
    from tests.helpers import counted, sink_of

    g = torch.Generator().manual_seed(0)
    data = 1000 + 0.01 * torch.randn(11, 3, 4, generator=g)  # a large mean, a small spread
    data[7, 0, 0], data[9, 1, 2] = float("nan"), float("inf")
    blocks, paths = [range(0, 6), range(6, 11)], []
    for rank, block in enumerate(blocks):
        paths.append(tmp_path / f"probe.rank{rank}.h5")
        writer = sink_of(paths[-1], StoreSpec(mode=mode), first_sample=block.start)
        for index, lo in enumerate(range(block.start, block.stop, 4)):
            hi = min(lo + 4, block.stop)
            values = {("layer", "output"): data[lo:hi].clone()}
            writer.put(counted(Record(lo - block.start, hi - lo, index, values)))
        writer.close(complete=True)
    (info,) = stitch(tmp_path / "probe.h5", paths)
    row = info.stats.as_row()
    a = data.double().numpy()
    finite = a[np.isfinite(a)]
    assert (row["n"], row["nan_count"], row["inf_count"], row["rows"]) == (finite.size, 1, 1, 11)
    assert (row["min"], row["max"]) == (finite.min(), finite.max())
    np.testing.assert_allclose(
        [row["mean"], row["std"]], [finite.mean(), finite.std()], rtol=2e-7
    )  # the streaming bound of test_stats
    with open_checked(tmp_path / "probe.h5") as f:
        assert (
            f.attrs["num_samples"] == 11 and read_stats(f)["layer", "output"].stats.n == finite.size
        )
        if mode == "full":
            np.testing.assert_array_equal(f["layers/layer/output"][:], data.numpy())
            np.testing.assert_array_equal(f["samples/index"][:], np.arange(11))
        else:
            assert "layers" not in f
