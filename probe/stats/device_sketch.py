"""A run's statistics of values reduced on their device, with each site's quantile sketch and
per-unit statistics merged where they lie instead of travelling to the host with every batch.

Per batch (`BatchSketches`), each value is reduced on its own device
(`probe.stats.torch_backend.packed_on_device`) and its packed batch split
(`probe.stats.device_histograms.split`; the fused reduction's rows read there into the
reference's packing: `probe.stats.fused_repack`): the 65,536-bucket histogram and the units' rows
stay on the device, and the batch's scalars (its accumulator, a dozen numbers) of every site of
the batch go into one buffer, with each histogram's count of occupied buckets, copied to the
host by one non-blocking copy behind an event (`probe.hooks.device.copy_to_host`, the one
function the path moves data through). Nothing waits for the device, and nothing is read into
Python.

Each site's partial (`SiteBatch`) is folded into its running statistics as its batch is written
(probe.store.folds.StatsFold, on the writer's thread, once the copy is done): the scalars by
`RunningStats.merge` on the host, as every backend's batch (Chan's formula for the moments), the
units' rows into a `DeviceUnits` and the histogram into a `DeviceHistogram`, on the device, on
the stream that reduced them (additions and comparisons: exact). Those come to the host only
where they are written (`fetch`: a flush of /stats, which a resume continues from, and the end),
all of a device in one copy; a resumed run's, read from its file, go back to the device at its
first batch.

On the CPU (`stats.backend=torch`) the same path runs, the copy being the buffer itself: it is
the portable reference the tests run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from probe.hooks.device import HostCopy, copy_to_host
from probe.stats import torch_backend as torch_stats
from probe.stats.device_histograms import split
from probe.stats.fused_repack import repacked
from probe.stats.running import LogHistogram, RunningStats, UnitStats
from probe.stats.stat_columns import BATCH_AT, PACKED_HEAD, batch_values, by_name
from probe.stats.torch_backend import UNIT_ROWS

Key = tuple[str, str]
BINS = LogHistogram.BINS


def _on(stream: torch.cuda.Stream | None):
    """Work queued on `stream` (that which reduced the batches: their order is its order)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _stream_of(device: torch.device) -> torch.cuda.Stream | None:
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


class DeviceHistogram(LogHistogram):
    """A run's quantile sketch whose counts are summed on a device (`add`, float64: exact below
    2**53 values). `counts` is the host's copy, brought over (`fetch`) only when the device's has
    changed since: a run asks for it where it writes the sketch. `occupied` answers without
    bringing it: the buckets known at the last fetch plus those each batch since filled."""

    def __init__(self, device: torch.device, stream: torch.cuda.Stream | None = None,
                 counts: np.ndarray | None = None) -> None:  # fmt: skip
        super().__init__(None if counts is None else np.asarray(counts, dtype=np.int64).copy())
        self.device, self.stream = torch.device(device), stream
        # (a normal tensor, whatever the mode: batches are added in and out of inference mode)
        with _on(stream), torch.inference_mode(False):
            if counts is None or not counts.any():
                self.tensor = torch.zeros(BINS, dtype=torch.float64, device=self.device)
            else:
                start = torch.from_numpy(np.asarray(counts, dtype=np.float64))
                if self.device.type == "cuda":
                    start = start.pin_memory()
                self.tensor = start.to(self.device, non_blocking=True)
        self.stale = False  # whether the device's counts moved since the host's copy
        self.at_most = int(np.count_nonzero(self._rows[0]))

    @classmethod
    def of(cls, s: RunningStats, device: torch.device,
           stream: torch.cuda.Stream | None) -> DeviceHistogram:  # fmt: skip
        """`s`'s histogram on `device`: the one there, else one holding `s`'s counts so far (a
        resumed run's, read from its file), which becomes `s.hist`."""
        hist = s.hist
        if isinstance(hist, DeviceHistogram) and hist.device == torch.device(device):
            return hist
        counts = None if hist is None else s.whole_histogram().counts
        made = cls(device, stream, counts)
        s.hist = made
        return made

    def add(self, counts: torch.Tensor, buckets: int) -> None:
        """Add one batch's counts (on this histogram's device), which fill `buckets` buckets."""
        with _on(self.stream):
            self.tensor.add_(counts)
        self.stale = True
        self.at_most = min(BINS, self.at_most + buckets)

    @property
    def counts(self) -> np.ndarray:
        if self.stale:
            fetch([self])
        return self._rows[0]

    def merge(self, other) -> None:
        """Another histogram's counts added on the device."""
        if isinstance(other, DeviceHistogram) and other.device == self.device:
            self.add(other.tensor, other.occupied())
            return
        counts = np.zeros(BINS, dtype=np.int64)
        other.add_to(counts)
        with _on(self.stream):
            self.add(torch.from_numpy(counts.astype(np.float64)).to(self.device),
                     int(np.count_nonzero(counts)))  # fmt: skip

    def receive(self, values: np.ndarray) -> None:
        """Its device's counts, brought over by `fetch`."""
        row = np.rint(values).astype(np.int64)
        self._rows = row[None]
        self.stale = False
        self.at_most = int(np.count_nonzero(row))

    def lanes(self, n: int) -> np.ndarray:
        raise TypeError("a histogram summed on a device takes no counts from CPU threads")

    def occupied(self) -> int:
        return self.at_most if self.stale else int(np.count_nonzero(self._rows[0]))


def fetch(items: Iterable[DeviceHistogram | DeviceUnits]) -> None:
    """Bring the device values of `items` (sketches, units) that changed to the host: those of
    one device (and stream) laid end to end and copied at once, then read (this waits for the
    device)."""
    groups: dict[tuple, list[DeviceHistogram | DeviceUnits]] = {}
    for item in items:
        if item.stale:
            groups.setdefault((item.device, item.stream), []).append(item)
    for (_, stream), group in groups.items():
        with _on(stream):
            copy = copy_to_host(torch.cat([item.tensor.reshape(-1) for item in group]))
        values = copy.array()
        at = 0
        for item in group:
            size = item.tensor.numel()
            item.receive(values[at : at + size])
            at += size


class DeviceUnits(UnitStats):
    """A run's per-unit statistics merged on a device: the UNIT_FIELDS rows of a batch's
    packing, counts and sums added, extremes compared as `UnitStats.merge` does (numpy's
    minimum and maximum). The fields are the host's copy, brought over (`fetch`) only when the
    device's changed since, and read-only (the dataclass's fields become properties: hence the
    type checker's overrides below); `width` and `tracked` answer without it."""

    def __init__(self, rows: torch.Tensor, tracked: bool,
                 stream: torch.cuda.Stream | None = None) -> None:  # fmt: skip
        with _on(stream), torch.inference_mode(False):
            self.tensor = rows.to(torch.float64).clone()
        self.device, self.stream, self._tracked = rows.device, stream, tracked
        self.stale = True
        self._host: UnitStats | None = None

    @classmethod
    def into(cls, s: RunningStats, rows: torch.Tensor, tracked: bool,
             stream: torch.cuda.Stream | None) -> None:  # fmt: skip
        """Merge one batch's unit rows into `s.units`: they become its units where it has
        none yet; host units (a resumed run's, read from its file) are moved to the device."""
        units = s.units
        if units is None:
            s.units = cls(rows, tracked, stream)
            return
        if not isinstance(units, DeviceUnits) or units.device != rows.device:
            held = torch.from_numpy(np.vstack([units.packed(), np.zeros((1, units.width))])[:6])
            units = s.units = cls(held.to(rows.device), units.tracked, stream)
        units.add(rows)

    def add(self, rows: torch.Tensor) -> None:
        t = self.tensor
        with _on(self.stream):
            t[0:2].add_(rows[0:2])  # count, sum
            t[4:6].add_(rows[4:6])  # positive, saturated
            t[2] = torch.where(t[2] < rows[2], t[2], rows[2])
            t[3] = torch.where(t[3] > rows[3], t[3], rows[3])
        self.stale = True

    def merge(self, b: UnitStats) -> None:
        if b.width != self.width:
            raise ValueError(f"unit counts differ: {self.width} vs {b.width}")
        if isinstance(b, DeviceUnits) and b.device == self.device:
            self.add(b.tensor)
            return
        held = np.vstack([b.packed(), np.zeros((1, b.width))])[:6]
        self.add(torch.from_numpy(held).to(self.device))

    def receive(self, values: np.ndarray) -> None:
        rows = np.asarray(values, dtype=np.float64).reshape(6, -1)
        self._host = UnitStats.unpacked(rows if self._tracked else rows[:5])
        self.stale = False

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


@dataclass
class SiteBatch:
    """One site's statistics of one batch reduced on its device: its scalars (the batch's
    accumulator, in the reference's packed head) in the batch's host copy at `start`, with its
    histogram's occupied buckets at `buckets_at`; its units' rows (UNIT_FIELDS x width, None:
    no units) and its histogram (None: the batch held no value) on the device."""

    copy: HostCopy
    start: int
    buckets_at: int
    rows: int
    unit_axis: int
    hist: torch.Tensor | None
    units: torch.Tensor | None
    tracked: bool  # whether the units count saturation
    stream: torch.cuda.Stream | None
    _host: RunningStats | None = None

    def host(self) -> RunningStats:
        """The batch's scalars, without histogram or units (waits for the batch's copy)."""
        if self._host is None:
            head = self.copy.array()[self.start : self.start + PACKED_HEAD]
            batch = batch_values(head.tolist())
            if batch[BATCH_AT["n"]] + batch[BATCH_AT["nan_count"]] + batch[BATCH_AT["inf_count"]]:
                self._host = RunningStats(self.rows, **by_name(batch), hist=None,
                                          unit_axis=self.unit_axis)  # fmt: skip
            else:  # (no value at all: its rows alone, as every backend gives an empty batch)
                self._host = RunningStats(rows=self.rows, hist=None, unit_axis=self.unit_axis)
        return self._host

    def fold_into(self, s: RunningStats) -> None:
        """Merge into a run's statistics: the scalars on the host (Chan's formula), the units
        and the histogram on their device."""
        rest = self.host()
        s.merge(rest)
        if self.units is not None and rest.n + rest.nan_count + rest.inf_count:
            DeviceUnits.into(s, self.units, self.tracked, self.stream)
        if self.hist is not None:
            DeviceHistogram.of(s, self.hist.device, self.stream).add(self.hist, self.buckets)

    @property
    def buckets(self) -> int:
        """Buckets its histogram fills (what it may add to a /stats slot)."""
        return int(self.copy.array()[self.buckets_at]) if self.hist is not None else 0

    @property
    def host_bytes(self) -> int:
        """What this site moves to the host per batch."""
        return (PACKED_HEAD + (self.hist is not None)) * 8

    @property
    def nan_count(self) -> int:
        return self.host().nan_count

    @property
    def inf_count(self) -> int:
        return self.host().inf_count


@dataclass
class _Reduced:
    """One value's reduction on its device, until the batch settles."""

    key: Key
    hist: torch.Tensor | None
    head: torch.Tensor
    units: torch.Tensor | None
    tracked: bool
    rows: int
    unit_axis: int


class BatchSketches:
    """One batch's values reduced on their devices (`add`), then its sites' partials with one
    host copy per device (`settle`)."""

    def __init__(self) -> None:
        self.pending: list[_Reduced] = []

    def add(self, key: Key, x: torch.Tensor, bounds, unit_axis: int) -> None:
        """Reduce value `x` (axis 0: rows) of site `key` where it lies (queued: no wait)."""
        x = x.detach()
        rows = x.shape[0] if x.dim() else 1
        packed, layout, width = torch_stats.packed_on_device(x, bounds, unit_axis)
        hist, rest, _ = split(packed, layout, rows, unit_axis, width)
        tracked = bounds is not None and width > 0
        if layout is not None:  # the fused reduction's rows: read where they lie
            rest, tracked = repacked(rest, layout), layout.tracked
        units = rest[PACKED_HEAD:].view(UNIT_ROWS, width) if width else None
        head = rest[:PACKED_HEAD]
        self.pending.append(_Reduced(key, hist, head, units, tracked, rows, unit_axis))

    def settle(self) -> dict[Key, SiteBatch]:
        """Each site's partial; per device, the scalars and bucket counts of its sites in one
        buffer started on its way to the host."""
        by_device: dict[torch.device, list[_Reduced]] = {}
        for item in self.pending:
            by_device.setdefault(item.head.device, []).append(item)
        self.pending = []
        out: dict[Key, SiteBatch] = {}
        for device, items in by_device.items():
            pieces: list[torch.Tensor] = []
            spans = []
            at = 0
            for item in items:
                pieces.append(item.head.to(torch.float64))
                start, at = at, at + PACKED_HEAD
                buckets_at = -1
                if item.hist is not None:
                    pieces.append(torch.count_nonzero(item.hist).reshape(1).to(torch.float64))
                    buckets_at, at = at, at + 1
                spans.append((start, buckets_at))
            copy = copy_to_host(torch.cat(pieces))
            stream = _stream_of(device)
            for i, (start, buckets_at) in zip(items, spans, strict=True):
                out[i.key] = SiteBatch(copy, start, buckets_at, i.rows, i.unit_axis, i.hist,
                                       i.units, i.tracked, stream)  # fmt: skip
        return out


def fetch_all(stats: Iterable[RunningStats]) -> None:
    """The device sketches and units of `stats` brought to the host, one copy per device."""
    items: list[DeviceHistogram | DeviceUnits] = []
    for s in stats:
        if isinstance(s.hist, DeviceHistogram):
            items.append(s.hist)
        if isinstance(s.units, DeviceUnits):
            items.append(s.units)
    fetch(items)
