"""SIGKILLs test_interrupts leaves out: of a compressed file, and of a writer whose file another
process holds open for reading.

As there, every file left behind is compared value for value with an uninterrupted in-process run
of the same config: the rows /progress counts are that run's first rows, and a resumed file
equals it entirely.
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

import probe
from probe.errors import ProbeError
from probe.launch.run import run
from probe.store import runlock, swmr
from probe.store.fileformat import is_scale, read_progress, row_unit
from probe.store.runfile import NothingFlushed, is_partial, open_probe_file
from probe.testing.arrays import file_arrays
from probe.testing.compose import QUIET, make_cfg
from tests.helpers import ROOT
from tests.store.test_interrupts import SLOW, assert_prefix_of, signal_after, start

BATCH = 3  # SLOW's dataset.batch_size
REFERENCES: dict[str, tuple] = {}


def reference(tmp_path_factory, compression: str):
    """The uninterrupted in-process run with store.compression=`compression`: (arrays, summary)."""
    if compression not in REFERENCES:
        d = tmp_path_factory.mktemp(f"reference-{compression}")
        result = run(make_cfg(*SLOW, f"store.compression={compression}"), run_dir=d)
        with h5py.File(result.h5_path) as f:
            REFERENCES[compression] = file_arrays(f), result.summary
    return REFERENCES[compression]


def flushed_rows(f: h5py.File) -> dict:
    """Each captured or per-sample dataset (as file_arrays names them) read only as far as
    /progress counts its rows: what a kill must leave decodable."""
    progress, rows = read_progress(f), {}

    def take(name, obj):
        plain = name == "sample" or not is_scale(obj)
        if isinstance(obj, h5py.Dataset) and plain and name != "progress" and name[:6] != "stats/":
            rows[name] = obj[: progress.valid_rows(obj, name.rsplit("/", 1)[-1])]

    f.visititems(take)
    return rows


def assert_resumed_equals(run_dir, ref, *config) -> None:
    """resume=true in-process; the finished file's arrays and statistics and the summary equal
    the uninterrupted run's."""
    ref_arrays, ref_summary = ref
    result = run(make_cfg(*config, "resume=true"), run_dir=run_dir)
    with h5py.File(result.h5_path) as f:
        assert f.attrs["complete"] and int(f.attrs["resumes"]) == 1
        got = file_arrays(f)
    assert set(got) == set(ref_arrays)
    for name, a in got.items():
        assert a.dtype == ref_arrays[name].dtype, name
        np.testing.assert_array_equal(a, ref_arrays[name], err_msg=name)
    pd.testing.assert_frame_equal(result.summary, ref_summary, check_exact=True)


@pytest.mark.parametrize("compression", ["lzf", "gzip"])
def test_sigkill_of_a_compressed_run_keeps_every_flushed_batch(
    tmp_path, tmp_path_factory, compression
):
    """A compressed chunk holds one batch and is written once, whole: after a SIGKILL following
    the 3rd flushed batch, every row /progress counts decodes to the uninterrupted run's, and a
    resume finishes to that run's file."""
    ref = reference(tmp_path_factory, compression)
    setting = f"store.compression={compression}"
    proc = start(tmp_path, setting)
    out = signal_after(proc, 3, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL, out
    with open_probe_file(tmp_path / "probe.h5") as f:
        assert is_partial(f)
        n = read_progress(f).samples
        assert 3 * BATCH <= n < 30  # killed mid-run, after at least 3 flushed batches
        rows = flushed_rows(f)
        assert set(rows) == {k for k in ref[0] if not k.startswith("stats/")}
        for name, a in rows.items():
            assert len(a) == n, name  # probes=everything: every dataset has a row per sample
            np.testing.assert_array_equal(a, ref[0][name][:n], err_msg=name)
        compressed = {}
        for name in rows:
            ds = f[name]
            if ds.compression is not None and row_unit(ds.attrs, name) == "samples":
                compressed[name] = (ds.compression, ds.chunks[0])
    layers = {k for k in rows if k.startswith("layers/")}
    assert len(layers) == 6 and layers <= set(compressed)  # the captures are compressed
    assert set(compressed.values()) == {(compression, BATCH)}, compressed  # a batch per chunk
    assert_resumed_equals(tmp_path, ref, *SLOW, "+model.kwargs.delay=0.15", setting)


READER = r"""
import sys

import h5py
import numpy as np

from probe.store.fileformat import read_progress

f = None
for line in sys.stdin:
    command, arg = line.split()
    if command == "open":
        f = h5py.File(arg, "r", swmr=True)
        print("opened", flush=True)
    else:  # read OUT.npz: the captures' flushed rows, as this reader sees them
        progress = read_progress(f)
        rows = {}
        for name in ("conv", "relu", "fc"):
            for site in ("input", "output"):
                ds = f[f"layers/{name}/{site}"]
                ds.refresh()
                rows[f"{name}.{site}"] = ds[: progress.valid_rows(ds, site)]
        np.savez(arg, **rows)
        print(progress.samples, flush=True)
if f is not None:
    f.close()
"""


def test_sigkill_while_a_reader_holds_the_file_open(tmp_path, tmp_path_factory):
    """A second process holds probe.h5 open (h5py, swmr=True) from the first flushed batch on;
    the writer is SIGKILLed mid-run. The reader still reads the flushed rows, the file opens
    with them equal to the uninterrupted run's, and a resume (the reader still open) finishes
    to that run's file."""
    ref = reference(tmp_path_factory, "none")
    delay = "+model.kwargs.delay=0.4"  # 10 batches: time for the reader to open it mid-run
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HYDRA_FULL_ERROR", None)
    reader = subprocess.Popen(
        [sys.executable, "-c", READER], cwd=ROOT, env=env, text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    writer = subprocess.Popen(
        [sys.executable, "-m", "probe", *QUIET, *SLOW, delay, "hydra.verbose=probe",
         f"hydra.run.dir={tmp_path}"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    h5 = tmp_path / "probe.h5"
    try:
        seen, opened = [], False
        for line in writer.stdout:
            seen.append(line)
            if "flushed batch " not in line:
                continue
            if not opened:  # the file is in SWMR mode from the first flush on
                reader.stdin.write(f"open {h5}\n")
                reader.stdin.flush()
                assert reader.stdout.readline().strip() == "opened", reader.stderr.read()
                opened = True
            elif int(line.split("flushed batch ")[1].split()[0]) >= 2:
                writer.kill()
                break
        seen.append(writer.stdout.read())
        writer.wait(timeout=120)
        assert writer.returncode == -signal.SIGKILL, "".join(seen)

        reader.stdin.write(f"read {tmp_path / 'seen.npz'}\n")
        reader.stdin.flush()
        answer = reader.stdout.readline()
        assert answer.strip().isdigit(), reader.stderr.read()
        n = int(answer)
        assert 3 * BATCH <= n < 30
        with np.load(tmp_path / "seen.npz") as got:
            assert len(got.files) == 6
            for key in got.files:
                name = "layers/" + key.replace(".", "/")
                np.testing.assert_array_equal(got[key], ref[0][name][:n], err_msg=name)

        with open_probe_file(h5) as f:  # while the reader still holds it
            assert is_partial(f)
            assert read_progress(f).samples == n
            assert_prefix_of(ref[0], f, at_least=n)
        assert_resumed_equals(tmp_path, ref, *SLOW, delay)
        assert reader.poll() is None  # it held the file open throughout
    finally:
        if writer.poll() is None:
            writer.kill()
        reader.stdin.close()
        try:
            reader.wait(timeout=60)
        except subprocess.TimeoutExpired:
            reader.kill()
            reader.wait()


def _flags_of_a_plain_writer(path) -> None:
    """The superblock flags a writer killed while it held the file plainly open leaves: write
    access without SWMR (before its first flush, or while it wrote its closing counts)."""
    with open(path, "r+b") as fh:
        head = bytearray(fh.read(64))
        size, end = swmr._superblock(bytes(head))
        head[11] = 0x01
        head[end : end + 4] = swmr.lookup3(bytes(head[:end])).to_bytes(4, "little")
        fh.seek(0)
        fh.write(head[: end + 4])


@pytest.mark.parametrize("complete", [True, False], ids=["complete", "stopped"])
def test_a_writer_killed_in_a_plain_open_leaves_a_file_readers_open(tmp_path, complete):
    """Killed while closing (a finished run's last plain open): no reader could open the file,
    and it was called empty ("holds no batch; overwrite=true replaces it"). A reader now clears
    the dead writer's flags, as resume does, and reads every row."""
    if complete:
        result = run(make_cfg(*SLOW), run_dir=tmp_path)
    else:  # the model raises in its third batch: two batches flushed
        raises = ["model._target_=probe.testing.models.Raises", "+model.kwargs.ok_calls=2"]
        with pytest.raises(ProbeError):
            run(make_cfg(*SLOW, *raises), run_dir=tmp_path)
    path = tmp_path / "probe.h5"
    with h5py.File(path) as f:
        before, progress = file_arrays(f), read_progress(f)
    _flags_of_a_plain_writer(path)
    (tmp_path / runlock.LOCK_NAME).write_text("")  # the killed run's lock file, held by no one
    with pytest.raises(OSError, match="open for write"):
        h5py.File(path, "r")
    with open_probe_file(path) as f:
        after = file_arrays(f)
        assert read_progress(f) == progress and progress.complete == complete
    assert sorted(after) == sorted(before)
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)
    if complete:
        pd.testing.assert_frame_equal(probe.open_run(tmp_path).summary, result.summary)


def test_a_writer_killed_before_its_first_flush_leaves_a_file_said_empty(tmp_path):
    """The same flags on a file whose /progress counts nothing: a reader says it holds no batch,
    and only then."""
    from tests.helpers import sink_of

    path = tmp_path / "probe.h5"
    sink_of(path, module_types={"conv": "Conv2d"}).close(complete=False)
    _flags_of_a_plain_writer(path)
    (tmp_path / runlock.LOCK_NAME).write_text("")
    with pytest.raises(NothingFlushed, match="holds no batch"):
        open_probe_file(path)
    os.remove(tmp_path / runlock.LOCK_NAME)  # no lock file: not a run of probe's, left alone
    _flags_of_a_plain_writer(path)
    with pytest.raises(NothingFlushed, match="python -m probe.store.swmr"):
        open_probe_file(path)
    assert swmr.open_for_write(path)
