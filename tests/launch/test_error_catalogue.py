"""One test per entry of docs/errors.md: exit code, the key words of the message, no traceback,
no hook left on the model, and the rows written before a mid-run failure still readable and equal
to an uninterrupted run's.

Most entries call the real console entry point (`probe.__main__.main`, Hydra composition included)
in this process, so the model objects can be inspected afterwards and the suite stays fast; the
disk-full entry needs its own process for its file size limit. Entries already covered by
tests/launch/test_cli.py (unknown names, a glob matching nothing, a missing dataset.path, batch_size=0, a
checkpoint of another architecture, an unwritable run directory) are not repeated here.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import h5py
import numpy as np
import pytest
import torch
from PIL import Image

from probe.errors import DataError
from probe.launch.run import run
from probe.store.fileformat import is_scale
from probe.store.runfile import is_partial, open_probe_file
from probe.testing.compose import QUIET, make_cfg
from tests.helpers import ROOT

TINY = [
    "model=custom",
    "model.input_shape=[3,8,8]",
    "model.num_classes=10",
    "dataset.num_samples=6",
    "dataset.batch_size=2",
]
TINYNET = [*TINY, "model._target_=probe.testing.models.TinyNet", "probes=everything"]


def assert_words(text: str, *words: str) -> None:
    for w in words:
        assert w in text, f"{w!r} not in:\n{text}"


def stored(path) -> dict[str, np.ndarray]:
    with open_probe_file(path) as f:
        assert is_partial(f)
        n = int(f.attrs["num_samples"])
        out = {}
        f["layers"].visititems(  # a dimension scale names an axis: it holds no rows
            lambda k, o: (
                out.__setitem__(k, o[()])
                if isinstance(o, h5py.Dataset) and not is_scale(o)
                else None
            )
        )
    assert all(len(a) == n for a in out.values())
    return out


def assert_prefix_of_clean_run(tmp_path, got: dict, *overrides: str) -> None:
    """The rows a failed run kept equal the first rows of a clean run of `overrides`."""
    result = run(make_cfg(*overrides), run_dir=tmp_path / "clean")
    with h5py.File(result.h5_path) as f:
        for name, a in got.items():
            np.testing.assert_array_equal(a, f[f"layers/{name}"][: len(a)], err_msg=name)


# -- config values -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["seed=abc"], ["seed", "abc", "Integer"]),
        (["train_mode=maybe"], ["train_mode", "maybe", "not a valid bool"]),
        (["dataset.num_samples=1.5"], ["num_samples", "1.5"]),
        (["store.mode=everything"], ["store.mode", "Invalid value 'everything'", "full, stats"]),
        (["device=gpu"], ["device='gpu'", "cpu, cuda"]),
    ],
    ids=["seed", "train_mode", "num_samples", "store.mode", "device"],
)
def test_wrong_type_or_value(cli_here, args, words):
    code, text = cli_here(*TINYNET, *args)
    assert code in (1, 2)
    assert_words(text, *words)


GRADS = "probes.everything.capture=[output,grad_output]"


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["dataset.image_size=0"], ["dataset.image_size=0 must be at least 1"]),
        (["dataset.channels=0"], ["dataset.channels=0 must be at least 1"]),
        (["dataset=imagefolder"], ["dataset=imagefolder needs dataset.root=DIR"]),
        (["dataset=tensors"], ["dataset=tensors needs dataset.path=FILE"]),
        (
            ["store.compression=gzip", "store.compression_level=99"],
            ["store.compression_level=99", "0-9"],
        ),
        (["objective=logit", GRADS], ["objective=logit needs", "objective.index=K"]),
        (["objective=custom", GRADS], ["objective._target_ is missing"]),
        (
            ["intervene=edit", "intervene.edit.layers=[conv]", "intervene.edit.op=mean",
             "intervene.edit.source=/nonexistent/probe.h5"],
            ["source='/nonexistent/probe.h5' is not a file", "source=first_pass"],
        ),
    ],
    ids=["image_size", "channels", "root", "path", "gzip-level", "logit", "objective-target",
         "mean-source"],
)  # fmt: skip
def test_missing_or_impossible_value(cli_here, tmp_path, args, words):
    code, text = cli_here(*TINYNET, *args)
    assert code == 2, text
    assert_words(text, *words)
    assert not (tmp_path / "run" / "probe.h5").exists()  # refused before any file


def test_labels_beyond_the_model_outputs(cli_here):
    """Synthetic labels are drawn below model.num_classes (1000 by default); TinyNet has 10."""
    code, text = cli_here(*TINYNET, "model.num_classes=1000", GRADS)
    assert code == 2
    assert_words(text, "out of range for a model output of 10 classes", "model.num_classes=10")


def test_custom_model_without_its_class(cli_here):
    code, text = cli_here(*TINY, "probes=everything")
    assert code == 2
    assert_words(text, "model._target_ is missing", "model._target_=")


def test_site_a_module_cannot_provide(cli_here):
    code, text = cli_here(
        *TINY,
        "model._target_=probe.testing.models.KeywordOnly",
        "probes=everything",
        "probes.everything.layers=[inner]",
    )
    assert code == 2
    assert_words(text, "'inner'", "no positional input", "use the output site")


# -- datasets ------------------------------------------------------------------------------------
def test_dataset_path_is_a_directory(cli_here, tmp_path):
    code, text = cli_here(*TINYNET, "dataset=tensors", f"dataset.path={tmp_path}")
    assert code == 2
    assert_words(text, str(tmp_path), "is a directory", ".pt file")


def test_dataset_path_that_is_not_a_pt_file(cli_here, tmp_path):
    bad = tmp_path / "inputs.pt"
    bad.write_bytes(b"\x00not a torch file" * 10)
    code, text = cli_here(*TINYNET, "dataset=tensors", f"dataset.path={bad}")
    assert code == 2
    assert_words(text, str(bad), "not a readable .pt file", "torch.save")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_dataset_path_without_read_permission(cli_here, tmp_path):
    bad = tmp_path / "inputs.pt"
    torch.save(torch.zeros(2, 3, 8, 8), bad)
    bad.chmod(0)
    code, text = cli_here(*TINYNET, "dataset=tensors", f"dataset.path={bad}")
    assert code == 2
    assert_words(text, str(bad), "permission denied")


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ([torch.zeros(2, 3, 8, 8)], ["holds a list", "'inputs'"]),
        ({"x": torch.zeros(2, 3, 8, 8)}, ["holds a dict with keys ['x']", "'inputs'"]),
        (
            {"inputs": torch.zeros(4, 3, 8, 8), "targets": torch.zeros(3)},
            ["4 inputs but 3 targets"],
        ),
    ],
    ids=["list", "dict-without-inputs", "targets-length"],
)
def test_pt_file_of_the_wrong_structure(cli_here, tmp_path, content, words):
    path = tmp_path / "inputs.pt"
    torch.save(content, path)
    code, text = cli_here(*TINYNET, "dataset=tensors", f"dataset.path={path}")
    assert code == 2
    assert_words(text, str(path), *words)


def _image(path, color) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (12, 12), color).save(path)


IMAGEFOLDER = ["dataset=imagefolder", "dataset.resize=8", "dataset.crop=8"]


@pytest.mark.parametrize("layout", ["empty", "no-images"])
def test_imagefolder_with_no_images(cli_here, tmp_path, layout):
    root = tmp_path / "images"
    (root / "cats").mkdir(parents=True)
    if layout == "no-images":
        (root / "cats" / "notes.txt").write_text("not an image")
    code, text = cli_here(*TINYNET, *IMAGEFOLDER, f"dataset.root={root}")
    assert code == 2
    assert_words(text, str(root), "holds no images", "ROOT/<class>/<image>")


def test_imagefolder_with_a_broken_image_keeps_the_batches_before_it(cli_here, tmp_path):
    root = tmp_path / "images"
    for i, color in enumerate(["red", "green", "blue", "white"]):
        _image(root / "a" / f"{i}.png", color)
    (root / "b").mkdir()
    (root / "b" / "broken.png").write_bytes(b"\x89PNG but cut short")
    code, text = cli_here(*TINYNET, *IMAGEFOLDER, f"dataset.root={root}")
    assert code == 2
    assert_words(text, "starts at sample 4", "UnidentifiedImageError", "fix or remove that file")
    got = stored(tmp_path / "run" / "probe.h5")
    assert len(got["conv/output"]) == 4
    clean = tmp_path / "clean_images"
    for i, color in enumerate(["red", "green", "blue", "white"]):
        _image(clean / "a" / f"{i}.png", color)
    assert_prefix_of_clean_run(tmp_path, got, *TINYNET, *IMAGEFOLDER, f"dataset.root={clean}")


# -- checkpoints ---------------------------------------------------------------------------------
def test_corrupt_checkpoint(cli_here, tmp_path):
    good = tmp_path / "good.pt"
    torch.save({"w": torch.zeros(1000)}, good)
    bad = tmp_path / "bad.pt"
    bad.write_bytes(good.read_bytes()[:300])  # a truncated zip archive
    code, text = cli_here(*TINYNET, f"model.checkpoint={bad}")
    assert code == 2
    assert_words(text, str(bad), "not a readable weights-only checkpoint", "state_dict()")


def test_pickle_only_checkpoint_is_refused(cli_here, tmp_path):
    """A whole pickled module needs arbitrary code to load; weights_only=True refuses it."""
    from probe.testing.models import TinyNet

    path = tmp_path / "whole_model.pt"
    torch.save(TinyNet(), path)
    code, text = cli_here(*TINYNET, f"model.checkpoint={path}")
    assert code == 2
    assert_words(text, str(path), "weights-only", "torch.save(model.state_dict(), path)")
    assert "\x1b[" not in text  # no terminal colour codes from torch's message


def test_checkpoint_that_is_not_a_state_dict(cli_here, tmp_path):
    path = tmp_path / "list.pt"
    torch.save([torch.zeros(3)], path)
    code, text = cli_here(*TINYNET, f"model.checkpoint={path}")
    assert code == 2
    assert_words(text, str(path), "holds a list", "not a state_dict")


# -- the model -----------------------------------------------------------------------------------
def test_forward_that_raises_keeps_the_batches_before_it(cli_here, tmp_path):
    args = [*TINY, "model._target_=probe.testing.models.Raises", "probes=everything"]
    code, text = cli_here(*args, "+model.kwargs.ok_calls=2")
    assert code == 2
    assert_words(text, "forward raised RuntimeError", "deliberate failure", "dataset.image_size")
    got = stored(tmp_path / "run" / "probe.h5")
    assert len(got["conv/output"]) == 4
    assert_prefix_of_clean_run(tmp_path, got, *TINYNET)


def test_nonfinite_values_are_counted(cli_here, tmp_path):
    args = [*TINY, "model._target_=probe.testing.models.MakesNaN", "probes=everything"]
    code, text = cli_here(*args)
    assert code == 0
    assert_words(text, "layer 'bad' output", "NaN", "fail_on_nonfinite=true")
    import pandas as pd

    summary = pd.read_csv(tmp_path / "run" / "summary.csv").set_index(["layer", "site"])
    with h5py.File(tmp_path / "run" / "probe.h5") as f:
        for layer, site in summary.index:
            a = f[f"layers/{layer}/{site}"][:].astype(np.float64)
            assert summary.loc[(layer, site), "nan_count"] == np.isnan(a).sum()
            assert summary.loc[(layer, site), "inf_count"] == np.isinf(a).sum()
    assert summary.loc[("bad", "output"), "nan_count"] > 0
    assert summary.loc[("bad", "output"), "inf_count"] > 0
    assert summary.loc[("conv", "output"), ["nan_count", "inf_count"]].sum() == 0


def test_fail_on_nonfinite_names_the_first_layer(cli_here, tmp_path):
    args = [*TINY, "model._target_=probe.testing.models.MakesNaN", "probes=everything"]
    code, text = cli_here(*args, "fail_on_nonfinite=true")
    assert code == 2
    assert_words(text, "layer 'bad' output", "first layer", "starts at sample 0")
    assert "layer 'fc'" not in text
    with h5py.File(tmp_path / "run" / "probe.h5") as f:  # the offending batch is kept to inspect
        assert not f.attrs["complete"] and int(f.attrs["num_samples"]) == 2


# -- files ---------------------------------------------------------------------------------------
@pytest.fixture
def finished_file(tmp_path):
    return run(make_cfg(*TINYNET), run_dir=tmp_path / "done").h5_path


@pytest.mark.parametrize("damage", ["truncated", "garbage", "not-probe", "missing", "directory"])
def test_damaged_probe_file_is_named_when_read(tmp_path, finished_file, damage):
    path = tmp_path / "copy.h5"
    data = finished_file.read_bytes()
    words = {
        "truncated": ["cut short", "truncated"],
        "garbage": ["not an HDF5 file"],
        "not-probe": ["not one written by probe"],
        "missing": ["does not exist"],
        "directory": ["is a directory"],
    }[damage]
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(b"nothing like HDF5" * 100)
    elif damage == "not-probe":
        with h5py.File(path, "w") as f:
            f["x"] = np.zeros(3)
    elif damage == "directory":
        path.mkdir()
    with pytest.raises(DataError) as err:
        open_probe_file(path)
    assert_words(str(err.value), str(path), *words)


def test_resume_of_a_truncated_file(cli_here, tmp_path, finished_file):
    run_dir = tmp_path / "broken"
    run_dir.mkdir()
    data = finished_file.read_bytes()
    (run_dir / "probe.h5").write_bytes(data[: len(data) // 2])
    code, text = cli_here(*TINYNET, "resume=true", run_dir=run_dir)
    assert code == 2
    assert_words(text, "cut short", "new hydra.run.dir")


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (["seed=3"], "seed: 0 in the file, 3 now"),
        (["precision=bf16"], "precision: 'fp32' in the file, 'bf16' now"),
        (
            ["intervene=edit", "intervene.edit.layers=[conv]", "intervene.edit.op=zero"],
            "intervene.edit: None in the file",
        ),
    ],
    ids=["seed", "precision", "intervene"],
)
def test_resume_with_another_config(cli_here, tmp_path, finished_file, change, words):
    code, text = cli_here(*TINYNET, "resume=true", *change, run_dir=finished_file.parent)
    assert code == 2
    assert_words(text, "resume=true", words, "hydra.run.dir")


def test_disk_full_stops_cleanly_and_keeps_the_flushed_batches(tmp_path):
    """RLIMIT_FSIZE makes the kernel refuse writes past 4.5 MB, as a full disk would."""
    args = ["model=resnet18", "dataset.image_size=32", "dataset.num_samples=16"]
    args += ["dataset.batch_size=4", "probes=all_convs", "store.chunk_bytes=65536"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HYDRA_FULL_ERROR", None)
    limit = 4_500_000
    out = subprocess.run(
        [sys.executable, "-m", "probe", *QUIET, *args, f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,  # a hang fails here
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)),
    )
    text = out.stdout + out.stderr
    assert out.returncode == 2, text
    assert "Traceback" not in text
    assert_words(text, "is full", "MiB", "resume=true")
    got = stored(tmp_path / "run" / "probe.h5")
    assert 0 < len(got["conv1/output"]) < 16
    assert_prefix_of_clean_run(tmp_path, got, *args)
