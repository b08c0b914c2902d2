"""Bringing values a run keeps on a device (quantile sketches, per-unit rows) to the host: all
of one device's, laid end to end, in one copy.

`fetch` takes any item with `stale` (changed on the device since its last fetch), `device`,
`stream`, `tensor` (its device values) and `receive(values)` (takes the host's copy):
probe.stats.device_sketch.DeviceHistogram and probe.stats.device_units.DeviceUnits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Protocol

import numpy as np
import torch

from probe.hooks.device import copy_to_host


class DeviceValues(Protocol):
    """What `fetch` reads of an item kept on a device."""

    stale: bool
    device: torch.device
    stream: torch.cuda.Stream | None
    tensor: torch.Tensor

    def receive(self, values: np.ndarray) -> None: ...


def on_stream(stream: torch.cuda.Stream | None):
    """Work queued on `stream` (that which reduced the batches: their order is its order)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def fetch(items: Iterable[DeviceValues]) -> None:
    """Bring the device values of `items` that changed to the host: those of one device (and
    stream) laid end to end and copied at once, then read (this waits for the device)."""
    groups: dict[tuple, list[DeviceValues]] = {}
    for item in items:
        if item.stale:
            groups.setdefault((item.device, item.stream), []).append(item)
    for (_, stream), group in groups.items():
        with on_stream(stream):
            copy = copy_to_host(torch.cat([item.tensor.reshape(-1) for item in group]))
        values = copy.array()
        at = 0
        for item in group:
            size = item.tensor.numel()
            item.receive(values[at : at + size])
            at += size
