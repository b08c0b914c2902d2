"""Open a probe.h5 for reading with a clear error for a missing, truncated or foreign file.

Reading tools open files through `open_probe_file`, which also opens a file a run is writing
(SWMR) or whose writer was killed. A file is *complete*, *in progress* (a live run holds its
directory: its rows grow) or *partial* (stopped early); the valid rows of the last two are those
`/progress` counts (probe.store.fileformat).
"""

from __future__ import annotations

import time
from pathlib import Path

import h5py

from probe.errors import ConfigError, DataError
from probe.store import runlock, swmr
from probe.store.fileformat import read_progress


class NothingFlushed(DataError):
    """A file whose writer has not flushed a batch yet (or died before it did)."""

    def __init__(self, message: str, in_progress: bool):
        super().__init__(message)
        self.in_progress = in_progress


def open_probe_file(path, mode: str = "r", ours_only: bool = True) -> h5py.File:
    """The open file, or DataError naming the path, what is wrong and what to do; `ours_only`
    also refuses an HDF5 file without probe's format_version."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"{str(p)!r} does not exist; give the probe.h5 of a run directory")
    if p.is_dir():
        raise DataError(f"{str(p)!r} is a directory; give the probe.h5 inside it")
    try:
        f = _open_settled(p, mode)
    except NothingFlushed:
        raise
    except OSError as e:
        if "open for write" in str(e) or "open for SWMR" in str(e):
            raise _unflushed(p) from None  # its live writer has not entered SWMR mode yet
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
            f"{str(p)!r} is an HDF5 file but not one written by probe (no format_version "
            "attribute); give the probe.h5 of a run directory"
        )
    return f


SETTLE_SECONDS = 2.0  # how long a live writer's file may look cut short while it grows or closes


def _open_settled(p: Path, mode: str) -> h5py.File:
    """`_open`; a file that looks cut short while a live run holds its directory (its writer
    extending or closing it between a reader's two reads of the header) is tried again for
    up to SETTLE_SECONDS: a file really cut short stays so, and its error follows."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while True:
        try:
            return _open(p, mode)
        except OSError as e:
            live = "truncated" in str(e) and runlock.holder(p.parent) is not None
            if not live or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _open(p: Path, mode: str) -> h5py.File:
    """h5py's handle. A file left plainly open by a killed writer (killed before its first
    flush, or while it reopened the file to create objects or to write its closing counts) has
    flags no reader may pass; with no live run in its directory they are cleared first, as
    resume=true and `python -m probe.store.swmr` clear them, and the file says what it holds."""
    if mode != "r":
        return h5py.File(p, mode)
    try:
        return swmr.open_read(p)
    except OSError as e:
        # a probe run left its lock file there, and no live process holds it
        ours = any(p.parent.glob(runlock.LOCK_NAME + "*"))
        dead = "open for SWMR" in str(e) and ours and runlock.holder(p.parent) is None
        if not dead or not swmr.clear_dead_writer(p):
            raise
    f = swmr.open_read(p)
    try:
        progress = read_progress(f)
        empty = not (progress.complete or progress.samples or progress.batches)
    except (KeyError, OSError, ValueError):  # killed while it created its first objects
        empty = "format_version" in f.attrs
    if empty:
        f.close()
        raise _unflushed(p, killed=True)
    return f


def _unflushed(p: Path, killed: bool = False) -> NothingFlushed:
    who = None if killed else runlock.holder(p.parent)
    if who:
        return NothingFlushed(
            f"{str(p)!r} is in progress ({who}) and no batch is flushed yet; open it again in a "
            "moment",
            True,
        )
    if killed:
        return NothingFlushed(
            f"{str(p)!r} was left by a run that stopped before its first batch was flushed, so it "
            "holds no batch; run again (overwrite=true replaces it), or continue it with "
            "resume=true",
            False,
        )
    return NothingFlushed(
        f"{str(p)!r} is held open for writing by another process, or was left so by a run that "
        "stopped (before its first batch was flushed, or while it closed the file), so no batch "
        f"can be read from it now; once nothing writes it, `python -m probe.store.swmr {p}` "
        "clears that mark, and resume=true continues a run of probe",
        False,
    )


def is_partial(f: h5py.File) -> bool:
    """True unless the run that wrote `f` finished cleanly."""
    return not read_progress(f).complete


def state(f: h5py.File) -> str:
    """complete, in progress (a live run holds its directory) or partial."""
    if read_progress(f).complete:
        return "complete"
    return "in progress" if runlock.holder(Path(f.filename).parent) else "partial"


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


def file_state(path: Path) -> str:
    """`partial, 40 of 64 samples`, `complete, 64 samples` (a watched training's:
    `complete, 120 steps, 12 recorded, the last 110`), or why it cannot be read."""
    import yaml

    from probe.store.steps_file import is_watched, steps_held

    try:
        with open_probe_file(path) as f:
            progress = read_progress(f)
            if is_watched(f):  # a watched training counts steps, not samples
                return f"{'complete' if progress.complete else 'partial'}, {steps_held(f)}"
            if progress.complete:
                return f"complete, {progress.samples} samples"
            total = (yaml.safe_load(str(f.attrs.get("config", ""))) or {}).get("dataset", {})
    except Exception as e:  # a run killed before its first flush, a foreign or damaged file
        killed_early = getattr(e, "in_progress", None) is False
        return "partial, no batch flushed" if killed_early else "unreadable"
    total = total.get("num_samples") if isinstance(total, dict) else None
    n = progress.samples
    return f"partial, {n} of {total} samples" if total else f"partial, {n} samples"


def check_existing(path: Path, resume: bool, overwrite: bool) -> None:
    """A ConfigError unless `path` (the run's probe.h5) is absent, resumed or to be replaced."""
    if resume and overwrite:
        raise ConfigError(
            "resume=true and overwrite=true ask for opposite things; give resume=true to "
            "continue the file in the run directory or overwrite=true to replace it"
        )
    if resume or overwrite or not Path(path).exists():
        return
    raise ConfigError(
        f"the run directory {str(Path(path).parent)!r} already holds {Path(path).name} "
        f"({file_state(path)}); continue it with resume=true or replace it with overwrite=true, "
        "or choose a new hydra.run.dir"
    )
