"""The same config and seed on the CPU give bitwise identical files, across processes."""

from __future__ import annotations

import h5py
import numpy as np
import pandas as pd

from probe.launch.run import run
from probe.testing.compose import make_cfg
from tests.helpers import cli

ARGS = [
    "model=lenet",
    "probes=param_grads",
    "probes.params.capture=[input,output,grad_output,param_grad]",
    "dataset.num_samples=10",
    "dataset.batch_size=4",
    "seed=7",
]


def contents(path) -> dict:
    """Every dataset's array and every attribute of every group, except the config text."""
    out = {}
    with h5py.File(path) as f:

        def visit(name, obj):
            if isinstance(obj, h5py.Dataset):
                out[name] = obj[()]
            for k, v in obj.attrs.items():
                if k == "REFERENCE_LIST":  # object references: where objects lie, as names
                    v = [(f[r["dataset"]].name, int(r["dimension"])) for r in v]
                elif k == "DIMENSION_LIST":
                    v = [tuple(f[ref].name for ref in refs) for refs in v]
                elif isinstance(v, np.ndarray) and v.dtype.kind == "O":  # strings
                    v = v.tolist()
                out[f"{name}@{k}"] = v

        f.visititems(visit)
        out.update({f"@{k}": v for k, v in f.attrs.items()})
    return out


def test_two_processes_write_identical_files(tmp_path):
    runs = [tmp_path / "a", tmp_path / "b"]
    for d in runs:
        out = cli(*ARGS, f"hydra.run.dir={d}", cwd=tmp_path)
        assert out.returncode == 0, out.stderr
    a, b = (contents(d / "probe.h5") for d in runs)
    assert a.keys() == b.keys()
    assert any(k.startswith("layers/conv2/param_grad") for k in a)
    for k in a:
        if isinstance(a[k], np.ndarray):
            assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), k
        else:
            assert a[k] == b[k], k
    csv = [pd.read_csv(d / "summary.csv") for d in runs]
    pd.testing.assert_frame_equal(*csv, check_exact=True)

    other = run(make_cfg(*ARGS[:-1], "seed=8"), run_dir=tmp_path / "c")  # the seed does matter
    with h5py.File(other.h5_path) as f:
        assert not np.array_equal(f["layers/conv1/output"][()], a["layers/conv1/output"])
        assert not np.array_equal(f["samples/target"][()], a["samples/target"])
