"""Files readable while they are written, self-describing (named dimensions, labelled statistics,
provenance), right-sized, and still readable in the previous format version."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

import probe
from probe.errors import ConfigError
from probe.hooks.record import Record
from probe.launch.run import run
from probe.plan import StoreSpec
from probe.read.summaries import summarize_file
from probe.stats import backend
from probe.stats.running import SCALARS, UNIT_FIELDS, stats_for
from probe.store import stats_file
from probe.store.fileformat import FORMAT_VERSION, decode, encode, read_progress
from probe.store.runfile import open_probe_file
from probe.testing.arrays import file_arrays, h5_arrays
from probe.testing.compose import QUIET, make_cfg
from tests.helpers import ROOT, cli, counted, image_folder, run_interrupted, sink_of
from tests.store.test_interrupts import SLOW as INTERRUPTED_SLOW

DATA = Path(__file__).parent / "format1"
SLOW = [*INTERRUPTED_SLOW[:-2], "dataset.num_samples=36", "dataset.batch_size=3"]


def start(run_dir: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "probe", *QUIET, *SLOW, *extra, f"hydra.run.dir={run_dir}"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_second_process_reads_every_flushed_batch_while_the_run_writes(tmp_path):
    """h5py (SWMR), probe.open_run with refresh() and probe.read.summaries, every few batches: what
    they see is the finished file's first rows, and the file is "in progress", never damaged."""
    gate = (
        tmp_path / "hold"
    )  # while it exists the run waits: the summarizer surely reads it mid-way
    proc = start(tmp_path, "+model.kwargs.delay=0.6", f"+model.kwargs.hold={gate}")
    h5 = tmp_path / "probe.h5"
    seen, summarized = [], None
    opened = None
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.3)
        if not h5.exists():
            continue
        try:
            opened = opened.refresh() if opened is not None else probe.open_run(tmp_path)
        except probe.DataError as e:  # before the first flush: says so
            assert "in progress" in str(e) and "no batch is flushed yet" in str(e)
            continue
        if opened.state == "complete":
            break
        assert opened.state == "in progress"
        n = opened.num_samples
        seen.append((n, opened.array("conv", "output")[:n], opened.array("fc", "input")[:n]))
        with h5py.File(h5, "r", swmr=True) as f:  # plain h5py too, as the docs say
            assert read_progress(f).samples >= n
        if summarized is None and n >= 6:
            gate.touch()
            summarized = subprocess.Popen(
                [sys.executable, "-m", "probe.summarize", str(tmp_path)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )
            said, complaints = summarized.communicate(timeout=120)
            gate.unlink()
    assert proc.wait(timeout=120) == 0, proc.stderr.read()
    assert summarized is not None
    opened.close()
    assert len(seen) >= 2 and seen[0][0] < 36  # snapshots while it ran (a busy machine: few)
    with probe.open_run(tmp_path) as final:
        assert final.state == "complete" and final.num_samples == 36
        conv, fc = final.array("conv", "output")[:], final.array("fc", "input")[:]
    for n, a, b in seen:
        np.testing.assert_array_equal(a, conv[:n])
        np.testing.assert_array_equal(b, fc[:n])
    assert summarized.returncode == 0, complaints
    assert "in progress" in complaints and "damaged" not in complaints
    assert "conv" in said  # the table of the rows so far, printed


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    d = tmp_path_factory.mktemp("finished")
    return run(make_cfg(*SLOW), run_dir=d)


def test_xarray_sees_named_dimensions_and_the_sample_coordinate(finished):
    xr = pytest.importorskip("xarray")
    pytest.importorskip("h5netcdf")
    path = finished.h5_path
    conv = xr.open_dataset(path, group="layers/conv", engine="h5netcdf")
    assert conv["output"].dims == ("sample", "channel", "height", "width")
    assert conv["input"].dims == ("sample", "input_channel", "input_height", "input_width")
    fc = xr.open_dataset(path, group="layers/fc", engine="h5netcdf")
    assert fc["input"].dims == ("sample", "input_feature") and fc["output"].dims[1] == "feature"
    root = xr.open_dataset(path, engine="h5netcdf")
    np.testing.assert_array_equal(root["sample"].values, np.arange(36))
    with h5py.File(path) as f:
        np.testing.assert_array_equal(conv["output"].values, f["layers/conv/output"][:])
    with probe.open_run(finished.run_dir) as r:
        da = r.xarray("conv", "output")
        assert da.dims == ("sample", "channel", "height", "width")
        np.testing.assert_array_equal(da["sample"].values, np.arange(36))
        np.testing.assert_array_equal(da["target"].values, r.file["samples/target"][:])
        part = r.xarray("conv", "output", rows=slice(3, 9))
        np.testing.assert_array_equal(part.values, r.array("conv", "output")[3:9])
        np.testing.assert_array_equal(part["sample"].values, np.arange(3, 9))


def test_the_documented_reads_share_one_process_in_either_order(finished):
    """docs/format.md's sequence in one process on a finished run: probe.open_run, refresh, then
    h5py.File(path, "r", swmr=True) while the run is open (HDF5 refuses a second open with another
    SWMR flag unless the first is a SWMR one), then the plain open of a finished run; and the
    opposite orders. Each sees the rows the run reads."""
    path = finished.h5_path
    run = probe.open_run(finished.run_dir)
    run.refresh()
    want = run.array("conv", "output")[:]
    with h5py.File(path, "r", swmr=True) as f:
        n = f["progress"][()]["samples"]
        np.testing.assert_array_equal(f["layers/conv/output"][:n], want)
    with h5py.File(path) as f:
        assert f.attrs["complete"]
        np.testing.assert_array_equal(f["layers/conv/output"][:], want)
    assert n == run.num_samples == 36 and run.state == "complete"
    run.close()
    for swmr in (True, False):
        with h5py.File(path, "r", swmr=swmr) as f, probe.open_run(finished.run_dir) as run:
            np.testing.assert_array_equal(run.array("conv", "output")[:], want)
            np.testing.assert_array_equal(f["layers/conv/output"][:], want)
            assert run.refresh().num_samples == 36


def test_stats_decode_from_their_field_names_alone(finished):
    """A reader that knows only HDF5 and the field names in the file gets the summary's values."""
    summary = finished.summary.set_index(["layer", "site"])
    with h5py.File(finished.h5_path) as f:
        slot = int(f["progress"][()]["stats_slot"])
        for layer, group in f["stats"].items():
            for site, g in group.items():
                scalars = g["scalars"][slot]
                assert set(scalars.dtype.names) >= set(SCALARS)
                n, mean, m2 = scalars["n"], scalars["mean"], scalars["m2"]
                row = summary.loc[(layer, site)]
                assert n == row["n"] and scalars["rows"] == row["rows"] == 36
                assert mean == pytest.approx(row["mean"], rel=1e-12)
                assert np.sqrt(m2 / n) == pytest.approx(row["std"], rel=1e-12)
                units = g["units"][slot]
                assert units.dtype.names == UNIT_FIELDS
                assert units["count"].sum() == n  # every finite value belongs to one unit
                buckets = g["hist"][slot, : scalars["buckets"]]
                assert buckets["count"].sum() == n and buckets.dtype.names == ("bucket", "count")
                raw = f[f"layers/{layer}/{site}"][:].astype(np.float64)
                assert scalars["min"] == raw.min() and scalars["max"] == raw.max()


def test_a_kill_inside_a_stats_flush_leaves_the_previous_slot(tmp_path):
    """Two slots and a pointer written last: a slot torn mid-write is never read."""
    writer_file = tmp_path / "probe.h5"
    key = ("conv", "output")
    x1 = torch.randn(4, 3, 2, 2)
    w = sink_of(writer_file, StoreSpec(mode="stats"), module_types={"conv": "Conv2d"})
    w.put(counted(Record(0, 4, 0, {key: x1}), {"conv": "Conv2d"}))
    w.close(complete=False)
    with h5py.File(writer_file, "r+") as f:
        slot = int(f["progress"][()]["stats_slot"])
        other = 1 - slot
        torn = f["stats/conv/output/scalars"][other]
        torn["n"], torn["mean"] = 10**9, 12345.0  # half a later flush, never pointed at
        f["stats/conv/output/scalars"][other] = torn
    with open_probe_file(writer_file) as f:
        got = stats_file.read(f)[key].stats
    want = stats_for("Conv2d", "output")
    backend.fold(want, x1.numpy())
    assert got.as_row() == pytest.approx(want.as_row(), rel=1e-12, nan_ok=True)


class Branchy(nn.Module):
    """`rare` runs only for batches whose first input value is positive (data-dependent)."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.rare = nn.Conv2d(4, 4, 1)
        self.parts = nn.ModuleDict({"a/b": nn.ReLU(), "c%2Fd": nn.Tanh()})
        self.fc = nn.Linear(4 * 8 * 8, num_classes)

    def forward(self, x):
        h = self.conv(x)
        if x[0, 0, 0, 0] > 0:
            h = self.rare(h)
        h = self.parts["c%2Fd"](self.parts["a/b"](h))
        return self.fc(h.flatten(1))


BRANCHY = [
    "model=custom",
    "model._target_=tests.store.test_live_files.Branchy",
    "model.input_shape=[3,8,8]",
    "model.num_classes=10",
    "probes=everything",
    "dataset.num_samples=24",
    "dataset.batch_size=3",
]


def test_a_module_that_skips_batches_is_marked_not_zero_and_names_round_trip(tmp_path, caplog):
    result = run(make_cfg(*BRANCHY), run_dir=tmp_path)
    with probe.open_run(tmp_path) as r:
        assert set(r.layers) == {"conv", "rare", "parts.a/b", "parts.c%2Fd", "fc"}
        seen = r.seen("rare", "output")
        rare = r.array("rare", "output")[:]
        conv = r.array("conv", "output")[:]
        inputs = r.array("conv", "input")[:]
        relu = r.array("parts.a/b", "output")[:]
    ran = inputs[::3, 0, 0, 0] > 0  # the branch is decided per batch by its first sample
    assert 0 < ran.sum() < 8
    np.testing.assert_array_equal(seen, np.repeat(ran, 3))
    assert np.isnan(rare[~seen]).all() and not np.isnan(rare[seen]).any()
    np.testing.assert_array_equal(relu, np.maximum(relu, 0))
    table = result.summary.set_index(["layer", "site"])
    assert table.loc[("rare", "output"), "rows"] == seen.sum()
    want = stats_for("Conv2d", "output")
    for lo in range(0, 24, 3):
        if seen[lo]:
            backend.fold(want, rare[lo : lo + 3])
    assert table.loc[("rare", "output"), "mean"] == pytest.approx(want.as_row()["mean"], rel=1e-5)
    assert "did not run for every batch" in caplog.text and "rare output" in caplog.text
    again = summarize_file(result.h5_path).table.set_index(["layer", "site"])
    assert again.loc[("rare", "output"), "rows"] == seen.sum()
    assert again.loc[("rare", "output"), "mean"] == pytest.approx(
        table.loc[("rare", "output"), "mean"], rel=1e-6
    )
    np.testing.assert_array_equal(conv.shape, (24, 4, 8, 8))
    # the summary tables name the layers as the model does, '/' and '%2F' included
    written = pd.read_csv(tmp_path / "summary.csv")
    (tmp_path / "summary.csv").unlink()
    done = subprocess.run(
        [sys.executable, "-m", "probe.summarize", str(tmp_path)], cwd=ROOT, capture_output=True,
        text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    summarized = pd.read_csv(tmp_path / "summary.csv")
    names = {"conv", "rare", "parts.a/b", "parts.c%2Fd", "fc"}
    for found in (again.reset_index(), written, summarized):
        assert set(found.layer) == names
        rows = found.set_index(["layer", "site"])
        for layer in ("parts.a/b", "parts.c%2Fd"):
            for site in ("input", "output"):
                want = table.loc[(layer, site)]
                assert rows.loc[(layer, site), "rows"] == want["rows"] == 24
                assert rows.loc[(layer, site), "mean"] == pytest.approx(want["mean"], rel=1e-6)
    relu_mean = relu.astype(np.float64).mean()  # the values under each name are its own
    assert table.loc[("parts.a/b", "output"), "mean"] == pytest.approx(relu_mean, rel=1e-6)
    assert table.loc[("parts.c%2Fd", "input"), "mean"] == pytest.approx(relu_mean, rel=1e-6)


def test_names_encode_reversibly():
    for name in ["a/b", ".", "..", "", "x%2Fy", "plain.name", "/lead/trail/"]:
        assert decode(encode(name)) == name
        assert "/" not in encode(name) and encode(name) not in (".", "..", "")


def test_a_tiny_run_file_stays_near_its_data_size(tmp_path):
    """lenet over 64 samples: chunks sized to the run, not to 1 MiB per dataset."""
    result = run(make_cfg("model=lenet", "probes=everything", "dataset.num_samples=64"), tmp_path)
    with h5py.File(result.h5_path) as f:
        data = sum(
            f[f"layers/{layer}/{site}"].nbytes
            for layer, site in result.summary[["layer", "site"]].itertuples(index=False)
        )
    size = result.h5_path.stat().st_size
    assert size < 1.5 * data, (size, data)


def test_files_of_format_version_1_are_still_read():
    """Files written by the release before this format (full and stats-only, lenet)."""
    for kind in ("full", "stats"):
        path = DATA / f"{kind}.h5"
        with h5py.File(path) as f:
            assert int(f.attrs["format_version"]) == 1
        want = pd.read_csv(DATA / f"{kind}_summary.csv")
        got = summarize_file(path).table
        assert summarize_file(path).state == "complete"
        pd.testing.assert_frame_equal(
            got.reset_index(drop=True), want, check_dtype=False, rtol=1e-12
        )
        with probe.open_run(path) as r:
            assert r.complete and r.num_samples == 8 and r.layers[0] == want.layer[0]
            if kind == "full":
                assert r.array(want.layer[0], want.site[0]).shape[0] == 8
    assert FORMAT_VERSION == 2


def test_the_file_records_the_dataset_and_refuses_a_changed_checkpoint(tmp_path):
    ckpt = tmp_path / "weights.pt"
    torch.manual_seed(1)
    from probe.testing.models import TinyNet

    torch.save(TinyNet().state_dict(), ckpt)
    args = [*SLOW, f"model.checkpoint={ckpt}", "dataset.num_samples=9"]
    run(make_cfg(*args), run_dir=tmp_path / "run")
    with h5py.File(tmp_path / "run" / "probe.h5") as f:
        identity = json.loads(f.attrs["dataset_identity"])
        assert identity["dataset"] == "synthetic" and identity["hash_of"] == "parameters"
        recorded = f.attrs["checkpoint_sha256"]
    import hashlib

    assert recorded == hashlib.sha256(ckpt.read_bytes()).hexdigest()
    torch.manual_seed(2)
    torch.save(TinyNet().state_dict(), ckpt)  # same path, other weights
    with pytest.raises(ConfigError, match="contents of model.checkpoint changed"):
        run(make_cfg(*args, "resume=true"), run_dir=tmp_path / "run")


def save_samples(path: Path, g: torch.Generator) -> None:
    """12 random 3x8x8 inputs and their targets, as dataset=tensors reads them."""
    torch.save(
        {"inputs": torch.randn(12, 3, 8, 8, generator=g), "targets": torch.arange(12) % 10}, path
    )


def test_resume_refuses_a_dataset_file_whose_contents_changed(tmp_path):
    """A dataset=tensors run stopped after 3 of 4 batches; the .pt file is saved again at the
    same path with other values: resume=true exits 2 naming the dataset's contents (and the hash
    stored in the file), and the file's arrays and counts are as they were."""
    from probe.data.provenance import file_identity

    data = tmp_path / "data.pt"
    g = torch.Generator().manual_seed(0)
    save_samples(data, g)
    args = [*SLOW[:-2], "model._target_=probe.testing.models.SignalsItself", "dataset=tensors",
            f"dataset.path={data}", "dataset.batch_size=3"]  # fmt: skip
    run_interrupted(tmp_path / "run", 2, *args)
    h5 = tmp_path / "run" / "probe.h5"
    before = h5_arrays(h5)
    with open_probe_file(h5) as f:
        assert read_progress(f).samples == 9
        stored = json.loads(f.attrs["dataset_identity"])
    assert stored["hash"] == file_identity(data)["hash"] and stored["hash_of"] == "content"
    save_samples(data, g)
    now = file_identity(data)["hash"]
    out = cli(*args, "resume=true", f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    message = out.stderr.strip().splitlines()[-1]
    assert message.startswith("probe: error: resume=true but the contents of the dataset changed")
    assert f"(dataset_identity: {stored['hash'][:16]}... in the file, {now[:16]}... now)" in message
    after = h5_arrays(h5)
    assert after.keys() == before.keys() and len(after) > 6
    for name, a in before.items():
        np.testing.assert_array_equal(after[name], a, err_msg=name)
    with open_probe_file(h5) as f:
        assert read_progress(f).samples == 9 and not f.attrs["complete"]
        assert json.loads(f.attrs["dataset_identity"]) == stored


def test_an_imagefolder_run_writes_each_sample_path_and_the_class_names(tmp_path):
    """/samples/path holds each row's image path relative to the root, in the order of
    torchvision's ImageFolder listing, /samples/target its class, /dataset/class_names its
    classes."""
    from torchvision.datasets import ImageFolder

    root = image_folder(tmp_path / "images", size=8)
    args = [*SLOW[:-2], "dataset=imagefolder", f"dataset.root={root}", "dataset.resize=8",
            "dataset.crop=8", "dataset.batch_size=2"]  # fmt: skip
    run(make_cfg(*args), run_dir=tmp_path / "run")
    truth = ImageFolder(str(root))
    want = [Path(os.path.relpath(p, root)).as_posix() for p, _ in truth.samples]
    assert "cat/deep/two.png" in want and len(want) == 5
    with h5py.File(tmp_path / "run" / "probe.h5") as f:
        assert f["samples/path"].asstr()[:].tolist() == want
        assert f["samples/index"][:].tolist() == list(range(5))
        assert f["samples/target"][:].tolist() == [t for _, t in truth.samples]
        assert f["dataset/class_names"].asstr()[:].tolist() == truth.classes
        assert json.loads(f.attrs["dataset_identity"])["images"] == 5
    assert truth.classes == ["ant", "cat", "zebra"]


def test_a_text_run_writes_each_sample_document_id(tiny_gpt2, tmp_path):
    """/samples/document holds each row's document id as the .jsonl gives it (its "id", else
    "<file>:<line>"), and the tokens of that row are that document's."""
    from transformers import AutoTokenizer

    model, tokenizer = tiny_gpt2
    docs = [("the cat sat on the mat", "doc-a"), ("a dog ran", None), ("big red hat", 7),
            ("one two three four five six seven eight nine", "last")]  # fmt: skip
    lines = [json.dumps({"text": t} | ({} if i is None else {"id": i})) for t, i in docs]
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(lines[:1] + [""] + lines[1:]) + "\n")  # a blank line 2
    text_of = {}
    for number, line in enumerate(path.read_text().split("\n"), start=1):
        if line:
            record = json.loads(line)
            text_of[str(record.get("id", f"docs.jsonl:{number}"))] = record["text"]
    assert list(text_of) == ["doc-a", "docs.jsonl:3", "7", "last"]
    run(make_cfg("model=hf", f"model.name={model}", "model.task=causal_lm", "dataset=text",
                 f"dataset.path={path}", f"dataset.tokenizer={tokenizer}", "dataset.seq_len=8",
                 "dataset.batch_size=3", "probes=residual"), run_dir=tmp_path / "run")  # fmt: skip
    tok = AutoTokenizer.from_pretrained(tokenizer)
    with h5py.File(tmp_path / "run" / "probe.h5") as f:
        names = f["samples/document"].asstr()[:].tolist()
        token_ids, token_sample = f["tokens/id"][:], f["tokens/sample"][:]
    assert names == list(text_of)
    for i, name in enumerate(names):
        assert token_ids[token_sample == i].tolist() == tok.encode(text_of[name])[:8], name


def test_effects_after_a_resume_count_every_batch(tmp_path):
    """effects.csv of a run stopped and resumed equals an uninterrupted run's: the file keeps
    each batch's effect sums."""

    edit = ["intervene=edit", "intervene.edit.layers=[relu]", "intervene.edit.op=zero"]
    args = [*SLOW, "dataset.num_samples=12", *edit]
    run(make_cfg(*args), run_dir=tmp_path / "whole")
    stopped = [*args, "model._target_=probe.testing.models.SignalsItself"]
    run_interrupted(
        tmp_path / "cut", 5, *stopped
    )  # a clean and an edited forward per batch: inside the third batch
    run(make_cfg(*stopped, "resume=true"), run_dir=tmp_path / "cut")
    whole = pd.read_csv(tmp_path / "whole" / "effects.csv")
    resumed = pd.read_csv(tmp_path / "cut" / "effects.csv")
    assert resumed.samples[0] == 12
    pd.testing.assert_frame_equal(resumed, whole, rtol=1e-12)


def test_a_resume_killed_before_its_first_batch_leaves_a_readable_file(tmp_path):
    """The resumed file enters SWMR mode before its first batch: a kill then leaves every row
    of the earlier run readable, and another resume finishes it equal to an uninterrupted run."""

    stopped = [*SLOW, "model._target_=probe.testing.models.SignalsItself"]
    run_interrupted(tmp_path, 4, *stopped)
    proc = subprocess.Popen(
        [sys.executable, "-m", "probe", *QUIET, *stopped, "+model.kwargs.delay=0.5",
         "resume=true", "hydra.verbose=probe", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    for line in proc.stdout:
        if "resuming" in line:
            proc.kill()
            break
    proc.wait(timeout=60)
    with open_probe_file(tmp_path / "probe.h5") as f:
        assert read_progress(f).samples == 15
    whole = run(make_cfg(*SLOW), run_dir=tmp_path / "whole")
    resumed = run(make_cfg(*stopped, "resume=true"), run_dir=tmp_path)
    pd.testing.assert_frame_equal(resumed.summary, whole.summary, check_exact=True)
    with open_probe_file(resumed.h5_path) as a, open_probe_file(whole.h5_path) as b:
        got, want = file_arrays(a), file_arrays(b)
    for name, array in want.items():
        np.testing.assert_array_equal(got[name], array, err_msg=name)


def test_a_live_runs_file_that_looks_cut_short_is_read_once_its_writer_settles(tmp_path):
    """While a live run holds the directory, a file that looks cut short (its writer extending
    or closing it) is tried again: read once whole; one that stays cut short is named so, after
    SETTLE_SECONDS; without a live run at once."""
    import threading

    from probe.store import runfile, runlock

    cfg = make_cfg("dataset.num_samples=4", "dataset.batch_size=2")
    run(cfg, run_dir=tmp_path / "done")
    whole = (tmp_path / "done" / "probe.h5").read_bytes()
    live = tmp_path / "live"
    live.mkdir()
    h5 = live / "probe.h5"
    h5.write_bytes(whole[: len(whole) // 2])
    with runlock.hold(live):
        threading.Timer(0.3, h5.write_bytes, [whole]).start()  # the writer settles
        with runfile.open_probe_file(h5) as f:
            assert f.attrs["complete"] and int(f.attrs["num_samples"]) == 4
        h5.write_bytes(whole[: len(whole) // 2])
        started = time.monotonic()
        with pytest.raises(probe.DataError, match="cut short"):
            runfile.open_probe_file(h5)
        assert time.monotonic() - started >= runfile.SETTLE_SECONDS
    started = time.monotonic()
    with pytest.raises(probe.DataError, match="cut short"):
        runfile.open_probe_file(h5)
    assert time.monotonic() - started < runfile.SETTLE_SECONDS
