"""How one batch's arrays land in probe.h5: where each capture's rows go, the datasets made on
first sight (tagged, with named dimensions, /stats slots and coverage), and the appends.

`ProbeWriter` (probe.store.writer) inherits this; it owns the file's lifecycle, the queue and flushes.
"""

from __future__ import annotations

import h5py
import numpy as np
import torch

from probe.errors import WriteError
from probe.hooks.record import Record
from probe.stats.running import stats_for
from probe.stats.topk import TopKState
from probe.store import direct, stats_file
from probe.store.chunks import (
    ChunkedDataset,
    direct_plist,
    make_dataset,
    name_axes,
    row_bytes,
    row_kind,
)
from probe.store.fileformat import encode, layer_path
from probe.store.stats_file import DatasetInfo, tags

ROW_DIMS = ("sample", "token", "batch")


class Appends:
    """The per-batch writing half of ProbeWriter (see there for the attributes it uses)."""

    def _stats_groups(self) -> None:
        """The /stats group of every dataset (a resumed file may lack some)."""
        if self.stats_during == "none":
            return
        paths = {key: f"stats/{encode(key[0])}/{encode(key[1])}" for key in self.datasets}
        missing = [key for key, p in paths.items() if p not in self.known]
        if missing and self.out.live:
            self._creating()
        for order, (key, info) in enumerate(self.datasets.items()):
            if key in missing:
                stats_file.create(self.file, info, order)
                self.known.add(paths[key])

    def _placements(self, r: Record, end: int) -> list[tuple]:
        """(key, tensor, lo, hi, per_batch, unit axis, by token) of each capture of `r`: where
        its rows go."""
        tokens = (self.num_tokens, self.num_tokens + r.token_count)
        out = []
        for key, t in r.values.items():
            by_token = key in r.token_keys
            lo, hi = tokens if by_token else (r.start, end)
            out.append((key, t, lo, hi, False, r.axes.get(key, 1), by_token))
        for key, t in r.per_batch.items():
            out.append((key, t, r.batch_index, r.batch_index + 1, True, 1, False))
        return out

    def _append_batch(self, r: Record, end: int) -> None:
        for key, t, lo, hi, per_batch, axis, by_token in self._placements(r, end):
            if key in r.plain:
                self._append_unstated(
                    key, t.numpy(), lo, hi, by_token, {**r.plain[key], "unit_axis": axis}
                )
                continue
            self._append(
                key, t, lo, hi, per_batch, r.counted.get(key), axis, by_token, r.topk.get(key),
                store=key not in r.unstored,
            )  # fmt: skip
        tokens = (self.num_tokens, self.num_tokens + r.token_count)
        if self.mode == "full" and self.token_layers and r.tokens is not None:
            for name, a in r.tokens.items():  # samples as in samples/index: dataset-wide
                offset = self.index_offset if name == "tokens/sample" else 0
                self._append_plain(name, a + offset if offset else a, *tokens, kind="token")
        for name, t in r.extra.items():
            if self.mode == "stats":  # written with the statistics, at the flush
                self.held.append((name, t.numpy(), r.start, end))
                self.held_bytes += self.held[-1][1].nbytes
            else:
                self._append_plain(name, t.numpy(), r.start, end)
        for name, a in r.once.items():  # (a lens's first samples: written with the first batch)
            if name not in self.known:
                self._write_once(name, np.asarray(a))
        for name, a in r.batch_rows.items():
            new = name not in self.known
            self._append_plain(name, a, r.batch_index, r.batch_index + 1, kind="batch")
            if new:  # (which rows are valid: batches)
                self.chunked[name].ds.attrs["per_batch"] = True
        if self.mode == "full":
            self._append_plain(
                "samples/index",
                np.arange(r.start, end, dtype=np.int64) + self.index_offset,
                r.start,
                end,
            )
            if r.targets is not None:
                self._append_plain("samples/target", r.targets.cpu().numpy(), r.start, end)
            if self.provenance is not None and self.provenance.per_sample:
                index = np.arange(r.start, end, dtype=np.int64) + self.index_offset
                for name, values in self.provenance.samples(index).items():
                    self._append_plain(f"samples/{name}", values, r.start, end)

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
        pending = self.direct_writes
        if not pending:
            return
        done = direct.write_chunks(self.direct_fd, [(t.ds, a, lo, t.rows) for t, a, lo in pending])
        for (target, a, lo), written in zip(pending, done, strict=True):
            if not written:
                target.write_direct_chunks(a, lo)

    def _write_held(self) -> None:
        for name, a, lo, hi in self.held:
            self._append_plain(name, a, lo, hi)
        self.held.clear()
        self.held_bytes = 0

    def _append(
        self,
        key: tuple[str, str],
        t: torch.Tensor,
        lo: int,
        hi: int,
        per_batch: bool,
        counted=None,
        unit_axis: int = 1,
        by_token: bool = False,
        examples: dict | None = None,
        store: bool = True,
    ) -> None:
        info = self.datasets.get(key)
        if info is None:
            module_type = self.module_types.get(key[0], "")
            info = DatasetInfo(
                key[0],
                key[1],
                module_type,
                tuple(t.shape[1:]),
                str(t.dtype).removeprefix("torch."),
                stats_for(module_type, key[1], unit_axis),
                per_batch,
                "tokens" if by_token else "samples",
            )
            self.datasets[key] = info
        if self.stats_during == "run":  # (else made at close: its layout follows the stats)
            info.stats.merge(counted if counted is not None else self.observe(key, t, unit_axis))
            if examples is not None:  # the batch's examples per unit (probe.stats.topk)
                if info.topk is None:
                    info.topk = TopKState(self.topk)
                info.topk.merge({kind: (v.numpy(), k.numpy()) for kind, (v, k) in examples.items()})
        if (
            self.stats_during == "run"
            and f"stats/{encode(key[0])}/{encode(key[1])}" not in self.known
        ):
            stats_file.create(self.file, info, len(self.datasets) - 1)
            self.known.add("stats/" + encode(key[0]) + "/" + encode(key[1]))
        gap = self.coverage.add(self.file, key, lo, hi)
        if self.mode != "full" or not store:
            return
        name = layer_path(*key)
        if name not in self.known:
            self._create_capture(name, info, t.numpy(), len(self.datasets) - 1)
        if gap is not None:
            self.chunked[name].fill(*gap)
        self._append_plain(name, t.numpy(), lo, hi)  # created above, by its kind

    def _append_unstated(self, key: tuple[str, str], a: np.ndarray, lo: int, hi: int,
                         by_token: bool, attrs: dict) -> None:  # fmt: skip
        """A dataset of the layer's rows with no statistics (an SAE's sparse latents)."""
        if self.mode != "full":
            return
        name = layer_path(*key)
        if name not in self.known:
            ds = self._create(name, a, "token" if by_token else "sample")
            ds.attrs.update(
                {**attrs, "site": key[1], "row_unit": "tokens" if by_token else "samples"}
            )
            self.chunked[name] = ChunkedDataset(ds)
        self._append_plain(name, a, lo, hi)

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
        name_axes(
            self.file, ds, info.stats.unit_axis, info.rows, info.per_batch, self.chunking.samples
        )
        self.known.update(d for d in ROW_DIMS if d in self.file)
        self.chunked[name] = ChunkedDataset(ds)

    def _append_plain(
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

    def _close_coverage(self) -> None:
        """Rows a site missed at the end of the run (it did not run for the last batches)."""
        missing = []
        for key, info in self.datasets.items():
            total = self.num_batches if info.per_batch else self.num_samples
            total = self.num_tokens if info.rows == "tokens" else total
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
