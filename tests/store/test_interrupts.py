"""Kills, Ctrl-C, SIGTERM and resume, on real subprocess runs of the CLI.

Every file left behind is compared value for value with an uninterrupted in-process run of the same
config: the rows it holds must be that run's first rows, and a resumed file must equal it entirely.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import h5py
import numpy as np
import pandas as pd
import pytest

from probe.errors import ConfigError
from probe.launch.interrupt import Interrupted
from probe.launch.run import run
from probe.stats import backend
from probe.stats.running import stats_for
from probe.store import stats_file
from probe.store.fileformat import read_progress
from probe.store.runfile import is_partial, open_probe_file
from probe.testing.arrays import file_arrays
from probe.testing.compose import QUIET, make_cfg
from tests.helpers import ROOT

SLOW = [
    "model=custom",
    "model._target_=probe.testing.models.TinyNet",
    "model.input_shape=[3,8,8]",
    "model.num_classes=10",
    "probes=everything",
    "dataset.num_samples=30",
    "dataset.batch_size=3",
]
DELAY = "+model.kwargs.delay=0.15"  # slows each forward so a signal lands mid-run


arrays = file_arrays


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, in-process: its arrays and its summary."""
    d = tmp_path_factory.mktemp("reference")
    result = run(make_cfg(*SLOW), run_dir=d)
    with h5py.File(result.h5_path) as f:
        return arrays(f), result.summary, d


def start(run_dir, *extra):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.Popen(
        [sys.executable, "-m", "probe", *QUIET, *SLOW, DELAY, "hydra.verbose=probe"]
        + [f"hydra.run.dir={run_dir}", *extra],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def signal_after(proc, batches: int, sig) -> str:
    """Send `sig` once the writer has logged `batches` flushed batches; return all output."""
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if f"flushed batch {batches - 1} " in line:
            proc.send_signal(sig)
            break
    seen.append(proc.stdout.read())
    proc.wait(timeout=120)
    return "".join(seen)


def assert_prefix_of(reference_arrays, f: h5py.File, at_least: int) -> int:
    """Every stored array is the reference's first rows; returns the number of samples kept."""
    n = read_progress(f).samples
    assert n >= at_least
    got = {k: v for k, v in arrays(f).items() if not k.startswith("stats")}
    assert set(got) == {k for k in reference_arrays if not k.startswith("stats")}
    for name, a in got.items():
        assert len(a) >= n, name
        np.testing.assert_array_equal(a[:n], reference_arrays[name][:n], err_msg=name)
    return n


def assert_resume_gives_the_reference(run_dir, reference) -> None:
    """Resume in-process; the finished file and summary equal the uninterrupted run's."""
    result = run(make_cfg(*SLOW, DELAY, "resume=true"), run_dir=run_dir)
    ref_arrays, ref_summary, ref_dir = reference
    with h5py.File(result.h5_path) as f:
        assert f.attrs["complete"] and int(f.attrs["resumes"]) == 1
        got = arrays(f)
    assert set(got) == set(ref_arrays)
    for name, a in got.items():
        assert a.dtype == ref_arrays[name].dtype
        np.testing.assert_array_equal(a, ref_arrays[name], err_msg=name)
    pd.testing.assert_frame_equal(result.summary, ref_summary, check_exact=True)
    pd.testing.assert_frame_equal(
        pd.read_csv(run_dir / "summary.csv"), pd.read_csv(ref_dir / "summary.csv"), check_exact=True
    )


@pytest.mark.parametrize("batches", [1, 2, 3])
def test_sigkill_leaves_a_readable_partial_file(tmp_path, reference, batches):
    proc = start(tmp_path)
    signal_after(proc, batches, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    with open_probe_file(tmp_path / "probe.h5") as f:
        assert is_partial(f)
        assert_prefix_of(reference[0], f, at_least=3 * batches)
    if batches == 2:  # no /stats after a kill: resume recomputes them from the stored rows
        assert_resume_gives_the_reference(tmp_path, reference)


def test_sigkill_of_a_stats_only_run_keeps_the_statistics_of_its_flushed_rows(tmp_path, reference):
    """A stats-only flush writes /stats with the row count: after a kill they describe exactly
    the flushed rows (equal to statistics of the reference's first rows), and a resume finishes
    with the uninterrupted run's summary."""
    stats_only = ["store.mode=stats", "store.flush_seconds=0"]
    proc = start(tmp_path, *stats_only)
    signal_after(proc, 2, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    ref_arrays, ref_summary, _ = reference
    with open_probe_file(tmp_path / "probe.h5") as f:
        assert is_partial(f)
        n = read_progress(f).samples
        assert n >= 6 and "layers" not in f
        saved = stats_file.read(f)  # the whole slot /progress points at
        assert len(saved) == 6
        for (layer, site), info in saved.items():
            want = stats_for(info.module_type, site)
            rows = ref_arrays[f"layers/{layer}/{site}"][:n]
            for lo in range(0, n, 3):
                backend.fold(want, rows[lo : lo + 3])
            assert info.stats.rows == n, (layer, site)
            assert info.stats.as_row() == pytest.approx(want.as_row(), rel=1e-12, nan_ok=True)
    result = run(make_cfg(*SLOW, DELAY, "resume=true", *stats_only), run_dir=tmp_path)
    pd.testing.assert_frame_equal(result.summary, ref_summary, rtol=1e-12)


@pytest.mark.parametrize(
    ("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"]
)
def test_signal_stops_after_the_batch_and_keeps_every_sample(tmp_path, reference, sig, code):
    proc = start(tmp_path)
    out = signal_after(proc, 2, sig)
    assert proc.returncode == code, out
    assert "Traceback" not in out
    with open_probe_file(tmp_path / "probe.h5") as f:
        assert f.attrs["complete"] == False  # noqa: E712 - written, not absent
        n = assert_prefix_of(reference[0], f, at_least=6)
        assert n < 30  # it stopped early
        assert (
            stats_file.read(f)["conv", "output"].stats.rows == n
        )  # the statistics were closed too
    assert f"after {n} samples" in out and "resume=true" in out
    if sig == signal.SIGINT:  # /stats were written on the way out: resume restores them
        assert_resume_gives_the_reference(tmp_path, reference)


def test_resume_refuses_another_config(tmp_path):
    run(make_cfg(*SLOW, "dataset.num_samples=6"), run_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"seed: 0 in the file, 1 now.*hydra.run.dir"):
        run(make_cfg(*SLOW, "dataset.num_samples=6", "resume=true", "seed=1"), run_dir=tmp_path)


def test_resume_of_a_complete_run_changes_no_value(tmp_path, reference):
    run(make_cfg(*SLOW), run_dir=tmp_path)
    result = run(make_cfg(*SLOW, "resume=true"), run_dir=tmp_path)
    assert result.num_samples == 30
    pd.testing.assert_frame_equal(result.summary, reference[1], check_exact=True)
    with h5py.File(result.h5_path) as f:
        assert f.attrs["complete"] and int(f.attrs.get("resumes", 0)) == 0  # nothing resumed
        got = arrays(f)
    for name, a in reference[0].items():
        np.testing.assert_array_equal(got[name], a, err_msg=name)


def test_resume_without_a_file_starts_a_new_run(tmp_path, reference):
    result = run(make_cfg(*SLOW, "resume=true"), run_dir=tmp_path)
    pd.testing.assert_frame_equal(result.summary, reference[1], check_exact=True)


@pytest.mark.parametrize(
    "store",
    [["store.mode=full"], ["store.mode=stats"], ["store.mode=full", "store.flush_seconds=3600"]],
    ids=["full", "stats", "deferred-flush"],
)
def test_in_process_stop_and_resume_with_parameter_gradients(tmp_path, store):
    """A real SIGINT from inside the 3rd forward; run() raises Interrupted, the previous handler
    is back, and resuming gives the uninterrupted file (per-batch param_grad rows included).
    With a deferred flush the stop still writes every batch: closing flushes."""
    from probe.testing.models import SignalsItself

    args = [*SLOW[:-2], "dataset.num_samples=10", "dataset.batch_size=3", *store]
    args[1] = "model._target_=probe.testing.models.SignalsItself"
    args[4] = "probes=param_grads"
    args.append("probes.params.capture=[output,grad_output,param_grad]")
    reference = run(make_cfg(*args), run_dir=tmp_path / "reference")
    before = signal.getsignal(signal.SIGINT)
    SignalsItself.at_call = 2
    try:
        with pytest.raises(Interrupted) as stopped:
            run(make_cfg(*args), run_dir=tmp_path / "run")
    finally:
        SignalsItself.at_call = None
    assert signal.getsignal(signal.SIGINT) is before
    assert stopped.value.num_samples == 9 and stopped.value.exit_code == 130
    with h5py.File(tmp_path / "run" / "probe.h5") as f:  # closed by the writer: attributes hold
        assert int(f.attrs["num_samples"]) == 9 and not f.attrs["complete"]
    result = run(make_cfg(*args, "resume=true"), run_dir=tmp_path / "run")
    pd.testing.assert_frame_equal(result.summary, reference.summary, check_exact=True)
    assert "param_grad.weight" in set(result.summary.site)
    with h5py.File(result.h5_path) as f, h5py.File(reference.h5_path) as g:
        got, want = arrays(f), arrays(g)
    assert got.keys() == want.keys()
    for name, a in want.items():
        np.testing.assert_array_equal(got[name], a, err_msg=name)


def test_statistics_count_only_the_batches_written(tmp_path):
    """A batch whose forward failed part-way was observed in the hooks but never written: the
    statistics closed into the file cover exactly its num_samples rows (a stats-only file has
    nothing else to resume from)."""
    import torch

    from probe.hooks.record import Record
    from probe.plan import StoreSpec
    from tests.helpers import counted, sink_of

    key, types = ("conv", "output"), {"conv": "Conv2d"}
    writer = sink_of(tmp_path / "probe.h5", StoreSpec(mode="stats"), module_types=types)
    first, second = torch.randn(2, 3, 4), torch.randn(2, 3, 4) + 100
    record = counted(Record(0, 2, 0, {key: first}), types)
    record.values[key] = first[:0]  # (a stats-only record: the layout alone)
    writer.put(record)
    counted(Record(2, 2, 1, {key: second}), types)  # the hooks saw it; never handed over
    writer.close(complete=False)
    with h5py.File(tmp_path / "probe.h5") as f:
        assert int(f.attrs["num_samples"]) == 2
        stored = stats_file.read(f)["conv", "output"].stats
    assert (stored.rows, stored.n) == (2, first.numel())
    np.testing.assert_allclose(stored.mean, first.double().mean().item(), rtol=1e-12)
