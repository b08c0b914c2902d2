"""A run's per-unit statistics kept on their device (`DeviceUnits`) and merged there, all the
sites of a batch in a handful of operations (`merge_batch`), instead of travelling to the host
with every batch: counts and sums added, extremes compared as `UnitStats.merge` does (numpy's
`minimum` and `maximum`, which keep the second of equal values), so that they equal the host's
merge exactly. They come to the host where /stats is written (probe.stats.device_fetch.fetch).

A site's rows lie in `probe.stats.batched_read.UNIT_ORDER` (count, sum, positive, saturated,
min, -max): the first four add, the last two keep the lesser. A new site starts from what
merges into anything unchanged (a sum of -0.0, so that the first batch's sums, zeros of either
sign included, are taken as they are, as the host takes its first batch's units).
"""

from __future__ import annotations

import numpy as np
import torch

from probe.stats.device_fetch import fetch, on_stream
from probe.stats.running import UnitStats

ROWS = 6  # UNIT_ORDER


class DeviceUnits(UnitStats):
    """One site's per-unit statistics on a device (`tensor`, ROWS x width, float64). The fields
    are the host's copy, brought over (`probe.stats.device_fetch.fetch`) only when the device's
    changed since, and read-only (the dataclass's fields become properties: hence the type
    checker's overrides below); `width` and `tracked` answer without it."""

    def __init__(self, tensor: torch.Tensor, tracked: bool,
                 stream: torch.cuda.Stream | None = None) -> None:  # fmt: skip
        self.tensor, self.device, self.stream = tensor, tensor.device, stream
        self._tracked = tracked
        self.stale = True
        self._host: UnitStats | None = None

    @classmethod
    def empty_on(cls, width: int, tracked: bool, device: torch.device,
                 stream: torch.cuda.Stream | None) -> DeviceUnits:  # fmt: skip
        """Units that merge into anything unchanged."""
        with on_stream(stream), torch.inference_mode(False):
            t = torch.zeros(ROWS, width, dtype=torch.float64, device=device)
            t[1].fill_(-0.0)
            t[4:].fill_(torch.inf)
        return cls(t, tracked, stream)

    @classmethod
    def from_host(cls, units: UnitStats, device: torch.device,
                  stream: torch.cuda.Stream | None) -> DeviceUnits:  # fmt: skip
        """Host units (a resumed run's, read from its file) on the device."""
        saturated = units.saturated if units.saturated is not None else np.zeros(units.width)
        rows = np.stack([units.count, units.sum, units.positive, saturated, units.min,
                         -np.asarray(units.max, dtype=np.float64)]).astype(np.float64)  # fmt: skip
        start = torch.from_numpy(rows)
        with on_stream(stream), torch.inference_mode(False):
            if device.type == "cuda":
                start = start.pin_memory()
            made = cls(start.to(device, non_blocking=True).clone(), units.tracked, stream)
        made._host, made.stale = units, False
        return made

    @classmethod
    def of(cls, units: UnitStats | None, width: int, tracked: bool, device: torch.device,
           stream: torch.cuda.Stream | None) -> DeviceUnits:  # fmt: skip
        """`units` (a site's so far: None, host or device) as units on `device`."""
        if isinstance(units, DeviceUnits) and units.device == device:
            return units
        if units is None:
            return cls.empty_on(width, tracked, device, stream)
        if units.width != width:
            raise ValueError(f"unit counts differ: {units.width} vs {width}")
        return cls.from_host(units, device, stream)

    def receive(self, values: np.ndarray) -> None:
        """Its device's rows, brought over by a fetch."""
        r = np.asarray(values, dtype=np.float64).reshape(ROWS, -1)
        self._host = UnitStats(r[0].astype(np.int64), r[1].copy(), r[4].copy(), -r[5],
                               r[2].astype(np.int64),
                               r[3].astype(np.int64) if self._tracked else None)  # fmt: skip
        self.stale = False

    def merge(self, b: UnitStats) -> None:
        other = DeviceUnits.of(b, b.width, b.tracked, self.device, self.stream)
        merge_batch([self], other.tensor)

    def _fields(self) -> UnitStats:
        if self.stale or self._host is None:
            fetch([self])
        assert self._host is not None  # (fetch received it)
        return self._host

    @property
    def width(self) -> int:
        return self.tensor.shape[1]

    @property
    def tracked(self) -> bool:
        return self._tracked

    @property
    def count(self) -> np.ndarray:  # type: ignore[override]
        return self._fields().count

    @property
    def sum(self) -> np.ndarray:  # type: ignore[override]
        return self._fields().sum

    @property
    def min(self) -> np.ndarray:  # type: ignore[override]
        return self._fields().min

    @property
    def max(self) -> np.ndarray:  # type: ignore[override]
        return self._fields().max

    @property
    def positive(self) -> np.ndarray:  # type: ignore[override]
        return self._fields().positive

    @property
    def saturated(self) -> np.ndarray | None:  # type: ignore[override]
        return self._fields().saturated


def merge_batch(targets: list[DeviceUnits], rows: torch.Tensor) -> None:
    """Merge one batch's unit rows (ROWS x the targets' widths laid end to end, UNIT_ORDER, on
    their device) into `targets`: six operations for all of them."""
    if not targets:
        return
    with on_stream(targets[0].stream):
        have = torch.cat([t.tensor for t in targets], 1) if len(targets) > 1 else targets[0].tensor
        added = have[:4] + rows[:4]
        least = torch.where(have[4:] < rows[4:], have[4:], rows[4:])  # (numpy's: the second)
        merged = torch.cat([added, least])
        widths = [t.width for t in targets]
        torch._foreach_copy_([t.tensor for t in targets], list(merged.split(widths, 1)))
    for t in targets:
        t.stale = True
