"""Which implementation reduces a batch to statistics: `stats.backend=auto|torch|numba`.

torch (`probe.stats.torch_backend`) runs on the capture's own device and is the reference; numba
(`probe.stats.numba_backend`) is a compiled CPU accelerator from the optional `fast` extra. auto takes
torch on a GPU, where only the small per-batch results then leave the device, and numba on the
CPU once its kernels are compiled (`probe.stats.kernel_cache`); before that, torch, while the kernels
compile in the background for the next runs. Both give equal counts, extremes and histograms and
moments within float64 rounding (tests/test_stats_backends.py).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from probe.choices import NUMBA_MISSING, STATS_BACKENDS
from probe.errors import ConfigError
from probe.stats import kernel_cache

if TYPE_CHECKING:
    import torch

    from probe.stats.running import RunningStats

ENV = "PROBE_STATS_BACKEND"  # the default of processes without a run config (the summarizer)
log = logging.getLogger("probe")


def numba_installed() -> bool:
    try:
        return importlib.util.find_spec("numba") is not None
    except (ImportError, ValueError):  # blocked: sys.modules["numba"] is None
        return False


def resolve(name: str, device_type: str = "cpu", announce: bool = True) -> str:
    """torch or numba for `stats.backend=name` on a device of `device_type`."""
    if name not in STATS_BACKENDS:  # (PROBE_STATS_BACKEND's value; the config's is a Choice)
        raise ConfigError(f"{ENV}={name!r} is unknown; choose from {', '.join(STATS_BACKENDS)}")
    if name == "torch":
        return "torch"
    if name == "numba":
        if not numba_installed():
            raise ConfigError(NUMBA_MISSING)
        if announce and not kernel_cache.is_warm():
            log.warning(
                "statistics: compiling the numba kernels before the first batch (once per "
                "install; about %s on this machine); stats.backend=auto would use torch meanwhile",
                kernel_cache.EXPECTED,
            )
        return "numba"
    if device_type != "cpu" or not numba_installed():
        return "torch"
    if kernel_cache.is_warm():
        return "numba"
    if announce:
        pid = kernel_cache.compile_in_background()
        if pid is not None:
            log.info(
                "statistics: the torch backend this run; numba's faster kernels compile in the "
                "background for the next runs (pid %d, low priority, about %s)",
                pid,
                kernel_cache.EXPECTED,
            )
    return "torch"


_cpu: str | None = None  # this process's backend for CPU batches


def use(name: str) -> None:
    """Reduce this process's CPU batches with `name` (torch or numba) from now on."""
    global _cpu
    _cpu = name


def cpu_name() -> str:
    """This process's backend for CPU batches (torch or numba): the one `use` chose, else
    PROBE_STATS_BACKEND's or auto's."""
    global _cpu
    if _cpu is None:
        _cpu = resolve(os.environ.get(ENV, "auto"))
    return _cpu


def cpu_stats():
    """batch_stats(x, bounds, hist, unit_axis) of this process's CPU backend: the one `use`
    chose, else PROBE_STATS_BACKEND's or auto's."""
    if cpu_name() == "numba":
        from probe.stats.numba_backend import batch_stats

        return batch_stats
    from probe.stats.torch_backend import batch_stats as torch_batch

    return lambda x, bounds, hist, unit_axis: torch_batch(x, bounds, unit_axis)


def batch_stats(x, bounds=None, hist=None, unit_axis: int = 1):
    """Statistics of one batch (axis 0 = rows; a numpy array or a torch tensor) from this
    process's CPU backend; those that count into a running histogram `hist` do so, the others
    return their own."""
    return cpu_stats()(x, bounds, hist, unit_axis)


def fold(stats, x) -> None:
    """Fold one batch `x` (axis 0 = rows) into running statistics `stats` (a RunningStats)."""
    stats.merge(batch_stats(x, stats.bounds, stats.hist, stats.unit_axis))


def observer(name: str):
    """What reduces captures in the hooks: the numba backend's `HookStats`, or `TorchStats`."""
    if name == "numba":
        from probe.stats.numba_backend import HookStats

        return HookStats()
    return TorchStats()


class TorchStats:
    """The torch backend in the hooks: a CPU capture's statistics now, a GPU capture's as a
    `DeviceStats` whose kernels are queued on the capture's stream (no host sync)."""

    on_device = True  # it takes GPU captures where they are

    def begin(self) -> None:
        pass

    def __call__(self, x, bounds=None, unit_axis: int = 1):
        from probe.stats import torch_backend as torch_stats

        if x.is_cpu:
            return torch_stats.batch_stats(x, bounds, unit_axis)
        return DeviceStats(*torch_stats.on_device(x, bounds, unit_axis))


@dataclass
class DeviceStats:
    """A GPU batch's statistics packed in one float64 tensor (`torch_stats.on_device`): on the
    device when taken, then a pinned host copy (`probe.hooks.device.to_host`) that may be read once
    the record's event has fired; `read` makes a `RunningStats` of that copy (kept once made)."""

    packed: torch.Tensor
    read: Callable[[np.ndarray], RunningStats]
    _read: tuple = (None, None)  # (the packed tensor read, its statistics)

    def tensors(self) -> dict:
        """What a record copies to the host (probe.hooks.step_context.Partial)."""
        return {"packed": self.packed}

    def on_host(self, tensors: dict) -> DeviceStats:
        """The same statistics over their host copy (read once the record's event fired)."""
        return DeviceStats(tensors["packed"], self.read)

    def host(self):
        if self._read[0] is not self.packed:
            self._read = (self.packed, self.read(self.packed.numpy()))
        return self._read[1]

    def fold_into(self, s) -> None:
        s.merge(self.host())
        self._read = (None, None)  # (s may now hold its units: not to be handed out again)

    @property
    def host_bytes(self) -> int:
        """What it moves to the host (its whole packed batch)."""
        return self.packed.nbytes

    @property
    def nan_count(self) -> int:
        return self.host().nan_count

    @property
    def inf_count(self) -> int:
        return self.host().inf_count

    @property
    def buckets(self) -> int:
        hist = self.host().hist
        return 0 if hist is None else int(np.count_nonzero(hist.counts))
