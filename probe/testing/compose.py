"""The pipeline's config composed from overrides as `python -m probe` composes it, quietly (no
summary printed, no progress bar): `make_cfg("model=resnet18", "dataset.num_samples=8")`."""

from __future__ import annotations

from hydra import compose, initialize_config_dir

from probe.config import config_dir

QUIET = ["print_summary=false", "progress=false"]


def make_cfg(*overrides: str):
    with initialize_config_dir(version_base="1.3", config_dir=config_dir()):
        return compose("config", overrides=[*QUIET, *overrides])
