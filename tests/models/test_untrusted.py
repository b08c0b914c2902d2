"""Checkpoints and .pt datasets load as weights only; the pipeline's own files hold no pickle."""

from __future__ import annotations

import pickle

import h5py
import numpy as np
import pytest
import torch

from probe.errors import CheckpointError, DataError
from probe.launch.run import run
from probe.testing.compose import make_cfg
from probe.testing.models import TinyNet

TINY = [
    "model=custom",
    "model._target_=probe.testing.models.TinyNet",
    "model.input_shape=[3,8,8]",
    "model.num_classes=10",
    "dataset.batch_size=2",
    "probes=everything",
]


class Payload:
    """Unpickling this would run code: it must never be unpickled."""

    ran = False

    def __reduce__(self):
        return (Payload._run, ())

    @staticmethod
    def _run():
        Payload.ran = True
        return "ran"


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"conv.weight": torch.zeros(4, 3, 3, 3), "x": Payload()}, path)
    with pytest.raises(CheckpointError, match="weights-only"):
        run(make_cfg(*TINY, f"model.checkpoint={path}"), run_dir=tmp_path / "run")
    assert not Payload.ran


def test_a_dataset_file_that_would_run_code_is_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"inputs": torch.zeros(2, 3, 8, 8), "targets": Payload()}, path)
    with pytest.raises(DataError, match="not a readable .pt file"):
        run(make_cfg(*TINY, "dataset=tensors", f"dataset.path={path}"), run_dir=tmp_path / "run")
    assert not Payload.ran


def test_a_run_never_pickles(tmp_path, monkeypatch):
    """With the pickle module disabled, a run with a checkpoint, a .pt dataset and a resume works,
    and the file holds no opaque (pickled) bytes: only numeric datasets and plain attributes."""
    model = TinyNet()
    torch.save(model.state_dict(), tmp_path / "w.pt")
    torch.save({"inputs": torch.randn(6, 3, 8, 8), "targets": torch.arange(6)}, tmp_path / "x.pt")
    args = [*TINY, f"model.checkpoint={tmp_path / 'w.pt'}", "dataset=tensors"]
    args.append(f"dataset.path={tmp_path / 'x.pt'}")
    cfgs = [make_cfg(*args), make_cfg(*args, "resume=true")]

    def refuse(*a, **k):
        raise AssertionError("the pipeline used pickle")

    for name in ("dump", "dumps", "load", "loads", "Pickler", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    run(cfgs[0], run_dir=tmp_path / "run")
    result = run(cfgs[1], run_dir=tmp_path / "run")
    monkeypatch.undo()

    with h5py.File(result.h5_path) as f:
        objects = [f]
        f.visititems(lambda n, o: objects.append(o))
        types = [o.dtype for o in objects if isinstance(o, h5py.Dataset)]
        fields = [t[name] for t in types if t.names for name in t.names]  # labelled /stats
        assert {t.kind for t in types if not t.names} | {t.kind for t in fields} <= {"f", "i", "u"}
        for obj in objects:
            for name, v in obj.attrs.items():
                if name in ("DIMENSION_LIST", "REFERENCE_LIST"):  # HDF5 object references
                    continue
                if name == "DIMENSION_LABELS":  # the axes' names (variable-length strings)
                    assert all(isinstance(x, str) for x in v)
                    continue
                assert isinstance(v, str | bytes | int | float | bool | np.generic | np.ndarray)
                assert not (isinstance(v, np.ndarray) and v.dtype.kind in "OV")
        np.testing.assert_array_equal(
            f["layers/conv/input"][()], torch.load(tmp_path / "x.pt")["inputs"].half().numpy()
        )
