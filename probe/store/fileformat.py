"""The layout of probe.h5, in one place: names of groups and datasets, the live row counts, which
rows of a dataset are valid, and the dimension names readers such as xarray see.

docs/format.md describes the file; this module is what writer and readers share of it.
Version 2 files are written in HDF5's SWMR mode: while a run writes, its counts live in the
`/progress` dataset (attributes cannot change under SWMR), and the file attributes repeat them
when the writer closes the file. Version 1 files keep their counts in attributes only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import h5py
import numpy as np

from probe.site_keys import CAM_SITES, family_of

FORMAT_VERSION = 2
LIBVER = ("v110", "v110")  # SWMR needs the 1.10 format; HDF5 1.10 and later read it
PROGRESS = np.dtype(
    [
        ("samples", "<i8"),
        ("batches", "<i8"),
        ("tokens", "<i8"),
        ("complete", "<i8"),
        ("stats_slot", "<i8"),  # which of the two /stats slots is whole; -1 before the first
    ]
)
SAMPLE_DIM, TOKEN_DIM, BATCH_DIM = "sample", "token", "batch"
_ESCAPED = re.compile(r"%([0-9A-F]{2})")


def encode(name: str) -> str:
    """A module or site name as an HDF5 link name: `/` would nest groups and `.`/`..`/empty are
    not names, so they (and `%`, the escape) become %XX."""
    if name in ("", ".", ".."):
        return "".join(f"%{ord(c):02X}" for c in name) or "%00"
    return name.replace("%", "%25").replace("/", "%2F")


def decode(link: str) -> str:
    """The name `encode` was given."""
    if link == "%00":
        return ""
    return _ESCAPED.sub(lambda m: chr(int(m.group(1), 16)), link)


def layer_path(layer: str, site: str, top: str = "layers") -> str:
    return f"{top}/{encode(layer)}/{encode(site)}"


def is_per_batch(attrs, site: str) -> bool:
    """Whether a dataset (by its attributes) holds one row per batch: its `per_batch` attribute,
    or in files written before it existed, a parameter gradient's site name."""
    return bool(attrs.get("per_batch", family_of(site) == "param_grad"))


def row_unit(attrs, name: str = "") -> str:
    """What a dataset's rows are: `batches`, `tokens` (rows: tokens layers, /tokens/*) or
    `samples`."""
    if is_per_batch(attrs, name.rsplit("/", 1)[-1]):
        return "batches"
    if name.startswith("tokens/") or attrs.get("row_unit") == "tokens":
        return "tokens"
    return "samples"


@dataclass
class Progress:
    """Rows valid so far: samples, batches (parameter gradients), tokens (rows: tokens)."""

    samples: int = 0
    batches: int = 0
    tokens: int = 0
    complete: bool = False
    stats_slot: int = -1

    def valid_rows(self, ds: h5py.Dataset, site: str) -> int:
        """Rows of `ds` a reader may use: per-batch datasets count batches, token rows tokens."""
        unit = row_unit(ds.attrs, site)
        rows = {"batches": self.batches, "tokens": self.tokens, "samples": self.samples}[unit]
        return min(len(ds), int(rows))


def read_progress(f: h5py.File) -> Progress:
    """The counts of `f`: `/progress` (refreshed, for a file being written) or, in version 1
    files, the attributes."""
    ds = f.get("progress")
    if ds is None:
        a = f.attrs
        return Progress(
            int(a.get("num_samples", 0)),
            int(a.get("num_batches", 0)),
            int(a.get("num_tokens", 0)),
            bool(a.get("complete", False)),
        )
    if f.swmr_mode:
        ds.refresh()
    row = ds[()]
    return Progress(
        int(row["samples"]),
        int(row["batches"]),
        int(row["tokens"]),
        bool(row["complete"]),
        int(row["stats_slot"]),
    )


def write_progress(f: h5py.File, p: Progress) -> None:
    row = np.array((p.samples, p.batches, p.tokens, int(p.complete), p.stats_slot), PROGRESS)
    if "progress" in f:
        f["progress"][()] = row
    else:
        f.create_dataset("progress", data=row)


def is_scale(obj) -> bool:
    """Dimension scales sit beside the datasets they name; they are not captured data."""
    return isinstance(obj, h5py.Dataset) and obj.attrs.get("CLASS") == b"DIMENSION_SCALE"


def captured(group: h5py.Group):
    """(decoded name, object) of a layer group's sites, or of /layers' or /stats' layers."""
    for link, obj in group.items():
        if not is_scale(obj):
            yield decode(link), obj


def axis_names(
    shape: tuple[int, ...], unit_axis: int, rows: str, per_batch: bool, site: str = ""
) -> list[str]:
    """Names of a dataset's axes: the row axis (sample, token or batch), then what each further
    axis of the capture is (channel, height, width; token, feature; a CAM map's height, width)."""
    first = BATCH_DIM if per_batch else TOKEN_DIM if rows == "tokens" else SAMPLE_DIM
    rest = len(shape) - 1
    if family_of(site) in CAM_SITES and rest == 2:
        return [first, "height", "width"]
    if per_batch:
        return [first, *(f"param_{i}" for i in range(1, rest + 1))]
    if rest == 0:
        return [first]
    axis = unit_axis % (rest + 1) if unit_axis < 0 else unit_axis
    if rest == 1:
        return [first, "feature"]
    if axis == 1:  # channels first: (C, [[D,] H,] W)
        spatial = {0: [], 1: ["length"], 2: ["height", "width"], 3: ["depth", "height", "width"]}
        return [first, "channel", *spatial.get(rest - 1, [f"axis_{i}" for i in range(2, rest + 1)])]
    middle = ["token"] if rest == 2 and first == SAMPLE_DIM else []
    if len(middle) != rest - 1:
        middle = [f"axis_{i}" for i in range(1, rest)]
    return [first, *middle, "feature"]
