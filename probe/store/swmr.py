"""Files written in HDF5's SWMR mode: open one that a run is writing, and mark closed one whose
writer died.

While a SWMR writer holds a file, its superblock carries "open for write" flags: a plain open
refuses it and a SWMR open (`swmr=True`) reads every flushed batch. A writer that is killed leaves
the flags set and the superblock's end-of-file address stale; `mark_closed` does what HDF5's
`h5clear -s --increment` does (flags cleared, end of file = the file's size, checksum renewed) so
that any HDF5 tool opens the file again. Only the superblock versions 2 and 3 that SWMR files use
carry the flags.
"""

from __future__ import annotations

import os
from pathlib import Path

import h5py

SIGNATURE = b"\x89HDF\r\n\x1a\n"
_M = 0xFFFFFFFF


def _rot(x: int, k: int) -> int:
    return ((x << k) | (x >> (32 - k))) & _M


def lookup3(data: bytes, initval: int = 0) -> int:
    """Bob Jenkins' lookup3 `hashlittle`, the checksum of HDF5's metadata."""
    n = len(data)
    a = b = c = (0xDEADBEEF + n + initval) & _M
    i = 0

    def word(j: int) -> int:
        return int.from_bytes(data[j : j + 4].ljust(4, b"\0"), "little")

    while n > 12:
        a, b, c = (a + word(i)) & _M, (b + word(i + 4)) & _M, (c + word(i + 8)) & _M
        a = ((a - c) & _M) ^ _rot(c, 4)
        c = (c + b) & _M
        b = ((b - a) & _M) ^ _rot(a, 6)
        a = (a + c) & _M
        c = ((c - b) & _M) ^ _rot(b, 8)
        b = (b + a) & _M
        a = ((a - c) & _M) ^ _rot(c, 16)
        c = (c + b) & _M
        b = ((b - a) & _M) ^ _rot(a, 19)
        a = (a + c) & _M
        c = ((c - b) & _M) ^ _rot(b, 4)
        b = (b + a) & _M
        i, n = i + 12, n - 12
    if n == 0:
        return c
    a, b, c = (a + word(i)) & _M, (b + word(i + 4)) & _M, (c + word(i + 8)) & _M
    for x, y, k in (
        (2, 1, 14),
        (0, 2, 11),
        (1, 0, 25),
        (2, 1, 16),
        (0, 2, 4),
        (1, 0, 14),
        (2, 1, 24),
    ):
        v = [a, b, c]
        v[x] = (v[x] ^ v[y]) - _rot(v[y], k) & _M
        a, b, c = v
    return c


def _superblock(head: bytes) -> tuple[int, int] | None:
    """(size of offsets, bytes before the checksum) of a version 2/3 superblock, else None."""
    if head[:8] != SIGNATURE or head[8] not in (2, 3):
        return None
    size = head[9]
    return size, 12 + 4 * size


def open_for_write(path: Path | str) -> bool:
    """Whether the superblock says a writer has the file open (or died with it open)."""
    with open(path, "rb") as fh:
        head = fh.read(64)
    layout = _superblock(head)
    return layout is not None and head[11] != 0


def mark_closed(path: Path | str) -> bool:
    """Clear the "open for write" flags a killed writer left; True when there were any. Only for
    a file no process writes (the run directory's lock says so)."""
    with open(path, "r+b") as fh:
        head = bytearray(fh.read(64))
        layout = _superblock(bytes(head))
        if layout is None or head[11] == 0:
            return False
        size, end = layout
        eof = os.fstat(fh.fileno()).st_size
        at = 12 + 2 * size  # base address, extension address, then end-of-file address
        head[11] = 0
        head[at : at + size] = max(eof, int.from_bytes(head[at : at + size], "little")).to_bytes(
            size, "little"
        )
        head[end : end + 4] = lookup3(bytes(head[:end])).to_bytes(4, "little")
        fh.seek(0)
        fh.write(head[: end + 4])
        fh.flush()
        os.fsync(fh.fileno())
    return True


def reaches_its_end(path: Path | str) -> bool:
    """Whether the file is as long as its superblock says. A flush cut short by the file size
    limit can leave it shorter: a plain open then refuses it as truncated, while the SWMR open
    that its "open for write" flags lead readers to still reads every flushed batch."""
    with open(path, "rb") as fh:
        head = fh.read(64)
    layout = _superblock(head)
    if layout is None:
        return True
    size = layout[0]
    at = 12 + 2 * size  # base address, extension address, then end-of-file address
    return int.from_bytes(head[at : at + size], "little") <= os.stat(path).st_size


def clear_dead_writer(path: Path | str) -> bool:
    """Mark closed a file whose writer is dead (the caller checked the run directory's lock) and
    that holds all it says it holds; False where it cannot (read-only, or cut short)."""
    try:
        return reaches_its_end(path) and mark_closed(path)
    except OSError:
        return False


def open_read(path: Path | str) -> h5py.File:
    """Open for reading, in SWMR mode wherever the file's format allows it (its superblock is the
    1.10 format's), whether a writer holds it, was killed holding it, or closed it. HDF5 lets one
    process open a file a second time only with the same SWMR flag, or plainly over a SWMR open:
    reading in SWMR mode lets `h5py.File(path, "r", swmr=True)` and a plain `h5py.File(path)` open
    it beside this handle. Where this process already holds the file plainly, it opens plainly."""
    try:
        f = _open(path)
    except OSError as e:
        if "already open for write" not in str(e):
            raise  # (a damaged or cut-short file: a SWMR open would retry its reads for minutes)
        return _open(path, swmr=True)
    if not swmr_format(path):
        return f
    f.close()  # (it opened plainly, so it is whole: reopened in SWMR mode)
    try:
        return _open(path, swmr=True)
    except OSError as e:
        if "SWMR read access flag not the same" not in str(e):
            raise
    return _open(path)  # this process holds it plainly already


def swmr_format(path: Path | str) -> bool:
    """Whether the file's superblock is the 1.10 format's (version 2 or 3), as SWMR writes it."""
    with open(path, "rb") as fh:
        return _superblock(fh.read(64)) is not None


def _open(path, **kwargs) -> h5py.File:
    try:
        return h5py.File(path, "r", **kwargs)
    except OSError as e:
        if "file locking flag values don't match" not in str(e):
            raise
    # this process writes the file (the writer opens it without HDF5's locks: probe.store.livefile)
    return h5py.File(path, "r", locking=False, **kwargs)


def main(argv: list[str] | None = None) -> int:
    """`python -m probe.store.swmr PATH...`: mark closed the files of killed runs, for other tools."""
    import sys

    from probe.store import runlock

    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print("usage: python -m probe.store.swmr PROBE_H5_OR_RUN_DIR...", file=sys.stderr)
        return 2
    status = 0
    for arg in paths:
        path = Path(arg) / "probe.h5" if Path(arg).is_dir() else Path(arg)
        who = runlock.holder(path.parent)
        if who:
            print(f"{path}: in progress ({who}); left as it is", file=sys.stderr)
            status = 1
        elif not path.is_file():
            print(f"{path}: no such file", file=sys.stderr)
            status = 1
        else:
            done = mark_closed(path)
            print(f"{path}: {'marked closed' if done else 'already closed'}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
