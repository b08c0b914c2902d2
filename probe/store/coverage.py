"""Which rows each captured (layer, site) saw.

A module behind a data-dependent branch runs for some batches only. The rows of the batches it
skipped hold no capture: the writer fills them (NaN for floating point) and records them as gaps,
`/coverage/<layer>/<site>`, an (n, 2) array of [start, stop) row ranges. Statistics count only the
rows a module produced (their `rows` field says how many), readers skip the gaps, and the run ends
with a warning naming the sites that missed rows. A site that never missed a row has no entry.
"""

from __future__ import annotations

import logging

import h5py
import numpy as np

from probe.store.fileformat import encode

log = logging.getLogger("probe")
TOP = "coverage"


def path(key: tuple[str, str]) -> str:
    return f"{TOP}/{encode(key[0])}/{encode(key[1])}"


class Coverage:
    """The next row each (layer, site) expects, and the gaps it has left."""

    def __init__(self):
        self.ends: dict[tuple[str, str], int] = {}
        self.gaps: dict[tuple[str, str], list[tuple[int, int]]] = {}

    def gap_before(self, key: tuple[str, str], lo: int) -> tuple[int, int] | None:
        """The rows [end, lo) that `key` skipped before rows starting at `lo`, if any."""
        end = self.ends.get(key, 0)
        return (end, lo) if lo > end else None

    def needs_dataset(self, file: h5py.File, key: tuple[str, str], lo: int) -> bool:
        return self.gap_before(key, lo) is not None and path(key) not in file

    def add(
        self, file: h5py.File, key: tuple[str, str], lo: int, hi: int
    ) -> tuple[int, int] | None:
        """Rows [lo, hi) of `key` are written; returns the gap this leaves, after recording it
        (the dataset must exist when the file is in SWMR mode: `needs_dataset`)."""
        gap = self.gap_before(key, lo)
        self.ends[key] = max(hi, self.ends.get(key, 0))
        if gap is not None:
            self.gaps.setdefault(key, []).append(gap)
            ds = file.get(path(key))
            if ds is None:
                ds = file.create_dataset(
                    path(key), shape=(0, 2), maxshape=(None, 2), dtype="<i8", chunks=(64, 2)
                )
                ds.attrs["columns"] = ["start", "stop"]
            n = ds.shape[0]
            ds.resize(n + 1, axis=0)
            ds[n] = gap
        return gap

    def restore(self, file: h5py.File, key: tuple[str, str], rows: int) -> None:
        """After a resume: the gaps below `rows`, and `rows` as the next expected row."""
        ds = file.get(path(key))
        self.ends[key] = rows
        if ds is None:
            return
        kept = [(int(a), min(int(b), rows)) for a, b in ds[()] if a < rows]
        self.gaps[key] = kept
        ds.resize(len(kept), axis=0)
        if kept:
            ds[:] = np.asarray(kept, dtype=np.int64)

    def warn(self, datasets: dict, samples: int, batches: int, tokens: int) -> None:
        """One warning naming the sites that missed rows, with how many they saw."""
        missed = []
        for key, gaps in self.gaps.items():
            info = datasets.get(key)
            if not gaps or info is None:
                continue
            total = batches if info.per_batch else tokens if info.rows == "tokens" else samples
            unseen = sum(b - a for a, b in gaps)
            missed.append(f"{key[0]} {key[1]} ({total - unseen} of {total} rows)")
        if missed:
            log.warning(
                "some modules did not run for every batch (data-dependent control flow); their "
                "missing rows are NaN in the file, listed under /coverage and left out of the "
                "statistics: %s",
                "; ".join(missed),
            )


def seen_ranges(file: h5py.File, layer: str, site: str, valid: int) -> list[tuple[int, int]]:
    """The [start, stop) row ranges below `valid` that (layer, site) produced."""
    ds = file.get(path((layer, site)))
    if ds is None:
        return [(0, valid)] if valid else []
    if file.swmr_mode:
        ds.refresh()
    out, at = [], 0
    for a, b in sorted((int(a), int(b)) for a, b in ds[()]):
        if a > at:
            out.append((at, min(a, valid)))
        at = max(at, b)
    if at < valid:
        out.append((at, valid))
    return [(a, b) for a, b in out if b > a]
