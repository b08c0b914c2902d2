"""One run per run directory: a lock taken before anything in the directory is created or
truncated, held for the whole run and released at its end (errors and Ctrl-C included).

Two runs writing one probe.h5 corrupt it, and the second one's Hydra files replace the first's.
The lock is `fcntl.flock` on `.probe.lock`: the OS drops it when its process dies, so a file left
by a killed run holds nothing, and a second open in the same process conflicts too. Where fcntl
is missing (or the file system refuses flock) an O_EXCL lock file whose pid is checked stands in.
The CLI takes the lock in a Hydra callback (probe.launch.hydra_lock) before Hydra writes
`.hydra/` and the job claims it;
`holder` tells a reading tool whether a live run still writes a directory.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from probe.errors import ProbeError

fcntl: ModuleType | None
try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

LOCK_NAME = ".probe.lock"
_READER_GRACE_S = 0.3  # a reading tool's probe (`holder`) holds a shared lock for microseconds
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class RunDirBusy(ProbeError, RuntimeError):
    """Another live run writes the run directory."""


def lock_name() -> str:
    """`.probe.lock`; under torchrun every rank writes its own shard, so ranks above 0 lock
    `.probe.lock.rankN` beside rank 0's."""
    rank = int(os.environ.get("RANK", "0")) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else 0
    return LOCK_NAME if rank == 0 else f"{LOCK_NAME}.rank{rank}"


@dataclass
class _Lock:
    key: str
    path: Path
    fd: int
    thread: int
    reserved: bool  # taken ahead of the run (Hydra callback, probe.launch.api) for the run to claim
    made_dir: Path | None  # the run directory, when taking the lock created it
    claimed: bool = False
    cli: bool = False  # taken by the Hydra callback of `python -m probe`


_HELD: dict[str, _Lock] = {}
_GUARD = threading.Lock()


def _key(run_dir: Path) -> str:
    return os.path.realpath(Path(run_dir) / lock_name())


def acquire(run_dir: str | Path, reserve: bool = False) -> _Lock:
    """Lock `run_dir` (created if missing) for this process, or RunDirBusy naming the holder.
    `reserve`: the lock waits for a run in this thread to claim it (`hold`)."""
    run_dir = Path(run_dir)
    made = None if run_dir.is_dir() else run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / lock_name()
    key = _key(run_dir)
    with _GUARD:
        if key in _HELD:  # another run of this process
            raise _busy(run_dir, _describe(_read_info(path)))
    try:
        fd = _take(path)  # (another thread of this process conflicts here too)
    except _Held as e:
        raise _busy(run_dir, _describe(e.info)) from None
    except OSError as e:
        raise ProbeError(
            f"cannot create the lock file {str(path)!r} ({e}); choose a writable run "
            "directory with hydra.run.dir=PATH"
        ) from None
    _write_info(fd)
    lock = _Lock(key, path, fd, threading.get_ident(), reserve, made)
    with _GUARD:
        _HELD[key] = lock
    return lock


def _take(path: Path) -> int:
    """An open descriptor of `path` that holds its lock; _Held(info) when a live run has it."""
    if fcntl is None:
        return _take_exclusive(path)
    deadline = time.monotonic() + _READER_GRACE_S
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if time.monotonic() < deadline:
                time.sleep(0.02)
                continue
            raise _Held(_read_info(path)) from None
        except OSError as e:
            os.close(fd)
            if e.errno in _UNSUPPORTED:  # a file system without flock
                return _take_exclusive(path)
            raise
        if _same_file(fd, path):
            return fd
        os.close(fd)  # the run that had it removed it on release: take the new file


def _take_exclusive(path: Path) -> int:
    """The fallback: create `path` with O_EXCL; a file whose process is gone is stale."""
    for _ in range(5):
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            info = _read_info(path)
            with contextlib.suppress(OSError):
                if info is None and time.time() - os.stat(path).st_mtime < 2.0:
                    time.sleep(0.05)  # just created, not yet written
                    continue
            if info is not None and _alive(info):
                raise _Held(info) from None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # left by a run that was killed
    raise _Held(_read_info(path))


class _Held(Exception):
    def __init__(self, info: dict | None):
        super().__init__()
        self.info = info


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_ino, st.st_dev) == (mine.st_ino, mine.st_dev)


def _write_info(fd: int) -> None:
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, json.dumps(info).encode())


def _read_info(path: Path) -> dict | None:
    for _ in range(3):  # a lock just taken is written right after
        try:
            text = Path(path).read_text()
        except OSError:
            return None
        try:
            info = json.loads(text)
            return info if isinstance(info, dict) else None
        except ValueError:
            time.sleep(0.01)
    return None


def _alive(info: dict) -> bool:
    """Whether the process named in a fallback lock file runs; one on another host is assumed to."""
    if info.get("host") != socket.gethostname():
        return True
    pid = info.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    if sys.platform == "win32":  # (os.name == "nt"; the platform check is the one mypy reads)
        import ctypes

        kernel = ctypes.windll.kernel32
        handle = kernel.OpenProcess(0x1000, False, pid)  # PROCESS_QUERY_LIMITED_INFORMATION
        if not handle:
            return kernel.GetLastError() == 5  # access denied: it exists
        code = ctypes.c_ulong()
        kernel.GetExitCodeProcess(handle, ctypes.byref(code))
        kernel.CloseHandle(handle)
        return code.value == 259  # STILL_ACTIVE
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _describe(info: dict | None) -> str:
    if not info:
        return "another run (its lock file names none yet)"
    pid, host = info.get("pid"), info.get("host")
    me = " (this process)" if pid == os.getpid() and host == socket.gethostname() else ""
    return f"pid {pid}{me} on host {host} since {info.get('since')}"


def _busy(run_dir: Path, who: str) -> RunDirBusy:
    return RunDirBusy(
        f"the run directory {str(run_dir)!r} is being written by another run ({who}); wait for "
        "it to finish, or choose another directory (hydra.run.dir=PATH; out= of probe.launch.run)"
    )


def holder(run_dir: str | Path) -> str | None:
    """The live run that holds `run_dir` ("pid 123 on host h since 2026-11-25 03:44:01"), or None
    when none does (a lock file left by a killed run holds nothing). Never blocks."""
    path = Path(run_dir) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return _describe(_read_info(path))
            except OSError as e:
                if e.errno not in _UNSUPPORTED:
                    return None
            else:
                fcntl.flock(fd, fcntl.LOCK_UN)
                return None
        info = _read_info(path)
        return _describe(info) if info is not None and _alive(info) else None
    finally:
        os.close(fd)


def _release(key: str) -> None:
    with _GUARD:
        lock = _HELD.pop(key, None)
    if lock is None:
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(lock.path)  # removed while still held: a waiting opener sees another file
    os.close(lock.fd)
    if lock.made_dir is not None:
        with contextlib.suppress(OSError):
            lock.made_dir.rmdir()  # made only for the lock, and nothing was written


def release(run_dir: str | Path) -> None:
    """Release this process's lock on `run_dir`, if it holds one."""
    _release(_key(Path(run_dir)))


def release_cli(everything: bool = False) -> None:
    """Release the locks the Hydra callback took (the CLI's exit, whatever the way out), or
    `everything` this process holds (at interpreter exit)."""
    with _GUARD:
        keys = [k for k, lock in _HELD.items() if lock.cli or everything]
    for key in keys:
        _release(key)


atexit.register(release_cli, everything=True)


@contextlib.contextmanager
def reserve(run_dir: str | Path):
    """The lock on `run_dir` for the run this thread is about to start (`hold` claims it)."""
    lock = acquire(run_dir, reserve=True)
    try:
        yield lock
    finally:
        _release(lock.key)


@contextlib.contextmanager
def hold(run_dir: str | Path):
    """Hold `run_dir` for a run: claim this thread's reservation of it (the Hydra callback's, or
    probe.launch.api's), else take the lock now; RunDirBusy while another run holds it."""
    key = _key(Path(run_dir)) if Path(run_dir).is_dir() else None
    with _GUARD:
        lock = _HELD.get(key) if key else None
        if (
            lock is not None
            and lock.reserved
            and not lock.claimed
            and lock.thread == threading.get_ident()
        ):
            lock.claimed = True
        else:
            lock = None
    if lock is not None:
        try:
            yield
        finally:
            lock.claimed = False
        return
    taken = acquire(run_dir)
    try:
        yield
    finally:
        _release(taken.key)
