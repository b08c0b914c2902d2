"""One file from per-rank shard files, each kind of the sink's (probe.store.sink) by one rule:
rows as HDF5 virtual datasets in rank order, arrays written once taken from rank 0, keyed groups
concatenated in rank order (probe.store.groups), groups written whole taken from rank 0, and the
folds merged exactly (statistics by Chan's merges, examples per unit by the same selection).

A virtual dataset reads a missing source file as fill values without any error, so a stitched file
is only trusted after `missing_sources` finds every shard present and complete; `read_stats` and
`open_checked` do that check for every reader of a run file.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

import h5py
import numpy as np

from probe.errors import DataError
from probe.stats.running import RunningStats
from probe.store import stats_file, topk_file
from probe.store.chunks import name_axes
from probe.store.fileformat import Progress, is_scale, read_progress, write_progress
from probe.store.groups import GroupKind, concatenate
from probe.store.runfile import missing_sources
from probe.store.stats_file import DatasetInfo

ROWS = ("layers", "samples", "model", "tokens", "effects", "patching", "lens", "dla")
SCALE_ATTRS = {"CLASS", "NAME", "REFERENCE_LIST", "DIMENSION_LIST", "_Netcdf4Dimid"}

STAT_FIELDS = [f.name for f in fields(RunningStats)]
SHARD_ATTRS = (
    "complete", "num_samples", "num_batches", "num_tokens", "rank", "shard_first_sample",
)  # fmt: skip


class IncompleteFileError(DataError):
    """A run file that is unfinished, or stitched from a shard that is gone or unfinished."""


def stitch(
    path: Path, shards: list[Path], after: Sequence[GroupKind | str] = ()
) -> list[DatasetInfo]:
    """Write `path`: every row dataset of the shards as one virtual dataset (rows in rank order),
    arrays written once and the groups named in `after` (written whole after the loop) as rank
    0 has them, the keyed groups of each GroupKind in `after` concatenated, the shards'
    statistics and examples merged exactly, `complete` last. Returns the merged DatasetInfo
    records."""
    files = [h5py.File(p, "r") for p in shards]
    try:
        merged = merge_stats([read_stats(f, check=False) for f in files])
        with h5py.File(path, "w") as out:
            for k, v in files[0].attrs.items():
                if k not in SHARD_ATTRS:
                    out.attrs[k] = v
            counts = [read_progress(f) for f in files]
            total = Progress(
                sum(c.samples for c in counts),
                sum(c.batches for c in counts),
                sum(c.tokens for c in counts),
            )
            out.attrs["complete"] = False
            out.attrs["num_samples"] = total.samples
            out.attrs["num_batches"] = total.batches
            out.attrs["num_tokens"] = total.tokens
            out.attrs["world_size"] = len(files)
            out.attrs["shards"] = [p.name for p in shards]
            if "layers" in files[0]:
                out.create_group("layers")
            rows, once = _dataset_names(files)
            for name in rows:
                _virtual(
                    out, name, [(p.name, f.get(name)) for p, f in zip(shards, files, strict=True)]
                )
            for name in once:  # (rank 0's, or the first rank's that has it)
                source = next(f for f in files if name in f)
                source.copy(source[name], out, name=name)
            _name_axes(out, total, "sample" in files[0])
            for order, info in enumerate(merged.values()):
                stats_file.create(out, info, order)
                if info.topk is not None and info.topk.kinds:
                    topk_file.create(out, info.layer, info.site, info.topk)
                    topk_file.write(out, info.layer, info.site, info.topk, 0)
            stats_file.write_slot(out, merged.values(), 0)
            total.stats_slot = 0
            for part in after:
                if isinstance(part, GroupKind):
                    concatenate(out, part, files)
                elif part in files[0]:
                    files[0].copy(files[0][part], out, name=part)
            write_progress(out, total)
            out.flush()
            total.complete = all(c.complete for c in counts)
            write_progress(out, total)
            out.attrs["complete"] = total.complete
    finally:
        for f in files:
            f.close()
    return list(merged.values())


def _dataset_names(files: list[h5py.File]) -> tuple[list[str], list[str]]:
    """(every per-row dataset of the shards, every array written once whole) under the tops of
    the run's rows (/stats and /topk are merged, groups concatenated or copied)."""
    names: dict[str, None] = {}

    def add(name: str, link) -> None:
        if isinstance(link, h5py.HardLink) and name.split("/", 1)[0] in ROWS:
            names.setdefault(name)

    for f in files:
        f.visititems_links(add)
    rows: list[str] = []
    once: list[str] = []
    for n in names:
        ds = next((f[n] for f in files if isinstance(f.get(n), h5py.Dataset)), None)
        if ds is None or (is_scale(ds) and n != "samples/index"):
            continue
        (rows if ds.maxshape[0] is None else once).append(n)
    return rows, once


def _name_axes(out: h5py.File, total: Progress, sample_scale: bool) -> None:
    """The stitched datasets' dimension scales, as the writer attaches them."""
    if sample_scale and "samples/index" in out:
        out["sample"] = out["samples/index"]
        out["sample"].make_scale("sample")
    for layer in out.get("layers", {}).values():
        for ds in layer.values():
            a = ds.attrs
            if "order" in a:
                per_batch, rows = bool(a["per_batch"]), str(a.get("row_unit", "samples"))
                name_axes(out, ds, int(a.get("unit_axis", 1)), rows, per_batch)
    for dim, n in (("token", total.tokens), ("batch", total.batches)):
        if dim in out:
            out[dim].resize((n,))


def _virtual(out: h5py.File, name: str, sources: list[tuple[str, h5py.Dataset | None]]) -> None:
    present = [(file, ds) for file, ds in sources if ds is not None]
    first = present[0][1]
    rows = sum(ds.shape[0] for _, ds in present)
    layout = h5py.VirtualLayout(shape=(rows, *first.shape[1:]), dtype=first.dtype)
    row = 0
    for file, ds in present:
        if ds.shape[0]:
            layout[row : row + ds.shape[0]] = h5py.VirtualSource(file, name, shape=ds.shape)
            row += ds.shape[0]
    fill = np.nan if first.dtype.kind == "f" else -1
    stacked = out.create_virtual_dataset(name, layout, fillvalue=fill)
    for made, source in ((stacked, first), (stacked.parent, first.parent)):  # module_type, order
        for k, v in source.attrs.items():
            if k not in made.attrs and k not in SCALE_ATTRS:
                made.attrs[k] = v


def merge_stats(per_shard: list[dict]) -> dict:
    """Chan merges of each (layer, site)'s statistics over the shards, in rank order."""
    merged: dict[tuple[str, str], DatasetInfo] = {}
    for infos in per_shard:
        for key, info in infos.items():
            if key in merged:
                into = merged[key]
                into.stats.merge(info.stats)
                if info.topk is not None and into.topk is None:
                    into.topk = copy.deepcopy(info.topk)
                elif info.topk is not None and into.topk is not None:
                    into.topk.merge(info.topk.kinds)  # examples per unit: the same exact selection
            else:
                merged[key] = copy.deepcopy(info)
    return merged


def read_stats(f: h5py.File, check: bool = True) -> dict[tuple[str, str], DatasetInfo]:
    """The `/stats` records of a run file, in the run's order; with `check`, refuse a file that is
    incomplete or whose shards are missing."""
    if check:
        check_complete(f)
    return stats_file.read(f)


def check_complete(f: h5py.File) -> None:
    """Raise IncompleteFileError unless `f` was closed cleanly and all of its shards are there."""
    if not f.attrs.get("complete", False):
        raise IncompleteFileError(
            f"{f.filename!r} is not complete (the run stopped early); re-run it, or read the "
            f"first num_samples={int(f.attrs.get('num_samples', 0))} rows with plain h5py"
        )
    bad = missing_sources(f)
    if bad:
        raise IncompleteFileError(
            f"{f.filename!r} is stitched from shard files and some are unusable: {', '.join(bad)}; "
            "its virtual datasets would read those rows as fill values. Restore the shard files "
            "next to it or re-run the job"
        )


def is_complete(path: Path) -> bool:
    with h5py.File(path, "r") as f:
        return bool(f.attrs.get("complete", False)) and not missing_sources(f)


def open_checked(path: Path) -> h5py.File:
    """Open a run file for reading after `check_complete`: the safe way to read a stitched file."""
    f = h5py.File(path, "r")
    try:
        check_complete(f)
    except BaseException:
        f.close()
        raise
    return f
