"""`/stats` in probe.h5: one group per (layer, site) with labelled statistics in two slots.

Each group holds `scalars` (a compound record per slot, one named field per number of the running
state, `probe.stats.stat_columns.SLOTS`, and `buckets`), `units` (a compound record per unit and
slot: UNIT_FIELDS) and `hist` (bucket, count of the quantile sketch's non-empty buckets, per slot). A flush writes the slot `/progress` does not
point at, then points at it: a kill leaves one whole slot, never a mix. The slots are made before
the writer enters SWMR mode, where only writes into existing datasets are allowed; `hist` grows
along its second axis. Version 1 files (a `state` attribute and plain `hist`/`units` arrays) are
read too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import h5py
import numpy as np

from probe.stats.running import (
    UNIT_FIELDS,
    LogHistogram,
    RunningStats,
    UnitStats,
    counts_agree,
    occupied,
    stats_for,
)
from probe.stats.stat_columns import INTEGER_SCALARS, SCALARS
from probe.stats.topk import TopKState
from probe.store import topk_file
from probe.store.fileformat import captured, encode, is_per_batch, read_progress
from probe.store.h5fresh import add_attrs, add_dataset

SCALAR_TYPE = np.dtype(
    [(k, "<i8" if k in INTEGER_SCALARS else "<f8") for k in SCALARS] + [("buckets", "<i8")]
)
UNIT_TYPE = np.dtype([(k, "<f8") for k in UNIT_FIELDS])
BUCKET_TYPE = np.dtype([("bucket", "<u2"), ("count", "<i8")])
HIST_CHUNK = 512  # buckets per chunk of `hist`


@dataclass
class DatasetInfo:
    """What the file says of one captured (layer, site): its layout and its statistics."""

    layer: str
    site: str
    module_type: str
    shape: tuple[int, ...]
    dtype: str
    stats: RunningStats = field(default_factory=RunningStats)
    per_batch: bool = False
    rows: str = "samples"  # or "tokens": one row per non-padding token
    topk: TopKState | None = None  # its examples per unit (stats.topk), probe.stats.topk
    unit_axis: int = 1  # the axis of its rows along which the units lie


def tags(info: DatasetInfo, order: int) -> dict:
    """What a dataset (and its /stats group) says of itself, so a resumed run or a reader rebuilds
    the run's table in the same order."""
    return {
        "name": info.layer,
        "site": info.site,
        "order": order,
        "module_type": info.module_type,
        "per_batch": info.per_batch,
        "unit_axis": info.unit_axis,
        "row_unit": info.rows,
    }


def create(file: h5py.File, info: DatasetInfo, order: int) -> None:
    """The group of one (layer, site), its slots empty (before SWMR mode: it creates objects;
    its examples' group is probe.store.topk_file's)."""
    parent = file.require_group("stats")
    layer = encode(info.layer)
    parent = parent[layer] if layer in parent else parent.create_group(layer)
    g = parent.create_group(encode(info.site))
    attrs = {**tags(info, order), "shape": list(info.shape), "dtype": info.dtype}
    if info.stats.units is not None:
        attrs["saturation_tracked"] = info.stats.units.tracked
    add_attrs(g, attrs)  # (h5py's own attribute and dataset calls cost milliseconds each)
    # written now, so that closing the file allocates no space for them (probe.store.diskspace)
    add_dataset(g, "scalars", np.zeros(2, SCALAR_TYPE))
    if info.stats.units is not None:
        add_dataset(g, "units", np.zeros((2, info.stats.units.width), UNIT_TYPE))
    g.create_dataset(
        "hist", shape=(2, 0), maxshape=(2, None), dtype=BUCKET_TYPE, chunks=(1, HIST_CHUNK)
    )


def write_slot(file: h5py.File, infos, slot: int) -> dict[tuple[str, str], int]:
    """Every DatasetInfo's statistics into `slot` of its group (which must exist; its examples
    are probe.store.topk_file's); returns each group's histogram capacity (buckets per slot)."""
    capacity = {}
    for info in infos:
        g = file[f"stats/{encode(info.layer)}/{encode(info.site)}"]
        s = info.stats
        hist = occupied(s.hist.counts, False)
        record = np.zeros((), SCALAR_TYPE)
        for k in SCALARS:
            record[k] = getattr(s, k)
        record["buckets"] = hist.shape[1]
        h = g["hist"]
        if hist.shape[1] > h.shape[1]:
            h.resize(-(-hist.shape[1] // HIST_CHUNK) * HIST_CHUNK, axis=1)
        if hist.shape[1]:
            buckets = np.empty(hist.shape[1], BUCKET_TYPE)
            buckets["bucket"], buckets["count"] = hist
            h[slot, : hist.shape[1]] = buckets
        if s.units is not None and "units" in g:
            packed = s.units.packed()
            units = np.zeros(packed.shape[1], UNIT_TYPE)
            for name, row in zip(UNIT_FIELDS, packed, strict=False):
                units[name] = row
            g["units"][slot] = units
        g["scalars"][slot] = record
        capacity[info.layer, info.site] = h.shape[1]
    return capacity


def _read_slot(g: h5py.Group, slot: int, unit_axis: int) -> RunningStats:
    record = g["scalars"][slot]
    s = RunningStats(**{k: record[k].item() for k in SCALARS})
    s.unit_axis = unit_axis
    k = int(record["buckets"])
    if k:
        buckets = g["hist"][slot, :k]
        s.hist = LogHistogram.from_sparse(buckets["bucket"], buckets["count"])
    if "units" in g:
        units = g["units"][slot]
        tracked = bool(g.attrs.get("saturation_tracked", False))
        present = [f for f in UNIT_FIELDS if f != "saturated" or tracked]
        s.units = UnitStats.unpacked(np.stack([units[f] for f in present]))
    return s


def read(f: h5py.File, warn=None) -> dict[tuple[str, str], DatasetInfo]:
    """The statistics the file holds, in the run's order: the whole slot of a version 2 file
    (none before its first flush), or a version 1 file's arrays when their counts agree."""
    slot = read_progress(f).stats_slot if "progress" in f else None
    found: list[tuple[int, int, DatasetInfo]] = []  # (order, position, info)
    for layer_link, group in f.get("stats", {}).items():
        for site, g in captured(group):
            layer = str(g.attrs.get("name", layer_link))
            a = g.attrs
            axis = int(a.get("unit_axis", 1))
            if "scalars" in g:
                if slot is None or slot < 0:
                    continue
                if f.swmr_mode:
                    for name in ("scalars", "units", "hist"):
                        if name in g:
                            g[name].refresh()
                stats = _read_slot(g, slot, axis)
            else:
                stats = RunningStats.from_saved(a, g)
                if not counts_agree(stats, str(a.get("dtype", ""))):
                    if warn:
                        warn(f"{f.filename}: /stats/{layer}/{site} mixes two flushes; not used")
                    continue
            info = DatasetInfo(
                layer,
                site,
                str(a.get("module_type", "")),
                tuple(int(x) for x in a.get("shape", ())),
                str(a.get("dtype", "")),
                stats,
                is_per_batch(a, site),
                str(a.get("row_unit", "samples")),
                unit_axis=axis,
            )
            if slot is not None:
                info.topk = topk_file.read(f, layer, str(a.get("site", site)), slot)
            found.append((int(a.get("order", 1 << 30)), len(found), info))
    return {(i.layer, i.site): i for _, _, i in sorted(found, key=lambda t: t[:2])}


def described(f: h5py.File) -> list[DatasetInfo]:
    """A DatasetInfo (layout, empty statistics) of every dataset tagged by `tags`, in creation
    order: what a resumed writer continues."""
    found = {}
    for top in ("stats", "layers"):
        for layer_link, group in captured(f.get(top, {})):
            for site, obj in captured(group):
                a = obj.attrs
                if "order" not in a:
                    continue
                layer = str(a.get("name", group.attrs.get("name", layer_link)))
                module_type = str(a["module_type"])
                info = DatasetInfo(
                    layer,
                    site,
                    module_type,
                    (),
                    "",
                    stats_for(module_type, site, int(a.get("unit_axis", 1))),
                    is_per_batch(a, site),
                    str(a.get("row_unit", "samples")),
                    unit_axis=int(a.get("unit_axis", 1)),
                )
                found[(layer, site)] = (int(a["order"]), info)
    return [info for _, info in sorted(found.values(), key=lambda t: t[0])]
