"""Open a probe.h5 for reading with a clear error for a missing, truncated or foreign file.

Reading tools open files through `open_probe_file` and treat a file whose `complete` attribute is
absent or false as partial: it holds `num_samples` valid rows, those written before a stop or crash.
"""

from __future__ import annotations

from pathlib import Path

import h5py

from probe.errors import DataError


def open_probe_file(path, mode: str = "r", ours_only: bool = True) -> h5py.File:
    """The open file, or DataError naming the path, what is wrong and what to do; `ours_only`
    also refuses an HDF5 file without probe's format_version."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"{str(p)!r} does not exist; give the probe.h5 of a run directory")
    if p.is_dir():
        raise DataError(f"{str(p)!r} is a directory; give the probe.h5 inside it")
    try:
        f = h5py.File(p, mode)
    except OSError as e:
        detail = str(e).split("(", 1)[-1].rstrip(")")
        hint = (
            "it was cut short (copy incomplete or disk full while closing)"
            if "truncated" in detail
            else "it is not an HDF5 file or its header is damaged"
        )
        raise DataError(
            f"{str(p)!r} cannot be opened: {hint} ({detail}); re-run the probe into a new "
            "hydra.run.dir, or copy the file again"
        ) from None
    if ours_only and "format_version" not in f.attrs:
        f.close()
        raise DataError(
            f"{str(p)!r} is an HDF5 file but not one written by probe (no format_version attribute)"
        )
    return f


def is_partial(f: h5py.File) -> bool:
    """True unless the run that wrote `f` finished cleanly."""
    return not bool(f.attrs.get("complete", False))


def missing_sources(f: h5py.File) -> list[str]:
    """Shard files that a virtual dataset of `f` reads and that are absent or not complete."""
    base = Path(f.filename).parent
    files: set[str] = set()

    def collect(_, obj):
        if isinstance(obj, h5py.Dataset) and obj.is_virtual:
            files.update(vs.file_name for vs in obj.virtual_sources())

    f.visititems(collect)
    bad = []
    for name in sorted(files):
        p = base / name
        if not p.is_file():
            bad.append(f"{name} (missing)")
            continue
        try:
            with h5py.File(p, "r") as shard:
                if not shard.attrs.get("complete", False):
                    bad.append(f"{name} (not complete)")
        except OSError:
            bad.append(f"{name} (unreadable)")
    return bad
