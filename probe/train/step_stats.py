"""One training step's statistics per (layer, site), merged exactly over its micro-batches.

Each value is reduced as a hook sees it (before a later in-place op can change it). A CPU value
is reduced by this process's statistics backend (`probe.stats.backend`) into a `RunningStats` at
once. A GPU value (and, with the torch backend, a CPU one: the portable reference of that path)
is reduced on its own device into a packed batch (`probe.stats.torch_backend.packed_on_device`:
the fused reduction, a dozen operations), kept there until the step ends.

At the step's end (`settle`) the device's batches leave it once: their histograms stay, summed
per site over the micro-batches and read there as the quantiles the step's table shows
(`probe.stats.device_histograms`); everything else of every packed batch, the quantiles and the
step's device scalars (its losses, its gradient norms) go into one buffer, copied to pinned host
memory by one non-blocking copy behind an event (`probe.hooks.device.copy_to_host`, the one
function the path moves data through). `Settled.result` reads it once the copy is done (at the
next step's end, or when the watch closes), where the micro-batches merge exactly
(`RunningStats.merge`: Chan et al. for the moments, added counts), so a step's statistics do
not depend on how its batch was split. Nothing in the path waits for the device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from probe.hooks.device import HostCopy, copy_to_host
from probe.stats import backend, batched
from probe.stats import torch_backend as torch_stats
from probe.stats.device_histograms import Reader, quantile_points, split
from probe.stats.running import BucketSpans, LogHistogram, PointQuantiles, RunningStats
from probe.stats.stat_columns import quantiles
from probe.stats.torch_backend import BINS

Key = tuple[str, str]


@dataclass
class _Packed:
    """One value's packed batch on its device, and how it is read."""

    packed: torch.Tensor
    layout: object  # probe.stats.fused.Layout, or None: the reference's packing
    rows: int
    unit_axis: int
    width: int
    bounds: tuple[float, float] | None


class StepStats:
    """Running statistics of the current step, by (layer, site). `on_device`: every value is
    reduced on its device (the torch backend's path; a GPU value always is). `histograms`: the
    devices' summed histograms travel whole instead of their quantiles (a distributed
    training's ranks merge them: probe.train.ranks)."""

    def __init__(self, on_device: bool = False, histograms: bool = False):
        self.on_device, self.histograms = on_device, histograms
        self.stats: dict[Key, RunningStats] = {}  # the host's (CPU values)
        self.packs: dict[Key, list[_Packed]] = {}  # the devices', until the step ends

    def add(self, key: Key, x: torch.Tensor, bounds, unit_axis: int) -> RunningStats | None:
        """Fold one value (axis 0: rows) in; returns the value's own statistics where they are
        on the host at once (CPU values by the CPU backend), None for a value reduced on its
        device (read when the step is settled)."""
        x = x.detach()
        rows = x.shape[0] if x.dim() else 1
        if x.device.type == "cpu" and not self.on_device:
            batch = backend.batch_stats(x, bounds, None, unit_axis)
            self._fold(key, batch, bounds, unit_axis)
            return batch
        packed, layout, width = torch_stats.packed_on_device(x, bounds, unit_axis)
        self.packs.setdefault(key, []).append(
            _Packed(packed, layout, rows, unit_axis, width, bounds)
        )
        return None

    def add_many(self, items: list[tuple[Key, torch.Tensor, tuple | None, int]]) -> None:
        """Fold many one-row values in at once (a model's parameters, gradients or updates:
        (key, value (1, ...), bounds, unit axis) each): on the device path those of one device
        and dtype reduced together, in a few dozen operations for each `batched.CHUNK` values
        (probe.stats.batched); the others (and a larger tensor) one by one."""
        groups: dict[tuple, list[list]] = {}  # (device, dtype) -> chunks of <= batched.CHUNK values
        for item in items:
            key, x, bounds, axis = item
            together = (
                (self.on_device or x.device.type != "cpu")
                and bounds is None
                and batched.supports(x)
                and x.shape[0] == 1
                and x.numel() <= batched.CHUNK
            )
            if not together:
                self.add(key, x, bounds, axis)
                continue
            chunks = groups.setdefault((x.device, x.dtype), [[0]])  # [values, *items] each
            if chunks[-1][0] + x.numel() > batched.CHUNK:
                chunks.append([0])
            chunks[-1][0] += x.numel()
            chunks[-1].append(item)
        for found in (chunk[1:] for chunks in groups.values() for chunk in chunks):
            packs = batched.reduce_many([x.detach()[0] for _, x, _, _ in found])
            for (key, x, bounds, axis), packed in zip(found, packs, strict=True):
                width = x.shape[1] if x.dim() >= 2 else 0
                self.packs.setdefault(key, []).append(_Packed(packed, None, 1, axis, width, bounds))

    def _fold(self, key: Key, batch: RunningStats, bounds, unit_axis: int) -> None:
        acc = self.stats.get(key)
        if acc is None:  # the step's first value: its own statistics, histogram and units kept
            acc = self.stats[key] = RunningStats(bounds=bounds, unit_axis=unit_axis, hist=None)
            acc.add(batch.rows, batch.accumulator())
            acc.hist, acc.units = batch.hist, batch.units
            return
        if isinstance(acc.hist, BucketSpans) and isinstance(batch.hist, BucketSpans):
            spans, batch.hist = batch.hist, None  # (a second micro-batch: the ranges' union,
            try:  # not all 65536 buckets; numba's batches on one thread)
                acc.merge(batch)
            finally:
                batch.hist = spans
            acc.hist = acc.hist.union(spans)
            return
        acc.merge(batch)

    def settle(self, scalars: dict[str, torch.Tensor] | None = None) -> Settled:
        """The step ends: the host's statistics as they are, the devices' (and `scalars`, the
        step's device scalars: losses, norms) started on their one way to the host."""
        transfer = _Transfer.of(self.packs, scalars or {}, self.histograms)
        return Settled(dict(self.stats), transfer)


@dataclass
class Settled:
    """A step's statistics: the host's, and the devices' on their way (`transfer`)."""

    host: dict[Key, RunningStats]
    transfer: _Transfer | None

    def ready(self) -> bool:
        """Whether `result` can read everything without waiting."""
        return self.transfer is None or all(c.ready() for c in self.transfer.copies)

    def result(self, seen: Callable[[Key, RunningStats], None] | None = None
               ) -> tuple[dict[Key, RunningStats], dict[str, float]]:  # fmt: skip
        """(statistics by key, in the order they were first taken; the device scalars as
        floats), waiting for the copies where they are not done; each device batch passed to
        `seen` as it is read."""
        if self.transfer is None:
            return self.host, {}
        device, scalars = self.transfer.read(seen)
        return {**self.host, **device}, scalars


@dataclass
class _Transfer:
    """The devices' part of a step: one buffer per device (one on one GPU), copied to the host
    by one non-blocking copy each, and where each site's pieces lie in it."""

    copies: list[HostCopy]
    sites: list[tuple[Key, int, list[tuple[int, int, Reader, _Packed]], int]] = field(
        default_factory=list
    )  # (key, copy, [(start, stop, reader, pack) of each batch], index of its quantiles)
    points_at: list[int] = field(default_factory=list)  # where each copy's quantiles start
    scalar_at: list[tuple[str, int, int]] = field(default_factory=list)  # (name, copy, index)
    whole: bool = False  # the summed histograms themselves, not their quantiles

    @classmethod
    def of(cls, packs: dict[Key, list[_Packed]], scalars: dict[str, torch.Tensor],
           whole: bool = False) -> _Transfer | None:  # fmt: skip
        """Each device's batches into one buffer: per batch the packed batch without its
        histogram, then each site's quantiles read from its summed histogram (`whole`: the
        histogram), then the scalars; one copy per device."""
        if not packs and not scalars:
            return None
        qs = tuple(quantiles().values())
        by_device: dict[torch.device, list] = {}
        for key, items in packs.items():
            by_device.setdefault(items[0].packed.device, []).append((key, items))
        for t in scalars.values():
            by_device.setdefault(t.device, [])
        out = cls([], whole=whole)
        for i, (device, sites) in enumerate(by_device.items()):
            pieces: list[torch.Tensor] = []
            at = 0
            hists: list[torch.Tensor] = []
            for key, items in sites:
                read = []
                total = None
                for pack in items:
                    hist, rest, reader = split(pack.packed, pack.layout, pack.rows,
                                               pack.unit_axis, pack.width)  # fmt: skip
                    pieces.append(rest.reshape(-1).double())
                    read.append((at, at + rest.numel(), reader, pack))
                    at += rest.numel()
                    if hist is not None:
                        total = hist if total is None else total + hist
                index = -1
                if total is not None:
                    index = len(hists)
                    hists.append(total)
                out.sites.append((key, i, read, index))
            out.points_at.append(at)
            if hists:
                points = torch.stack(hists) if whole else quantile_points(torch.stack(hists), qs)
                pieces.append(points.reshape(-1))
                at += points.numel()
            for name, t in scalars.items():
                if t.device == device:
                    pieces.append(t.detach().reshape(-1).double())
                    out.scalar_at.append((name, i, at))
                    at += 1
            buffer = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.float64)
            out.copies.append(copy_to_host(buffer))
        return out

    def read(self, seen) -> tuple[dict[Key, RunningStats], dict[str, float]]:
        arrays = [c.array() for c in self.copies]
        qs = tuple(quantiles().values())
        stats: dict[Key, RunningStats] = {}
        for key, i, read, index in self.sites:
            a = arrays[i]
            acc: RunningStats | None = None
            for start, stop, reader, pack in read:
                batch = reader(a[start:stop])
                if seen is not None:
                    seen(key, batch)
                if acc is None:
                    acc = RunningStats(bounds=pack.bounds, unit_axis=pack.unit_axis, hist=None)
                acc.merge(batch)
            if acc is None:
                continue
            if index >= 0 and self.whole:
                at = self.points_at[i] + index * BINS
                acc.hist = LogHistogram(np.rint(a[at : at + BINS]).astype(np.int64))
            elif index >= 0 and acc.n:
                at = self.points_at[i] + index * len(qs)
                acc.hist = PointQuantiles(qs, tuple(float(v) for v in a[at : at + len(qs)]))
            stats[key] = acc
        scalars = {name: float(arrays[i][at]) for name, i, at in self.scalar_at}
        return stats, scalars
