"""Test helpers: real Hydra composition, real runs into tmp_path, real subprocess CLI calls."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import h5py
from hydra import compose, initialize_config_dir

from probe.config import config_dir
from probe.run import run

ROOT = Path(__file__).resolve().parent.parent
QUIET = ["print_summary=false", "progress=false"]


def make_cfg(*overrides: str):
    with initialize_config_dir(version_base="1.3", config_dir=config_dir()):
        return compose("config", overrides=[*QUIET, *overrides])


def run_probe(tmp_path: Path, *overrides: str):
    """Compose and run in-process; returns (RunResult, open h5py.File)."""
    result = run(make_cfg(*overrides), run_dir=tmp_path)
    return result, h5py.File(result.h5_path, "r")


def cli(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 300):
    """`python -m probe ARGS` in a subprocess."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    full_env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "probe",
            *[a for a in args if a.startswith("-")],
            *QUIET,
            *[a for a in args if not a.startswith("-")],
        ],
        cwd=cwd or ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
