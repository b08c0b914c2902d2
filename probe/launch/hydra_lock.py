"""Hydra callback (hydra.callbacks in conf/config.yaml): lock the run directory of
`python -m probe` before Hydra creates `.hydra/` or the log in it, and refuse an existing probe.h5
there unless the config resumes or overwrites it."""

from __future__ import annotations

import sys
from pathlib import Path

from hydra.experimental.callback import Callback

from probe.errors import ProbeError
from probe.store.runfile import check_existing
from probe.store.runlock import acquire, release


class RunLock(Callback):
    """`python -m probe` (without -m): the job claims the lock (`runlock.hold`); on_run_end
    releases it."""

    def __init__(self) -> None:
        self.run_dir: Path | None = None

    def on_run_start(self, config, **kwargs) -> None:
        from hydra.core.hydra_config import HydraConfig
        from omegaconf import OmegaConf

        try:
            HydraConfig.instance().set_config(config)  # as the job does, for ${hydra:...}
            # `now` and `run_suffix` are cached per config: the job gets this directory too
            run_dir = Path(str(OmegaConf.select(config, "hydra.run.dir"))).absolute()
            store = OmegaConf.select(config, "store.filename", default="probe.h5")
            resume = bool(OmegaConf.select(config, "resume", default=False))
            overwrite = bool(OmegaConf.select(config, "overwrite", default=False))
        except Exception:  # the job reports a config it cannot read
            return
        try:
            acquire(run_dir, reserve=True).cli = True
        except ProbeError as e:
            _exit(str(e))
        except OSError:  # Hydra reports an unusable directory
            return
        self.run_dir = run_dir
        try:
            check_existing(run_dir / str(store), resume, overwrite)
        except ProbeError as e:
            release(run_dir)
            _exit(str(e))

    def on_run_end(self, config, **kwargs) -> None:
        if self.run_dir is not None:
            release(self.run_dir)


def _exit(message: str) -> None:
    """Before the job starts there is no log: the message goes to stderr, exit code 2."""
    print(f"probe: error: {message}", file=sys.stderr)
    raise SystemExit(2)
