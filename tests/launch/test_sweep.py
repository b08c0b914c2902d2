"""Sweeps through the CLI: the 2x2 multirun, a failing job among good ones, the joblib launcher,
and the SLURM preset composed into the batch script submitit would submit."""

from __future__ import annotations

import h5py
import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from omegaconf import OmegaConf

from probe.data.batches import build_batches
from probe.models.build import build_model
from probe.plan import parse
from probe.read.summaries import sweep_table
from tests.helpers import assert_same_arrays, cli, cloned_outputs

TINY = ["dataset.image_size=32", "dataset.num_samples=3", "dataset.batch_size=2"]
GRID = ["model=resnet18,vgg11", "probes=all_convs,all_norms"]


def sweep_jobs(sweep_dir) -> dict[tuple[str, str], object]:
    """{(model, probes): job dir} from each job's .hydra/overrides.yaml."""
    jobs = {}
    for job in sorted(p for p in sweep_dir.iterdir() if p.name.isdigit()):
        overrides = dict(
            o.split("=", 1) for o in yaml.safe_load((job / ".hydra/overrides.yaml").read_text())
        )
        jobs[overrides["model"], overrides["probes"]] = job
    return jobs


@pytest.fixture(scope="module")
def sequential_sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("sequential")
    # one thread, as each of the parallel launcher's two jobs gets: a convolution split across
    # two threads may round differently (seen on an Intel Xeon: 1e-7 apart)
    out = cli(
        "-m", *GRID, *TINY, f"hydra.sweep.dir={root / 'sweep'}", cwd=root,
        env={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return root / "sweep"


def test_2x2_multirun_runs_four_complete_jobs(sequential_sweep):
    jobs = sweep_jobs(sequential_sweep)
    assert sorted(jobs) == [
        ("resnet18", "all_convs"),
        ("resnet18", "all_norms"),
        ("vgg11", "all_convs"),
        ("vgg11", "all_norms"),
    ]
    for (model, probes), job in jobs.items():
        cfg = OmegaConf.load(job / ".hydra/config.yaml")
        assert cfg.model.name == model and list(cfg.probes) == [probes.removeprefix("all_")]
        assert OmegaConf.load(job / ".hydra/hydra.yaml").hydra.job.name == "probe"
        assert (job / "probe.log").is_file()
        summary = pd.read_csv(job / "summary.csv")
        with h5py.File(job / "probe.h5") as f:
            assert f.attrs["complete"] and f.attrs["num_samples"] == 3
            assert sorted(f["layers"]) == sorted(summary.layer)
            for row in summary.itertuples():  # the table is the statistics of the stored arrays
                a = f[f"layers/{row.layer}/{row.site}"][:].astype(np.float64)
                np.testing.assert_allclose([row.mean, row.std], [a.mean(), a.std()], rtol=1e-6)
            if probes == "all_convs":  # the stored rows are the model's conv outputs
                model_ = build_model(parse(cfg).model, cfg.seed).eval()
                inputs = torch.cat(
                    [b.inputs for b in build_batches(parse(cfg).data, parse(cfg).model, cfg.seed)]
                )
                convs = [n for n, m in model_.named_modules() if isinstance(m, torch.nn.Conv2d)]
                ref = cloned_outputs(model_, convs, [inputs])
                assert sorted(f["layers"]) == sorted(convs)
                for name in convs:
                    np.testing.assert_allclose(
                        f[f"layers/{name}/output"][:], ref[name], rtol=1e-5, atol=1e-5
                    )
    # vgg11 has no normalisation layer: a complete file with samples, no layers, an empty table
    empty = jobs["vgg11", "all_norms"]
    with h5py.File(empty / "probe.h5") as f:
        assert list(f["layers"]) == [] and list(f["samples/index"]) == [0, 1, 2]
    assert len(pd.read_csv(empty / "summary.csv")) == 0
    assert "no module selected" in (empty / "probe.log").read_text()
    # the sweep's table keeps integer counts as integers, the empty run's cells blank
    table, _ = sweep_table(sequential_sweep)
    assert table.loc[table.run == empty.name, "n"].isna().all()
    for column in ["rows", "n", "nan_count", "inf_count", "units"]:
        assert str(table[column].dtype) == "Int64", column
    for job in jobs.values():
        if job != empty:
            got, own = table[table.run == job.name], pd.read_csv(job / "summary.csv")
            assert list(got.n) == list(own.n) and list(got.units) == list(own.units)


def test_a_failing_job_is_reported_and_the_others_complete(tmp_path):
    """The first job fails (LeNet has no norms and the probe may not be empty); the second runs."""
    out = cli(
        "-m",
        "model=lenet,resnet18",
        "probes=all_norms",
        "probes.norms.allow_empty=false",
        *TINY,
        f"hydra.sweep.dir={tmp_path}",
        cwd=tmp_path,
    )
    assert out.returncode != 0
    assert "probe: error in job #0" in out.stderr and "selects no module of LeNet" in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "0" / "probe.h5").exists()
    with h5py.File(tmp_path / "1" / "probe.h5") as f:
        assert f.attrs["complete"] and len(f["layers"]) == 20  # resnet18's norm layers


def test_joblib_launcher_with_two_jobs_equals_the_sequential_sweep(sequential_sweep, tmp_path):
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    out = cli(
        "-m",
        "hydra/launcher=parallel",
        "hydra.launcher.n_jobs=2",
        "model=resnet18",
        "probes=all_convs,all_norms",
        *TINY,
        f"hydra.sweep.dir={tmp_path}",
        cwd=tmp_path,
        env={"OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr
    assert "Joblib.Parallel(n_jobs=2" in out.stdout + out.stderr
    parallel, sequential = sweep_jobs(tmp_path), sweep_jobs(sequential_sweep)
    assert sorted(parallel) == [("resnet18", "all_convs"), ("resnet18", "all_norms")]
    for key, job in parallel.items():
        assert assert_same_arrays(job / "probe.h5", sequential[key] / "probe.h5") >= 21
        pd.testing.assert_frame_equal(
            pd.read_csv(job / "summary.csv"), pd.read_csv(sequential[key] / "summary.csv")
        )


def test_slurm_preset_composes_into_a_batch_script(tmp_path, monkeypatch):
    """The preset's keys are accepted by submitit and land in the #SBATCH lines it would submit."""
    submitit = pytest.importorskip("submitit")
    from hydra import compose, initialize_config_dir
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

    from probe.config import config_dir

    with initialize_config_dir(version_base="1.3", config_dir=config_dir()):
        cfg = compose(
            "config",
            overrides=["hydra/launcher=slurm", "hydra.launcher.partition=gpu"],
            return_hydra_config=True,
        )
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    # what SlurmLauncher.launch does with its config, with a stand-in `srun` on PATH (no cluster)
    (tmp_path / "srun").write_text("#!/bin/sh\nexit 0\n")
    (tmp_path / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    params = OmegaConf.to_container(launcher, resolve=False)
    for key in ("_target_", "submitit_folder"):
        params.pop(key)
    executor = submitit.AutoExecutor(
        cluster="slurm",
        folder=tmp_path / "jobs",
        slurm_max_num_timeout=params.pop("max_num_timeout"),
    )
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(
        **{k if k in base else f"slurm_{k}": v for k, v in params.items() if k != "name"}
    )
    script = executor._executor._make_submission_file_text("python -m probe", "0")
    for line in (
        "--partition=gpu",
        "--gpus-per-node=1",
        "--time=240",
        "--mem=32GB",
        "--cpus-per-task=8",
        "--ntasks-per-node=1",
    ):
        assert f"#SBATCH {line}" in script
