"""scripts/example_api.py runs as documented, and what it wrote holds the values it claims."""

from __future__ import annotations

import subprocess
import sys

import h5py
import numpy as np
import pandas as pd

from tests.helpers import ROOT


def test_the_python_api_example_runs_and_its_files_agree(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "example_api.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "capture equals the run's rows: True" in done.stdout
    assert (tmp_path / "std_by_layer.png").read_bytes()[:4] == b"\x89PNG"
    summary = pd.read_csv(tmp_path / "gpt2" / "summary.csv").set_index("layer")
    with h5py.File(tmp_path / "gpt2" / "probe.h5") as f:
        for layer in summary.index:
            a = f[f"layers/{layer}/output"][:].astype(np.float64)
            np.testing.assert_allclose(
                summary.loc[layer, ["mean", "std"]], [a.mean(), a.std()], 1e-6
            )
    convs = pd.read_csv(tmp_path / "resnet18" / "summary.csv")
    assert len(convs) == 20 and (convs["n"] > 0).all()
