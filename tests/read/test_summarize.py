"""Summaries of runs and sweeps: stats-only vs full, partial and corrupt files, a 2x2 sweep table."""

from __future__ import annotations

import os
import subprocess
import sys

import h5py
import numpy as np
import pandas as pd
import pytest

from probe.read.runs import open_sweep
from probe.read.slabs import read_slabs
from probe.read.summaries import summarize_file
from probe.read.tables import COLUMNS
from probe.report.summary_plots import depth_figure
from probe.store.fileformat import read_progress
from probe.store.runfile import open_probe_file
from probe.testing.compose import QUIET
from tests.helpers import ROOT, cli, run_probe

TINY = ["dataset.image_size=32", "dataset.num_samples=4", "dataset.batch_size=3"]
TEXT = ["layer", "site", "module_type", "shape", "dtype"]


def summarize_cli(*paths):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "probe.summarize", *map(str, paths)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def assert_same_numbers(a: pd.DataFrame, b: pd.DataFrame, rtol: float) -> None:
    assert a[TEXT].astype(str).values.tolist() == b[TEXT].astype(str).values.tolist()
    numbers = [c for c in COLUMNS if c not in TEXT]
    np.testing.assert_allclose(
        a[numbers].to_numpy(float), b[numbers].to_numpy(float), rtol=rtol, atol=1e-12
    )


def test_stats_only_and_full_runs_give_the_same_summary(tmp_path):
    args = ["model=resnet18", *TINY, "probes=all_activations"]
    full, f_full = run_probe(tmp_path / "full", *args)
    stats, f_stats = run_probe(tmp_path / "stats", *args, "store=stats")
    assert "layers" in f_full and "layers" not in f_stats
    pd.testing.assert_frame_equal(full.summary, stats.summary)
    # the stats-only file holds the statistics, histograms and per-unit tables itself
    assert_same_numbers(summarize_file(stats.h5_path).table, full.summary, rtol=0)
    for key in ("hist", "units"):
        np.testing.assert_array_equal(
            f_stats[f"stats/layer1.0.relu/output/{key}"][:],
            f_full[f"stats/layer1.0.relu/output/{key}"][:],
        )
    # and re-reading the full file's tensors chunk by chunk gives the same table
    out = summarize_cli(tmp_path / "full", tmp_path / "stats")
    assert out.returncode == 0, out.stderr
    assert_same_numbers(pd.read_csv(tmp_path / "full" / "summary.csv"), full.summary, rtol=1e-6)
    relu = f_full["layers/relu/output"][:].astype(np.float64)
    row = full.summary.iloc[0]
    assert (row.layer, row.site) == ("relu", "output")
    np.testing.assert_allclose([row["mean"], row["std"]], [relu.mean(), relu.std()], rtol=1e-6)


def test_a_run_cut_short_is_reported_partial_and_summarized(tmp_path):
    run_dir = tmp_path / "killed"
    out = cli(
        "model=custom",
        "model._target_=probe.testing.models.DiesOnThirdBatch",
        "model.input_shape=[3,8,8]",
        "model.num_classes=10",
        "dataset.num_samples=10",
        "dataset.batch_size=2",
        "probes=all_convs",
        f"hydra.run.dir={run_dir}",
    )
    assert out.returncode == 9  # killed inside the third forward
    with open_probe_file(run_dir / "probe.h5") as f:  # its writer was killed: /progress counts
        progress = read_progress(f)
        assert not progress.complete and progress.stats_slot == -1  # no statistics written
        valid = progress.samples
        conv = f["layers/conv/output"][:valid].astype(np.float64)
    assert valid == 4
    out = summarize_cli(run_dir)
    assert out.returncode == 0 and "partial" in out.stderr and "Traceback" not in out.stderr
    row = pd.read_csv(run_dir / "summary.csv").iloc[0]
    assert (row.layer, row.module_type, row.rows) == ("conv", "Conv2d", valid)
    np.testing.assert_allclose(
        [row["mean"], row["std"], row["min"], row["max"]],
        [conv.mean(), conv.std(), conv.min(), conv.max()],
        rtol=1e-6,
    )
    # a corrupt file is named as such, with no traceback
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "probe.h5").write_bytes(b"\x89HDF\r\n\x1a\n" + os.urandom(4096))
    out = summarize_cli(bad)
    assert out.returncode == 1 and "corrupt" in out.stderr and "Traceback" not in out.stderr
    assert "not an HDF5 file or its header is damaged" in out.stderr
    # a file cut short (a copy that stopped) says so
    whole = (run_dir / "probe.h5").read_bytes()
    (bad / "probe.h5").write_bytes(whole[: len(whole) // 2])
    out = summarize_cli(bad)
    assert out.returncode == 1 and "cut short" in out.stderr, out.stderr
    out = summarize_cli(tmp_path / "missing")
    assert out.returncode == 1 and "missing" in out.stderr and "Traceback" not in out.stderr


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """A real 2 models x 2 probe files sweep through the CLI."""
    sweep_dir = tmp_path_factory.mktemp("sweep")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "probe",
            "-m",
            *QUIET,
            "model=resnet18,lenet",
            "probes=all_convs,all_linear",
            *TINY,
            f"hydra.sweep.dir={sweep_dir}",
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    return sweep_dir


def test_sweep_table_has_every_run_and_the_override_columns(sweep):
    out = summarize_cli(sweep)
    assert out.returncode == 0, out.stderr
    table = pd.read_csv(sweep / "summary.csv", dtype={"run": str})
    assert list(table.columns[:2]) == ["run", "status"]
    override_columns = ["model", "probes", "dataset.image_size", "dataset.num_samples"]
    assert set(override_columns) <= set(table.columns[2 : -len(COLUMNS)])
    assert list(table.columns[-len(COLUMNS) :]) == COLUMNS
    assert set(table.run) == {"0", "1", "2", "3"} and set(table.status) == {"complete"}
    combos = set(table[["model", "probes"]].drop_duplicates().itertuples(index=False))
    assert combos == {(m, p) for m in ("resnet18", "lenet") for p in ("all_convs", "all_linear")}
    for run, part in table.groupby("run"):
        own = pd.read_csv(sweep / run / "summary.csv")
        assert_same_numbers(part.reset_index(drop=True), own, rtol=1e-6)
    assert len(table) == sum(len(pd.read_csv(sweep / r / "summary.csv")) for r in "0123")
    opened = open_sweep(sweep)
    assert {"run", *override_columns} <= set(opened.overrides.columns)
    assert list(opened.overrides.model) == list(table.drop_duplicates("run").model)
    pd.testing.assert_frame_equal(opened.table, table)
    # a sweep picture has one line per run on the same axes, holding that run's values
    mean_axis = depth_figure(table).axes[0]
    lines = mean_axis.get_lines()
    assert len(lines) == 4
    for line, (run, part) in zip(lines, table.groupby("run", sort=False), strict=True):
        assert line.get_label().startswith(f"{run}:")
        np.testing.assert_array_equal(line.get_ydata(), part[part.site == "output"]["mean"])


def test_slabs_read_into_two_buffers_hold_every_row(tmp_path):
    """Slabs of whole chunks, each valid until the next is asked for, cover the rows in order."""
    a = np.random.default_rng(0).standard_normal((23, 3, 5)).astype(np.float32)
    with h5py.File(tmp_path / "s.h5", "w") as f:
        ds = f.create_dataset("x", data=a, chunks=(2, 3, 5), maxshape=(None, 3, 5))
        slabs = [s.copy() for s in read_slabs(ds, 21, slab_bytes=4 * 60)]  # 4 rows a slab
    assert [len(s) for s in slabs] == [4, 4, 4, 4, 4, 1]
    np.testing.assert_array_equal(np.concatenate(slabs), a[:21])


def test_a_file_cut_short_while_it_is_summarized_is_an_error_not_a_crash(tmp_path):
    """Another process truncating the file between two slabs: the summarizer's reads (of a plain
    dataset, the kind that could be mapped) end in a DataError, in a process that survives."""
    code = f"""
import os, h5py, numpy as np
from probe.errors import DataError
from probe.read.slabs import slabs
p = {str(tmp_path / "cut.h5")!r}
with h5py.File(p, "w") as f:
    f.create_dataset("x", data=np.ones((100, 1000), np.float32), chunks=(10, 1000))
size = os.path.getsize(p)
with h5py.File(p, "r") as f:
    it = slabs(f["x"], 100, 40_000)
    next(it)
    os.truncate(p, size // 3)
    try:
        sums = [float(s.sum()) for s in it]
        print("no error", sums)
    except DataError as e:
        print("DataError", e)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])  # -7 would be SIGBUS
    assert done.stdout.startswith("DataError") and "was cut from" in done.stdout, done.stdout
