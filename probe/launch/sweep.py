"""What a job needs to know about the sweep it runs in (Hydra multirun, any launcher)."""

from __future__ import annotations

from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException
from hydra.types import RunMode

from probe.errors import ProbeError


class JobFailed(CompactHydraException, ProbeError):
    """A sweep job's user error. Hydra prints a compact exception as its message only (no
    traceback), after the sweeper has run the other jobs; it travels back from launcher workers."""


def in_sweep() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def job_label() -> str:
    """`#3 (outputs/multirun/.../3)`: the job number and its directory (Hydra names its overrides)."""
    hc = HydraConfig.get()
    return f"#{hc.job.num} ({hc.runtime.output_dir})"
