"""Split a batch's statistics pass across torch's own OpenMP threads.

A forward hook runs between two of torch's parallel operations, while torch's OpenMP workers spin
idle on their cores; threads of our own would compete with them for those cores. So compiled code
(`kernels.gomp.team_batch`) hands the pass to torch's team through its runtime's `GOMP_parallel`.
`entry()` gives the team's width, else 0 (PROBE_OMP_TEAM=0, or see docs/statistics.md, Threads).
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import threading

ENABLED = os.environ.get("PROBE_OMP_TEAM", "1") != "0"


def _runtime() -> ctypes.CDLL | None:
    """torch's OpenMP runtime if this process has loaded it (never loads one itself), looked
    for once torch is imported. None in a process forked from one that looked: the child has
    the parent's runtime state but not its threads."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    pid = os.getpid()
    if pid not in _found:
        _found[pid] = None if _found else _find(torch)
    return _found[pid]


_found: dict[int, ctypes.CDLL | None] = {}  # by the process that looked


def _find(torch) -> ctypes.CDLL | None:
    """The OpenMP runtime in torch's own lib directory (libgomp in pip wheels, perhaps renamed
    with a hash), else the one runtime the process has loaded; None when torch's ATen backend
    is not OpenMP or the choice is not clear."""
    if "ATen parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    own = glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "lib*omp*.so*"))
    for path in own or _loaded_runtimes():
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD)
        except (OSError, AttributeError):  # not loaded (or no RTLD_NOLOAD: not Linux)
            continue
        if hasattr(lib, "GOMP_parallel") and hasattr(lib, "omp_get_max_threads"):
            lib.omp_get_max_threads.restype = ctypes.c_int
            address = ctypes.cast(lib.GOMP_parallel, ctypes.c_void_p).value
            assert address is not None  # a symbol the runtime exports: never NULL
            _address[os.getpid()] = address
            return lib
    return None


def _loaded_runtimes() -> list[str]:
    """Paths of OpenMP runtimes mapped into this process, when there is exactly one."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {
                line.split()[-1] for line in maps if line.rstrip().endswith(".so") or ".so." in line
            }
    except OSError:
        return []
    names = ("libgomp", "libiomp5", "libomp")
    found = sorted(p for p in paths if os.path.basename(p).startswith(names))
    return found if len(found) == 1 else []


def entry() -> tuple[int, int]:
    """(threads a pass can be split across on torch's team from here, the address of the
    runtime's GOMP_parallel, which `kernels.gomp.team_batch` calls) in one look, as a hook needs
    both: (0, 0) where the team cannot be used (another thread would get a team of new threads,
    competing with the forward; so would a process forked from one that used the team)."""
    if not ENABLED or threading.current_thread() is not threading.main_thread():
        return 0, 0
    lib = _runtime()
    return (lib.omp_get_max_threads(), _address[os.getpid()]) if lib is not None else (0, 0)


_address: dict[int, int] = {}  # GOMP_parallel's address, by process
