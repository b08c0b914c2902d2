"""One training step's statistics per (layer, site), merged exactly over its micro-batches.

Each value is reduced as a hook sees it (before a later in-place op can change it): a CPU value by
this process's statistics backend (`probe.stats.backend`), a GPU value by the torch backend on its
own device, brought to the host once, at the step's end (`settle`). Micro-batches merge with the
exact merges of `RunningStats` (Chan et al. for the moments, added counts and histograms), so a
step's statistics do not depend on how its batch was split. A site's first value keeps its own
histogram (the few bucket ranges its values fill); a second one merges into all 65536 buckets.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from probe.stats import backend
from probe.stats import torch_backend as torch_stats
from probe.stats.running import RunningStats

Key = tuple[str, str]


class StepStats:
    """Running statistics of the current step, by (layer, site)."""

    def __init__(self):
        self.stats: dict[Key, RunningStats] = {}
        self.on_device: dict[Key, list[tuple[torch.Tensor, int, int, object]]] = {}

    def add(self, key: Key, x: torch.Tensor, bounds, unit_axis: int) -> RunningStats | None:
        """Fold one value (axis 0: rows) in; returns the value's own statistics where they are
        on the host at once (CPU values), None for a GPU value (read at `settle`)."""
        x = x.detach()
        rows = x.shape[0] if x.dim() else 1
        if x.device.type != "cpu":
            parts = self.on_device.setdefault(key, [])
            parts.append((torch_stats.reduce(x, bounds, unit_axis), rows, unit_axis, bounds))
            return None
        batch = backend.batch_stats(x, bounds, None, unit_axis)
        self._fold(key, batch, bounds, unit_axis)
        return batch

    def _fold(self, key: Key, batch: RunningStats, bounds, unit_axis: int) -> None:
        acc = self.stats.get(key)
        if acc is None:  # the step's first value: its own statistics, histogram and units kept
            acc = self.stats[key] = RunningStats(bounds=bounds, unit_axis=unit_axis, hist=None)
            acc.add(batch.rows, batch.accumulator())
            acc.hist, acc.units = batch.hist, batch.units
            return
        acc.merge(batch)  # (a second micro-batch: into all 65536 buckets)

    def settle(self, seen: Callable[[Key, RunningStats], None] | None = None) -> dict:
        """The step's statistics by key, GPU values' brought to the host (each passed to
        `seen`, in the order they were taken)."""
        for key, parts in self.on_device.items():
            for packed, rows, axis, bounds in parts:
                batch = torch_stats.unpack(packed.cpu().numpy(), rows, axis)
                if seen is not None:
                    seen(key, batch)
                self._fold(key, batch, bounds, axis)
        self.on_device.clear()
        return self.stats
