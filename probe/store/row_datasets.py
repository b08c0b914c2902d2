"""The rows a run's batches bring to its file: where each capture's and each run part's rows go,
and the chunked datasets made the first time one comes.

A batch's record holds per-sample, per-token and per-batch tensors by name (`/layers/<layer>/
<site>` captures, `/model/output`, `/lens/...`, `/effects/...`) and arrays written whole once
(`Outputs.once`); `Rows` appends them at the rows the batch owns and counts what is written.
A site that skipped some batches (data-dependent control flow) gets its missing rows filled and
listed under /coverage (probe.store.coverage). A stats-only file holds no captures: its
per-sample outputs wait for the next flush (`held`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import h5py
import numpy as np
import torch

from probe.errors import WriteError
from probe.hooks.record import Record
from probe.store import direct
from probe.store.chunks import (
    ChunkedDataset,
    Chunking,
    direct_plist,
    make_dataset,
    name_axes,
    row_bytes,
    row_kind,
)
from probe.store.coverage import Coverage
from probe.store.fileformat import layer_path
from probe.store.stats_file import DatasetInfo, tags

ROW_DIMS = ("sample", "token", "batch")


class Placement(NamedTuple):
    """Where one capture's rows go: rows lo..hi of its dataset (per batch: one row), its unit
    axis, and whether its rows are tokens."""

    key: tuple[str, str]
    t: torch.Tensor
    lo: int
    hi: int
    per_batch: bool
    axis: int
    by_token: bool


class Rows:
    """The row datasets of one file and what has been written to them. `file` gives the open
    h5py file (it is reopened when the file leaves SWMR mode), `creating` leaves SWMR mode so
    that objects can be made; `layout` says the file's chunking, compression and storage mode,
    `module_types` the captured layers' types, `first_sample` a shard's first sample in the
    whole dataset, `provenance` the dataset's per-sample names."""

    def __init__(self, file: Callable[[], h5py.File], creating: Callable[[], None], *,
                 mode: str, chunking: Chunking, compression: str | None, compression_opts,
                 module_types: dict[str, str], first_sample: int = 0, provenance=None,
                 direct_fd: int | None = None) -> None:  # fmt: skip
        self._file, self._creating = file, creating
        self.mode, self.chunking = mode, chunking
        self.compression, self.compression_opts = compression, compression_opts
        self.module_types, self.first_sample = module_types, first_sample
        self.provenance, self.direct_fd = provenance, direct_fd
        self.direct_writes: list | None = None  # a batch's whole chunks, written together
        self.datasets: dict[tuple[str, str], DatasetInfo] = {}  # captures, by (layer, site)
        self.orders: dict[tuple[str, str], int] = {}  # each capture's place in the run's tables
        self.chunked: dict[str, ChunkedDataset] = {}  # by HDF5 path, as appended to
        self.file_chunking: dict[str, int | None] = {}  # rows per chunk in the file, by path
        self.known: set[str] = set()  # HDF5 paths of the datasets (and groups) the file holds
        self.coverage = Coverage()
        self.num_samples = self.num_batches = 0
        self.num_tokens = 0  # rows of the token-row datasets
        # per-sample outputs a stats-only file writes at its next flush
        self.held: list[tuple[str, np.ndarray, int, int]] = []
        self.held_bytes = 0

    @property
    def file(self) -> h5py.File:
        return self._file()

    def dropped_handles(self) -> None:
        """The file was reopened: the dataset handles taken before are closed."""
        self.chunked.clear()
        self.file_chunking.clear()

    # -- a batch ---------------------------------------------------------------------------
    def needs_objects(self, r: Record) -> bool:
        """Whether `r` brings a dataset the file does not hold yet (created outside SWMR mode)."""
        keys = [k for k in [*r.values, *r.per_batch] if k not in r.plain]
        if any(key not in self.datasets for key in keys):
            return True
        if self.mode == "full" and any(layer_path(*k) not in self.known for k in r.plain):
            return True
        gaps = any(
            self.coverage.needs_dataset(self.file, key, lo)
            for key, _, lo, *_ in self.placements(r, r.start + r.size)
        )
        if any(n not in self.known for n in [*r.outputs.batches, *r.outputs.once]):
            return True
        if gaps or self.mode != "full":
            return gaps
        names = [*r.outputs.samples, *(r.tokens or {})] + (
            ["samples/target"] if r.targets is not None else []
        )
        return any(n not in self.known for n in names)

    def append_batch(self, r: Record) -> None:
        """Every row of `r` at its place (its datasets made on first sight), then the counts."""
        end = r.start + r.size
        self.direct_writes = [] if self.direct_fd is not None else None
        try:
            self._append_batch(r, end)
            self._write_direct()
        finally:
            self.direct_writes = None
        self.num_samples, self.num_batches = end, r.batch_index + 1
        self.num_tokens += r.token_count

    def placements(self, r: Record, end: int) -> list[Placement]:
        """Where the rows of each capture of `r` go."""
        tokens = (self.num_tokens, self.num_tokens + r.token_count)
        out = []
        for key, t in r.values.items():
            by_token = key in r.token_keys
            lo, hi = tokens if by_token else (r.start, end)
            out.append(Placement(key, t, lo, hi, False, r.axes.get(key, 1), by_token))
        for key, t in r.per_batch.items():
            out.append(Placement(key, t, r.batch_index, r.batch_index + 1, True, 1, False))
        return out

    def _append_batch(self, r: Record, end: int) -> None:
        for place in self.placements(r, end):
            if place.key in r.plain:
                attrs = {**r.plain[place.key], "unit_axis": place.axis}
                self._append_unstated(place, place.t.numpy(), attrs)
                continue
            self._append(place, r)
        tokens = (self.num_tokens, self.num_tokens + r.token_count)
        if self.mode == "full" and r.tokens is not None:
            for name, a in r.tokens.items():  # samples as in samples/index: dataset-wide
                offset = self.first_sample if name == "tokens/sample" else 0
                self.append_plain(name, a + offset if offset else a, *tokens, kind="token")
        self._append_outputs(r, end)
        if self.mode == "full":
            index = np.arange(r.start, end, dtype=np.int64) + self.first_sample
            self.append_plain("samples/index", index, r.start, end)
            if r.targets is not None:
                self.append_plain("samples/target", r.targets.cpu().numpy(), r.start, end)
            if self.provenance is not None and self.provenance.per_sample:
                for name, values in self.provenance.samples(index).items():
                    self.append_plain(f"samples/{name}", values, r.start, end)

    def _append_outputs(self, r: Record, end: int) -> None:
        """The parts' named outputs: rows per sample, arrays written once, a row per batch."""
        out = r.outputs
        for name, t in out.samples.items():
            if self.mode == "stats":  # written with the statistics, at the flush
                self.held.append((name, t.numpy(), r.start, end))
                self.held_bytes += self.held[-1][1].nbytes
            else:
                self.append_plain(name, t.numpy(), r.start, end)
        for name, a in out.once.items():  # (a lens's first samples: written with the first batch)
            if name not in self.known:
                self._write_once(name, np.asarray(a))
        for name, a in out.batches.items():
            new = name not in self.known
            self.append_plain(name, a, r.batch_index, r.batch_index + 1, kind="batch")
            if new:  # (which rows are valid: batches)
                self.chunked[name].ds.attrs["per_batch"] = True

    def _write_once(self, name: str, a: np.ndarray) -> None:
        if name not in self.file:
            if a.dtype.kind in "UO":
                self.file.create_dataset(name, data=a.astype(object), dtype=h5py.string_dtype())
            else:
                self.file.create_dataset(name, data=a)
        self.known.add(name)

    def _write_direct(self) -> None:
        """The batch's whole chunks in as few O_DIRECT writes as their places in the file allow;
        those O_DIRECT cannot take go through HDF5."""
        pending, fd = self.direct_writes, self.direct_fd
        if not pending:
            return
        if fd is None:  # (append_batch collects direct writes only with a descriptor)
            raise RuntimeError("direct writes pending without an O_DIRECT descriptor")
        done = direct.write_chunks(fd, [(t.ds, a, lo, t.rows) for t, a, lo in pending])
        for (target, a, lo), written in zip(pending, done, strict=True):
            if not written:
                target.write_direct_chunks(a, lo)

    def write_held(self) -> None:
        """A stats-only file's held per-sample outputs (at a flush)."""
        if self.held and any(n not in self.known for n, *_ in self.held):
            self._creating()
        for name, a, lo, hi in self.held:
            self.append_plain(name, a, lo, hi)
        self.held.clear()
        self.held_bytes = 0

    def _append(self, place: Placement, r: Record) -> None:
        """One capture of `r`: its dataset described on first sight, its rows written."""
        key, t, lo, hi, per_batch, unit_axis, by_token = place
        info = self.datasets.get(key)
        if info is None:
            info = DatasetInfo(
                key[0], key[1], self.module_types.get(key[0], ""), tuple(t.shape[1:]),
                str(t.dtype).removeprefix("torch."), per_batch=per_batch,
                rows="tokens" if by_token else "samples", unit_axis=unit_axis,
            )  # fmt: skip
            self.datasets[key] = info
            self.orders[key] = len(self.orders)
        gap = self.coverage.add(self.file, key, lo, hi)
        if self.mode != "full" or key in r.unstored:
            return
        name = layer_path(*key)
        if name not in self.known:
            self._create_capture(name, info, t.numpy(), self.orders[key])
        if gap is not None:
            self.chunked[name].fill(*gap)
        self.append_plain(name, t.numpy(), lo, hi)  # created above, by its kind

    def _append_unstated(self, place: Placement, a: np.ndarray, attrs: dict) -> None:
        """A dataset of the layer's rows with no statistics (an SAE's sparse latents)."""
        key, lo, hi, by_token = place.key, place.lo, place.hi, place.by_token
        if self.mode != "full":
            return
        name = layer_path(*key)
        if name not in self.known:
            ds = self._create(name, a, "token" if by_token else "sample")
            ds.attrs.update(
                {**attrs, "site": key[1], "row_unit": "tokens" if by_token else "samples"}
            )
            self.chunked[name] = ChunkedDataset(ds)
        self.append_plain(name, a, lo, hi)

    def _create_capture(self, name: str, info: DatasetInfo, a: np.ndarray, order: int) -> None:
        """A layer's dataset, tagged with what it is and with named dimensions."""
        g = self.file.require_group(name.rsplit("/", 1)[0])
        if "order" not in g.attrs:  # lets a file cut short say what each layer is, in order
            g.attrs["name"] = info.layer
            g.attrs["module_type"] = info.module_type
            g.attrs["order"] = order
        ds = self._create(name, a, row_kind(info.per_batch, info.rows))
        for k, v in tags(info, order).items():
            ds.attrs[k] = v
        name_axes(self.file, ds, info.unit_axis, info.rows, info.per_batch, self.chunking.samples)
        self.known.update(d for d in ROW_DIMS if d in self.file)
        self.chunked[name] = ChunkedDataset(ds)

    def append_plain(
        self, name: str, a: np.ndarray, lo: int, hi: int, kind: str = "sample"
    ) -> None:
        target = self.chunked.get(name)
        if target is None:
            ds = self.file.get(name)
            if ds is None:
                if lo != 0:
                    raise WriteError(f"dataset {name!r} appeared first at row {lo}")
                ds = self._create(name, a, kind)
            target = self.chunked[name] = ChunkedDataset(ds)
        target.append(a, lo, hi, self.direct_writes)

    def _create(self, name: str, a: np.ndarray, kind: str) -> h5py.Dataset:
        size = row_bytes(a)
        rows = self.chunking.rows(kind, len(a), size)
        plist = direct_plist(rows * size, self.chunking.compressed, self.direct_fd, a.dtype)
        self.known.add(name)
        return make_dataset(
            self.file, name, a, rows, self.compression, self.compression_opts, plist
        )

    # -- the end -------------------------------------------------------------------------
    def resize_dims(self) -> None:
        """The pure dimensions' lengths: the rows written."""
        for dim, n in (("token", self.num_tokens), ("batch", self.num_batches)):
            if dim in self.known:
                self.file[dim].resize((n,))

    def close_coverage(self) -> None:
        """Rows a site missed at the end of the run (it did not run for the last batches)."""
        missing = []
        for key, info in self.datasets.items():
            total = self.valid(info)
            if self.coverage.gap_before(key, total) is not None:
                missing.append((key, total))
        if not missing:
            return
        if any(self.coverage.needs_dataset(self.file, k, n) for k, n in missing):
            self._creating()
        for key, total in missing:
            gap = self.coverage.add(self.file, key, total, total)
            name = layer_path(*key)
            if self.mode == "full" and gap is not None and name in self.file:
                if name not in self.chunked:  # (statistics-only sites have no dataset)
                    self.chunked[name] = ChunkedDataset(self.file[name])
                self.chunked[name].fill(*gap)

    def valid(self, info: DatasetInfo) -> int:
        """How many rows of a capture are written: batches, tokens or samples."""
        if info.per_batch:
            return self.num_batches
        return self.num_tokens if info.rows == "tokens" else self.num_samples
