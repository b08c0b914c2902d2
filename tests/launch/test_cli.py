"""The command line: a checkout run, an installed-package run and an unwritable run directory in
a subprocess, and bad inputs through its console entry point in this process (`cli_in_process`)."""

from __future__ import annotations

import os
import subprocess
import sys

import h5py
import numpy as np
import pandas as pd
import pytest
import torch

from tests.helpers import ROOT, cli

TINY = ["model=resnet18", "dataset.image_size=32", "dataset.num_samples=3", "dataset.batch_size=2"]


def _stats_match(run_dir):
    """summary.csv equals numpy float64 statistics of the stored arrays."""
    summary = pd.read_csv(run_dir / "summary.csv")
    with h5py.File(run_dir / "probe.h5") as f:
        assert f.attrs["complete"]
        for row in summary.itertuples():
            a = f[f"layers/{row.layer}/{row.site}"][:].astype(np.float64)
            np.testing.assert_allclose(
                [row.mean, row.std, row.min, row.max, row.abs_mean, row.frac_zero],
                [a.mean(), a.std(), a.min(), a.max(), np.abs(a).mean(), (a == 0).mean()],
                rtol=1e-6,
                atol=1e-12,
            )
    return summary


def test_checkout_cli_run_writes_file_and_matching_summary(tmp_path):
    out = cli(*TINY, "probes=all_activations", f"hydra.run.dir={tmp_path}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    summary = _stats_match(tmp_path)
    assert {"relu", "layer1.0.relu"} <= set(summary.layer)
    assert "output@1" in set(summary.site)  # the shared relu's second call
    assert (tmp_path / ".hydra" / "config.yaml").is_file()


def test_installed_package_finds_its_configs(tmp_path):
    """A non-editable install (no checkout on the path) runs the `probe` console script."""
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (target / "probe" / "conf" / "config.yaml").is_file()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(target)
    run_dir = tmp_path / "run"
    script = target / "bin" / "probe"
    out = subprocess.run(
        [
            sys.executable,
            str(script),
            *TINY,
            "probes=all_linear",
            "print_summary=false",
            "progress=false",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    _stats_match(run_dir)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["model=resnet19"], ["model/resnet19", "resnet18"]),
        (["dataset=imagenet"], ["dataset/imagenet", "synthetic"]),
        (["probes=all_conv"], ["probes/all_conv", "all_convs"]),
        (["model=torchvision", "model.name=resnet19"], ["resnet19", "resnet18"]),
        (["probes.convs.layers=[layer9.*]"], ["layer9.*", "closest"]),
        (
            ["dataset=tensors", "dataset.path=/nonexistent/x.pt"],
            ["/nonexistent/x.pt", "does not exist"],
        ),
        (["dataset.batch_size=0"], ["batch_size=0"]),
        (["dataset.batch_size=abc"], ["batch_size", "abc"]),
        (["probes.convs.capture=[outptu]"], ["outptu", "output"]),
        (["seed_typo=1"], ["seed_typo"]),
    ],
)
def test_bad_input_exits_nonzero_with_a_named_message(tmp_path, args, words, cli_in_process):
    out = cli_in_process(*TINY, *args, f"hydra.run.dir={tmp_path}")
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "Traceback" not in text
    for w in words:
        assert w in text, text


def test_checkpoint_of_another_architecture_names_the_keys(tmp_path, cli_in_process):
    bad = tmp_path / "other.pt"
    torch.save({"features.0.weight": torch.zeros(3)}, bad)
    out = cli_in_process(*TINY, f"model.checkpoint={bad}", f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "missing keys" in out.stderr and "features.0.weight" in out.stderr


def test_checkpoint_round_trip_loads_the_weights(tmp_path):
    import torchvision

    model = torchvision.models.resnet18(num_classes=1000)
    torch.nn.init.constant_(model.conv1.weight, 0.5)
    torch.save(model.state_dict(), tmp_path / "w.pt")
    out = cli(
        *TINY,
        "probes=all_convs",
        "probes.convs.layers=[conv1]",
        f"model.checkpoint={tmp_path / 'w.pt'}",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    with h5py.File(tmp_path / "run" / "probe.h5") as f:
        x = f["layers/conv1/output"][:]
    from probe.data.batches import SyntheticImages

    data = SyntheticImages(3, (3, 32, 32), 1000, seed=0)
    inputs = torch.stack([data[i][0] for i in range(3)])
    with torch.no_grad():
        expected = torch.nn.functional.conv2d(
            inputs, torch.full((64, 3, 7, 7), 0.5), stride=2, padding=3
        )
    np.testing.assert_allclose(x, expected.numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["under_a_file", "read_only"])
def test_unwritable_run_directory(tmp_path, kind):
    if kind == "under_a_file":  # fails for every user, root included
        blocker = tmp_path / "a_file"
        blocker.write_text("not a directory")
        target = blocker / "run"
    else:
        if os.geteuid() == 0:
            pytest.skip("root ignores directory permissions")
        blocker = tmp_path / "locked"
        blocker.mkdir()
        blocker.chmod(0o500)
        target = blocker / "run"
    out = cli(*TINY, f"hydra.run.dir={target}", cwd=tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode == 2 and "Traceback" not in text
    assert str(target) in text and "hydra.run.dir" in text
