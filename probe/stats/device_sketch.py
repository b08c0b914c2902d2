"""A run's statistics of values reduced on their device, with each site's quantile sketch and
per-unit statistics merged where they lie instead of travelling to the host with every batch.

Per batch (`BatchSketches`), each value is reduced on its own device
(`probe.stats.torch_backend.packed_on_device`); at the batch's end the packs of all its sites on
a device are read together there (`probe.stats.batched_read`: about a hundred operations for
all of them) into each site's batch accumulator, its units' rows and its histogram, and the
accumulators of every site, with each histogram's count of occupied buckets (88 bytes a site),
go into one buffer copied to the host by one non-blocking copy behind an event
(`probe.hooks.device.copy_to_host`, the one function the path moves data through). Nothing waits
for the device, and nothing is read into Python.

Each batch is folded into the sites' running statistics as it is written (`fold_all`, from
probe.store.folds.StatsFold on the writer's thread, once the copy is done): the accumulators by
`RunningStats.merge` on the host, as every backend's batch (Chan's formula), the units' rows of
all its sites into their `DeviceUnits` (probe.stats.device_units: six operations) and the
histograms into their `DeviceHistogram`s (one multi-tensor add), on the device, on the stream
that reduced them: additions and comparisons, exact. Those come to the host only where they are
written (`probe.stats.device_fetch.fetch`: a flush of /stats, which a resume continues from, and the end), all of a
device in one copy; a resumed run's, read from its file, go back to the device at its first
batch.

On the CPU (`stats.backend=torch`) the same path runs, the copy being the buffer itself: it is
the portable reference the tests run.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from probe.hooks.device import HostCopy, copy_to_host
from probe.stats import torch_backend as torch_stats
from probe.stats.batched_read import HEAD, BatchRead, PackedSite, read
from probe.stats.device_fetch import fetch, on_stream
from probe.stats.device_units import DeviceUnits, merge_batch
from probe.stats.running import LogHistogram, RunningStats
from probe.stats.stat_columns import BATCH, BATCH_AT, by_name

Key = tuple[str, str]
BINS = LogHistogram.BINS
_N, _NANS, _INFS = BATCH_AT["n"], BATCH_AT["nan_count"], BATCH_AT["inf_count"]


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
        with on_stream(stream), torch.inference_mode(False):
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
        with on_stream(self.stream):
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
        with on_stream(self.stream):
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


@dataclass
class _DeviceBatch:
    """The sites of one batch on one device, read there (`read`), their accumulators and bucket
    counts on their way to the host (`copy`)."""

    copy: HostCopy
    read: BatchRead
    stream: torch.cuda.Stream | None


@dataclass
class SiteBatch:
    """One site's statistics of one batch reduced on its device: its accumulator (and its
    histogram's occupied buckets) in the batch's host copy, its units' rows and histogram on the
    device, at its place (`index`) in the batch's read."""

    batch: _DeviceBatch
    index: int
    rows: int
    unit_axis: int
    width: int
    tracked: bool
    _host: RunningStats | None = field(default=None, repr=False)

    @property
    def _row(self) -> int | None:
        return self.batch.read.row[self.index]

    def host(self) -> RunningStats:
        """The batch's accumulator, without histogram or units (waits for the batch's copy)."""
        if self._host is None:
            row = self._row
            if row is None:  # (no value at all: its rows alone, as every backend gives it)
                self._host = RunningStats(rows=self.rows, hist=None, unit_axis=self.unit_axis)
            else:
                head = self.batch.copy.array()[row * HEAD : (row + 1) * HEAD].tolist()
                values = [int(v) if s.integer else v for s, v in zip(BATCH, head, strict=True)]
                self._host = RunningStats(self.rows, **by_name(values), hist=None,
                                          unit_axis=self.unit_axis)  # fmt: skip
        return self._host

    def fold_into(self, s: RunningStats) -> None:
        """Merge into a run's statistics (alone: `fold_all` merges a batch's sites together)."""
        fold_all([(s, self)])

    @property
    def buckets(self) -> int:
        """Buckets its histogram fills (what it may add to a /stats slot)."""
        row = self._row
        if row is None:
            return 0
        return int(self.batch.copy.array()[len(self.batch.read.heads) * HEAD + row])

    @property
    def host_bytes(self) -> int:
        """What this site moves to the host per batch."""
        return (HEAD + 1) * 8 if self._row is not None else 0

    @property
    def nan_count(self) -> int:
        return self.host().nan_count

    @property
    def inf_count(self) -> int:
        return self.host().inf_count


def fold_all(pairs: list[tuple[RunningStats, SiteBatch]]) -> None:
    """Merge each batch partial into its site's running statistics: the accumulators on the
    host (Chan's formula), the units and histograms of each batch's sites together on their
    device (a few operations for all of them)."""
    groups: dict[int, tuple[_DeviceBatch, list[tuple[RunningStats, SiteBatch]]]] = {}
    for s, b in pairs:
        s.merge(b.host())
        groups.setdefault(id(b.batch), (b.batch, []))[1].append((s, b))
    for batch, items in groups.values():
        got, stream = batch.read, batch.stream
        device = got.hists.device
        units: list[DeviceUnits] = []
        columns: list[tuple[int, int]] = []
        hists: list[DeviceHistogram] = []
        rows: list[int] = []
        for s, b in items:
            row, at = got.row[b.index], got.unit_at[b.index]
            if row is None:
                continue
            if at is not None:
                s.units = DeviceUnits.of(s.units, b.width, b.tracked, device, stream)
                units.append(s.units)
                columns.append((at, b.width))
            hist = DeviceHistogram.of(s, device, stream)
            hist.at_most = min(BINS, hist.at_most + b.buckets)
            hist.stale = True
            hists.append(hist)
            rows.append(row)
        if units and got.units is not None:
            merge_batch(units, _columns(got.units, columns))
        if hists:
            with on_stream(stream):
                torch._foreach_add_([h.tensor for h in hists], [got.hists[r] for r in rows])


def _columns(units: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """The units' columns of `spans` ((first, width) each) laid end to end (all of them, in
    order: the tensor itself)."""
    at = 0
    for first, width in spans:
        if first != at:
            break
        at += width
    else:
        if at == units.shape[1]:
            return units
    return torch.cat([units[:, a : a + w] for a, w in spans], 1)


class BatchSketches:
    """One batch's values reduced on their devices (`add`), then its sites' partials with one
    host copy per device (`settle`)."""

    def __init__(self) -> None:
        self.pending: list[tuple[Key, PackedSite, int, int]] = []

    def add(self, key: Key, x: torch.Tensor, bounds, unit_axis: int) -> None:
        """Reduce value `x` (axis 0: rows) of site `key` where it lies (queued: no wait)."""
        x = x.detach()
        rows = x.shape[0] if x.dim() else 1
        packed, layout, width = torch_stats.packed_on_device(x, bounds, unit_axis)
        tracked = layout.tracked if layout is not None else bounds is not None and width > 0
        site = PackedSite(packed, layout, width, tracked, x.numel() == 0)
        self.pending.append((key, site, rows, unit_axis))

    def settle(self) -> dict[Key, SiteBatch]:
        """Each site's partial; per device, its sites read together and their accumulators and
        bucket counts in one buffer started on its way to the host."""
        by_device: dict[torch.device, list[tuple[Key, PackedSite, int, int]]] = {}
        for item in self.pending:
            by_device.setdefault(item[1].packed.device, []).append(item)
        self.pending = []
        out: dict[Key, SiteBatch] = {}
        for device, items in by_device.items():
            got = read([site for _, site, _, _ in items])
            copy = copy_to_host(torch.cat([got.heads.reshape(-1), got.buckets.to(torch.float64)]))
            batch = _DeviceBatch(copy, got, _stream_of(device))
            for index, (key, site, rows, unit_axis) in enumerate(items):
                out[key] = SiteBatch(batch, index, rows, unit_axis, site.width, site.tracked)
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
