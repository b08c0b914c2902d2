"""Split a batch's statistics pass across torch's own OpenMP threads.

A forward hook runs on the thread that called the model, between two of torch's parallel
operations; torch's OpenMP workers wait meanwhile, spinning on their cores for a few ms before they
sleep. Threads of our own would compete with them for those cores (on 2 cores a helper thread
measured no faster than none). Here the pass is handed to torch's team through its OpenMP
runtime's `GOMP_parallel` (libgomp's, also exported by LLVM's and Intel's runtimes), so the split
runs on exactly the workers that were idle. The work function is a numba `cfunc` (no GIL, no
Python objects) that reads the arrays' addresses from a table of int64s.

Only from the main thread, where the forward runs, only when the runtime torch loaded is found,
and not in a process forked after the team was used; `size()` is then the team's width
(torch.set_num_threads), else 0 and the caller splits the pass some other way.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import threading

import numpy as np
from llvmlite import ir
from numba import carray, cfunc, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from probe.kernels import reduce_rows

HEAD = ("claimed", "parts", "rows", "width", "size", "values", "low_bits", "infinite")
PART = ("first_row", "end_row", "counts", "moments", "tallies", "units", "extremes")
H, P = len(HEAD), len(PART)


@intrinsic
def _pointer(typingctx, address):
    """The int64 `address` as a void pointer (to view it with numba.carray)."""

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return types.voidptr(types.int64), codegen


@intrinsic
def _claim(typingctx, table):
    """Atomically add 1 to the int64 at `table`, returning what it held: the next part to do."""

    def codegen(context, builder, signature, args):
        slot = builder.bitcast(args[0], ir.IntType(64).as_pointer())
        return builder.atomic_rmw("add", slot, ir.Constant(ir.IntType(64), 1), "monotonic")

    return types.int64(types.voidptr), codegen


@njit(nogil=True, cache=True)
def _parts(table, counts_type):
    """Each thread of the team claims parts until none is left, so it does not matter which
    thread wakes first or how many the team has."""
    top = carray(table, (H,), np.int64)
    rows, width, size = top[2], top[3], top[4]
    shape = (rows, width, size)
    while True:
        p = _claim(table)
        if p >= top[1]:
            return
        d = carray(table, (H + P * top[1],), np.int64)[H + P * p :]
        lo, hi = d[0], d[1]
        reduce_rows(
            carray(_pointer(top[5]), shape, np.float32)[lo:hi],
            carray(_pointer(top[5]), shape, np.uint32)[lo:hi],
            carray(_pointer(top[5]), shape, np.int32)[lo:hi],
            np.int32(top[6]),
            np.int32(top[7]),
            carray(_pointer(d[2]), (1 << 16,), counts_type),
            carray(_pointer(d[3]), (4,), np.float64),
            carray(_pointer(d[4]), (5,), np.int64),
            carray(_pointer(d[5]), (3, width), np.float64),
            carray(_pointer(d[6]), (2, width), np.int64),
        )


@cfunc(types.void(types.voidptr), cache=True)
def _work32(table):
    _parts(table, np.int32)


@cfunc(types.void(types.voidptr), cache=True)
def _work64(table):
    _parts(table, np.int64)


WORK = {np.dtype(np.int32): _work32, np.dtype(np.int64): _work64}  # by the counts' dtype


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
            lib.GOMP_parallel.restype = None
            lib.GOMP_parallel.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_uint] * 2
            lib.omp_get_max_threads.restype = ctypes.c_int
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


def size() -> int:
    """Threads a pass can be split across on torch's team from here; 0 when it cannot (another
    thread would get a team of new threads, competing with the forward; so would a process
    forked from one that used the team)."""
    if threading.current_thread() is not threading.main_thread():
        return 0
    lib = _runtime()
    return lib.omp_get_max_threads() if lib is not None else 0


def reduce(y: np.ndarray, low_bits, infinite, cuts: list[int], lanes, outs) -> None:
    """`reduce_rows` over y[cuts[p]:cuts[p+1]] into lanes[p] and part p of each of `outs`
    (moments, tallies, units, extremes stacked on axis 0), one part per thread of torch's team.
    y is C-contiguous float32; every array of `outs` and every lane is C-contiguous."""
    if y.dtype != np.float32 or not y.flags.c_contiguous:
        raise ValueError(f"team.reduce takes C-contiguous float32 values, not {y.dtype}")
    if any(lane.shape != (1 << 16,) or not lane.flags.c_contiguous for lane in lanes):
        raise ValueError("team.reduce counts into C-contiguous lanes of 65536 buckets")
    table = _table(y, low_bits, infinite, np.asarray(cuts, np.int64), tuple(lanes), *outs)
    _runtime().GOMP_parallel(WORK[lanes[0].dtype].address, table.ctypes.data, len(cuts) - 1, 0)


@njit(nogil=True, cache=True)
def _table(y, low_bits, infinite, cuts, lanes, moments, tallies, units, extremes):
    """The table `_parts` reads (HEAD, then PART per part), filled in one compiled call: taking
    a dozen addresses through numpy's `.ctypes` costs more than a small batch's whole pass."""
    parts = cuts.size - 1
    table = np.empty(H + P * parts, np.int64)
    table[0] = 0
    table[1] = parts
    table[2], table[3], table[4] = y.shape
    table[5] = y.ctypes.data
    table[6] = low_bits
    table[7] = infinite
    for p in range(parts):
        d = H + P * p
        table[d] = cuts[p]
        table[d + 1] = cuts[p + 1]
        table[d + 2] = lanes[p].ctypes.data
        table[d + 3] = moments[p].ctypes.data
        table[d + 4] = tallies[p].ctypes.data
        table[d + 5] = units[p].ctypes.data
        table[d + 6] = extremes[p].ctypes.data
    return table
