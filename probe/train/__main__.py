"""`python -m probe.train`: a short watched training from a Hydra config (conf/train.yaml),
sweepable with -m; bad input is named, exit 2. probe.train.trainer does the work."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from probe.config import config_dir
from probe.errors import ProbeError


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="train")
def app(cfg: DictConfig) -> None:
    from probe.plan import parse_training
    from probe.train.trainer import train

    try:
        plan = parse_training(cfg)
        out = Path(HydraConfig.get().runtime.output_dir)
        losses = train(plan, out)
    except (ProbeError, OmegaConfBaseException) as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"probe.train: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"{out}: {len(losses)} steps, loss {losses[0]:.4g} -> {losses[-1]:.4g}")


if __name__ == "__main__":
    app()
