"""Whether numba's compiled statistics kernels are on disk, and compiling them out of the way.

numba compiles a kernel at its first call (all of `probe.stats.kernels` takes EXPECTED on a small
machine); a run must not stall on that unannounced, and `import probe` must compile nothing. So a
run looks for a stamp written after a complete warm-up before importing numba, and without one
`compile_in_background` starts an idle-priority `python -m probe.stats.kernel_cache` for later runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

EXPECTED = "15-60 s"
LOCK_STALE_SECONDS = 900.0  # a lock older than this belongs to a compile that died
KERNELS = Path(__file__).with_name("kernels")  # the package; read here, never imported
COMPILED_IN = Path(__file__).with_name("stat_columns.py")  # the slot offsets the kernels compile in


def cache_dir() -> Path:
    """PROBE_CACHE_DIR, else $XDG_CACHE_HOME/probe, else ~/.cache/probe."""
    given = os.environ.get("PROBE_CACHE_DIR")
    if given:
        return Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "probe"


def kernel_files() -> list[Path]:
    """Every module of the kernels package, in a fixed order."""
    return sorted(KERNELS.glob("*.py"))


def _key() -> str:
    try:
        numba_version = importlib.metadata.version("numba")
    except importlib.metadata.PackageNotFoundError:
        numba_version = "absent"
    parts = []
    for path in [*kernel_files(), COMPILED_IN]:  # each one's name, hash, mtime and size
        stat = path.stat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        parts += [path.name, digest, str(stat.st_mtime_ns), str(stat.st_size)]
    parts += [
        numba_version,
        sys.version,
        platform.machine(),
        os.environ.get("NUMBA_CACHE_DIR", ""),
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def stamp_path() -> Path:
    return cache_dir() / f"kernels-{_key()}.json"


def is_warm() -> bool:
    """Whether a complete warm-up's stamp exists and every cache file it lists is still there."""
    try:
        listed = json.loads(stamp_path().read_text())["index_files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return bool(listed) and all(os.path.exists(p) for p in listed)


def _lock_is_stale(lock: Path) -> bool:
    try:
        age = time.time() - lock.stat().st_mtime
        pid = int(lock.read_text() or 0)
    except (OSError, ValueError):
        return True
    if age > LOCK_STALE_SECONDS:
        return True
    if os.name == "posix" and pid > 0:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
    return False


def compile_in_background() -> int | None:
    """Start the warm-up in an idle-priority process, unless one is running or the
    cache directory cannot be written; its pid, or None."""
    lock = cache_dir() / f"kernels-{_key()}.lock"
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        if lock.exists() and _lock_is_stale(lock):
            lock.unlink(missing_ok=True)
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except OSError:  # held by a running compile, or not writable
        return None
    try:
        child = subprocess.Popen(
            [sys.executable, "-m", "probe.stats.kernel_cache", str(lock)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            close_fds=True,
        )
    except OSError:
        os.close(fd)
        lock.unlink(missing_ok=True)
        return None
    os.write(fd, str(child.pid).encode())
    os.close(fd)
    return child.pid


def _exercise() -> None:
    """Call every kernel with each kind of argument the statistics pass it: float32 and float64
    batches, by segment, by column and one value a row, with NaN, into a running int64 histogram
    and into the int32 scratch, on torch's team (of at least two, whatever the caller's count)
    and on threads of our own."""
    import numpy as np
    import torch  # (the team is torch's OpenMP runtime)

    from probe.stats import numba_backend as numba_stats
    from probe.stats import team
    from probe.stats.running import RunningStats

    rng = np.random.default_rng(0)
    batches = [
        rng.standard_normal((4, 8, 32, 32)),
        rng.standard_normal((64, 300)),
        rng.standard_normal((50, 1)),
        rng.standard_normal((8, 4, 5)),
    ]
    batches[3][1, 2, 3] = np.nan
    real_entry = team.entry
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))  # (a team of one takes no team kernel: compile them too)
    try:
        for entry in (real_entry, lambda: (0, 0)):
            team.entry = entry
            for a in batches:
                for dtype in (np.float32, np.float64):
                    x = a.astype(dtype)
                    numba_stats.batch_stats(x)
                    running = RunningStats()
                    hist = running.whole_histogram()  # (a new RunningStats's own LogHistogram)
                    running.merge(numba_stats.batch_stats(x, None, hist, running.unit_axis))
                    hook = numba_stats.HookStats()
                    hook.begin()
                    RunningStats().merge(hook(torch.from_numpy(x)))
    finally:
        team.entry = real_entry
        torch.set_num_threads(threads)


def _index_files() -> list[str]:
    """The cache index files of every compiled function in every module of `probe.stats.kernels`
    (a function a module imports from another is listed once)."""
    import importlib

    found = set()
    for path in kernel_files():
        if path.stem == "__init__":
            continue
        module = importlib.import_module(f"probe.stats.kernels.{path.stem}")
        for value in vars(module).values():
            cache = getattr(value, "_cache", None)
            index = getattr(getattr(cache, "_cache_file", None), "_index_path", None)
            if index and os.path.exists(index):
                found.add(str(index))
    return sorted(found)


def warm_up() -> Path:
    """Compile (or load) every kernel and write the stamp; its path."""
    _exercise()
    stamp = stamp_path()
    stamp.parent.mkdir(parents=True, exist_ok=True)
    partial = stamp.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps({"index_files": _index_files()}))
    os.replace(partial, stamp)
    return stamp


def lowest_priority() -> None:
    """Run only on cores nothing else wants: SCHED_IDLE on Linux, else nice 19. It stays in the
    run's session: a session of its own gets its own autogroup, whose share of the CPU the
    scheduler keeps equal to the run's whatever the niceness."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return
    except (AttributeError, OSError):
        pass
    if hasattr(os, "nice"):
        with contextlib.suppress(OSError):
            os.nice(19)


def main(argv: list[str]) -> None:
    """The background warm-up: lowest priority, the lock given back at the end."""
    lowest_priority()
    try:
        warm_up()
    finally:
        if argv:
            Path(argv[0]).unlink(missing_ok=True)


if __name__ == "__main__":
    main(sys.argv[1:])
