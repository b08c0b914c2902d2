"""probe.h5 open for writing, readable by other processes while it is written.

The writer creates its objects in a plain open, then enters HDF5's SWMR mode so that readers see
every flushed batch. HDF5's file locks are off: the run lock keeps other writers out, and a SWMR
reader's lock would refuse the writer's last plain open. After a failed write HDF5 must write
nothing more (`abandon`); datasets without a chunk cache write at once, so a failed write raises.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path

import h5py

from probe.store import direct, swmr
from probe.store.fileformat import LIBVER, Progress, write_progress

log = logging.getLogger("probe")


def _is_v110(path: Path) -> bool:
    """Whether the file's superblock is the 1.10 format's (version 2 or 3), which SWMR needs."""
    with open(path, "rb") as fh:
        head = fh.read(9)
    return head[:8] == swmr.SIGNATURE and head[8] >= 2


class LiveFile:
    """The writer's handle on probe.h5 and its switches between plain and SWMR mode."""

    def __init__(self, path: Path, resume: bool):
        self.path = path
        self.live = False
        if resume:
            swmr.mark_closed(path)  # a killed writer's flags; the run lock says none is alive
            self.swmr_capable = _is_v110(path)
        else:
            self.swmr_capable = True
        self.failed: BaseException | None = None  # a write HDF5 reported only as it was dropped
        self._hook = sys.unraisablehook
        sys.unraisablehook = self._unraisable
        try:
            self.file = self._open("r+" if resume else "w")
        except BaseException:
            self._unhook()
            raise

    def _open(self, mode: str) -> h5py.File:
        kwargs = {"libver": LIBVER} if self.swmr_capable else {}
        return h5py.File(
            self.path,
            mode,
            locking=False,
            alignment_threshold=direct.ALIGN_FROM,
            alignment_interval=direct.ALIGN,
            rdcc_nbytes=0,  # see below
            **kwargs,
        )

    def creating(self) -> bool:
        """Make the file plain so that objects can be created; True when it was reopened (every
        dataset handle taken before is then closed)."""
        if not self.live:
            return False
        self.file.close()
        self.file = self._open("r+")
        self.live = False
        return True

    def go_live(self) -> None:
        """Enter SWMR mode (once the objects exist); files of format version 1 stay plain."""
        if self.live or not self.swmr_capable:
            return
        try:
            self.file.swmr_mode = True
            self.live = True
        except (OSError, ValueError) as e:
            log.debug("%s stays plain (no SWMR: %s)", self.path, e)
            self.swmr_capable = False

    def publish(self, progress: Progress) -> None:
        """Make the rows written so far readable: their data first, then the counts that say
        they are valid, each flushed (a kill between the two leaves the earlier counts)."""
        self.check()
        self.file.flush()
        write_progress(self.file, progress)
        self.file.flush()

    def check(self) -> None:
        """Raise the failed write HDF5 reported only when it dropped a handle (a dataset's cached
        chunks written as it closed): flushing after it would crash."""
        if self.failed is not None:
            raise self.failed

    def _unraisable(self, info) -> None:
        """Errors of h5py handles closed by the garbage collector: those of this file mean a
        write failed, and are kept for `check` rather than printed."""
        e = info.exc_value
        if isinstance(e, OSError | RuntimeError) and str(self.path) in str(e):
            self.failed = self.failed or e
            return
        self._hook(info)

    def _unhook(self) -> None:
        if sys.unraisablehook == self._unraisable:
            sys.unraisablehook = self._hook

    def close(self, attrs: dict | None, abandon: bool = False) -> None:
        """Close; with `attrs`, write them in a last plain open (they cannot change under SWMR).
        With `abandon` (a write failed, or the disk cannot hold what closing writes) nothing more
        is written: the file keeps its last flush."""
        try:
            if abandon or self.failed is not None:
                self._abandon()
                return
            with contextlib.suppress(OSError, RuntimeError):
                if self.file.id.valid:
                    self.file.close()
        finally:
            self._unhook()
        if attrs is None:
            return
        with self._open("r+") as f:
            for k, v in attrs.items():
                f.attrs[k] = v

    def _abandon(self) -> None:
        """Close without writing: HDF5's descriptor is pointed at /dev/null first, so what it still
        holds goes nowhere; then the superblock is marked closed, so plain opens work too (unless
        the file is shorter than it says: its flags then keep readers on the SWMR open)."""
        if self.file.id.valid:
            with contextlib.suppress(OSError, RuntimeError, ValueError):
                fd = self.file.id.get_vfd_handle()
                null = os.open(os.devnull, os.O_RDWR)
                try:
                    os.dup2(null, fd)
                finally:
                    os.close(null)
            with contextlib.suppress(OSError, RuntimeError):
                self.file.close()
        with contextlib.suppress(OSError):
            if swmr.reaches_its_end(self.path):
                swmr.mark_closed(self.path)
