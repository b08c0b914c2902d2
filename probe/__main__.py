"""`python -m probe` / `probe`: compose the config with Hydra, run, turn user errors into messages."""

from __future__ import annotations

import logging
import os
import sys

import hydra
from omegaconf import DictConfig

from probe.config import config_dir
from probe.errors import ProbeError

log = logging.getLogger("probe")


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="config")
def app(cfg: DictConfig) -> None:
    from probe.run import run

    try:
        run(cfg)
    except ProbeError as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        log.error("%s", e)
        print(f"probe: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("probe: interrupted; the file is closed with complete=false", file=sys.stderr)
        sys.exit(130)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
