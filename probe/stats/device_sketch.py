"""A run's statistics of values reduced on their device, with each site's quantile sketch summed
where it lies instead of travelling to the host with every batch.

Per batch (`BatchSketches`), each value is reduced on its own device
(`probe.stats.torch_backend.packed_on_device`) and its packed batch split in two
(`probe.stats.device_histograms.split`): the 65,536-bucket histogram stays on the device, and the
rest (the batch's accumulator and its units' rows, a few numbers per unit) of every site of the
batch goes into one buffer, with each histogram's count of occupied buckets, copied to the host
by one non-blocking copy behind an event (`probe.hooks.device.copy_to_host`, the one function
the path moves data through). Nothing waits for the device, and nothing is read into Python.

Each site's partial (`SiteBatch`) is folded into its running statistics as its batch is written
(probe.store.folds.StatsFold, on the writer's thread, once the copy is done): the rest by
`RunningStats.merge` on the host, as every backend's batch (so the counts, extremes and moments
are those of the host path), and the histogram added into a `DeviceHistogram`, on the device,
on the stream that reduced it. A `DeviceHistogram` comes to the host only where it is written
(`fetch`: a flush of /stats, which a resume continues from, and the end), all sketches of a
device in one copy.

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
from probe.stats.device_histograms import Reader, split
from probe.stats.running import LogHistogram, RunningStats

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

    def lanes(self, n: int) -> np.ndarray:
        raise TypeError("a histogram summed on a device takes no counts from CPU threads")

    def occupied(self) -> int:
        return self.at_most if self.stale else int(np.count_nonzero(self._rows[0]))


def fetch(hists: Iterable[DeviceHistogram]) -> None:
    """Bring the device counts of `hists` that changed to the host: those of one device (and
    stream) stacked and copied at once, then read (this waits for the device)."""
    groups: dict[tuple, list[DeviceHistogram]] = {}
    for h in hists:
        if h.stale:
            groups.setdefault((h.device, h.stream), []).append(h)
    for (_, stream), group in groups.items():
        with _on(stream):
            copy = copy_to_host(torch.stack([h.tensor for h in group]))
        counts = np.rint(copy.array()).astype(np.int64)
        for h, row in zip(group, counts, strict=True):
            h._rows = row[None]
            h.stale = False
            h.at_most = int(np.count_nonzero(row))


@dataclass
class SiteBatch:
    """One site's statistics of one batch reduced on its device: the rest of its packed batch in
    the batch's host copy (`copy[start:stop]`, read by `read`; at `buckets_at` its histogram's
    occupied buckets), and its histogram on the device (None: the batch held no value)."""

    copy: HostCopy
    start: int
    stop: int
    buckets_at: int
    read: Reader
    hist: torch.Tensor | None
    stream: torch.cuda.Stream | None
    _host: RunningStats | None = None

    def host(self) -> RunningStats:
        """The batch's statistics but its histogram (waits for the batch's copy)."""
        if self._host is None:
            self._host = self.read(self.copy.array()[self.start : self.stop])
        return self._host

    def fold_into(self, s: RunningStats) -> None:
        """Merge into a run's statistics: the rest on the host, the histogram on its device."""
        rest = self.host()
        self._host = None  # (s may now hold its units: not to be handed out again)
        s.merge(rest)
        if self.hist is not None:
            DeviceHistogram.of(s, self.hist.device, self.stream).add(self.hist, self.buckets)

    @property
    def buckets(self) -> int:
        """Buckets its histogram fills (what it may add to a /stats slot)."""
        return int(self.copy.array()[self.buckets_at]) if self.hist is not None else 0

    @property
    def host_bytes(self) -> int:
        """What this site moves to the host per batch."""
        return (self.stop - self.start + (self.hist is not None)) * 8

    @property
    def nan_count(self) -> int:
        return self.host().nan_count

    @property
    def inf_count(self) -> int:
        return self.host().inf_count


class BatchSketches:
    """One batch's values reduced on their devices (`add`), then its sites' partials with one
    host copy per device (`settle`)."""

    def __init__(self) -> None:
        self.pending: list[tuple[Key, torch.Tensor | None, torch.Tensor, Reader]] = []

    def add(self, key: Key, x: torch.Tensor, bounds, unit_axis: int) -> None:
        """Reduce value `x` (axis 0: rows) of site `key` where it lies (queued: no wait)."""
        x = x.detach()
        rows = x.shape[0] if x.dim() else 1
        packed, layout, width = torch_stats.packed_on_device(x, bounds, unit_axis)
        hist, rest, read = split(packed, layout, rows, unit_axis, width)
        self.pending.append((key, hist, rest, read))

    def settle(self) -> dict[Key, SiteBatch]:
        """Each site's partial; per device, the rests and bucket counts of its sites in one
        buffer started on its way to the host."""
        by_device: dict[torch.device, list] = {}
        for item in self.pending:
            by_device.setdefault(item[2].device, []).append(item)
        self.pending = []
        out: dict[Key, SiteBatch] = {}
        for device, items in by_device.items():
            pieces: list[torch.Tensor] = []
            spans = []
            at = 0
            for _, hist, rest, _ in items:
                pieces.append(rest.reshape(-1).to(torch.float64))
                start, at = at, at + rest.numel()
                buckets_at = -1
                if hist is not None:
                    pieces.append(torch.count_nonzero(hist).reshape(1).to(torch.float64))
                    buckets_at, at = at, at + 1
                spans.append((start, start + rest.numel(), buckets_at))
            copy = copy_to_host(torch.cat(pieces))
            stream = _stream_of(device)
            for (key, hist, _, read), (start, stop, buckets_at) in zip(items, spans, strict=True):
                out[key] = SiteBatch(copy, start, stop, buckets_at, read, hist, stream)
        return out


def fetch_all(stats: Iterable[RunningStats]) -> None:
    """The device sketches of `stats` brought to the host, one copy per device."""
    fetch(s.hist for s in stats if isinstance(s.hist, DeviceHistogram))
