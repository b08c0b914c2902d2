"""A whole batch on torch's OpenMP team in one call from Python (`team_batch`): after a
convolution every Python-level step is slow, so compiled code itself calls the runtime's
GOMP_parallel (`probe.stats.team` finds it) with a numba cfunc (`WORK`: no GIL, no Python
objects) that reads the arrays' addresses from a table of int64s (`team_table`) and claims parts
of rows atomically, then packs the parts' results (`packing.finish`).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import carray, types
from numba.core import cgutils

from probe.stats.kernels import intrinsic
from probe.stats.kernels.packing import finish
from probe.stats.kernels.rows import reduce_rows

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


@numba.njit(nogil=True, cache=True)
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


@numba.cfunc(types.void(types.voidptr), cache=True)
def _work32(table):
    _parts(table, np.int32)


@numba.cfunc(types.void(types.voidptr), cache=True)
def _work64(table):
    _parts(table, np.int64)


WORK = {np.dtype(np.int32): _work32, np.dtype(np.int64): _work64}  # by the counts' dtype


@numba.njit(nogil=True, cache=True)
def team_table(y, low_bits, infinite, cuts, lanes, moments, tallies, units, extremes):
    """The table `_parts` reads (HEAD, then PART per part) for `team_batch`: the arrays'
    addresses, taken in compiled code (through numpy's `.ctypes` a dozen of them cost more than a
    small batch's whole pass)."""
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


@intrinsic
def _call_parallel(typingctx, parallel, work, data, threads):
    """parallel(work, data, threads, 0) for the int64 address `parallel` of GOMP_parallel."""

    def codegen(context, builder, signature, args):
        byte = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        kind = ir.FunctionType(ir.VoidType(), [byte, byte, i32, i32])
        fn = builder.inttoptr(args[0], kind.as_pointer())
        work_ptr, data_ptr = (builder.inttoptr(a, byte) for a in args[1:3])
        builder.call(fn, [work_ptr, data_ptr, builder.trunc(args[3], i32), ir.Constant(i32, 0)])
        return context.get_dummy_value()

    return types.void(types.int64, types.int64, types.int64, types.int64), codegen


@numba.njit(nogil=True, cache=True)
def team_batch(x, lanes, spans, parallel, work):
    """`finish` of x (rows, units, ...; C-contiguous float32, not empty) seen as (rows, units,
    rest) and reduced in parts of rows, one per thread of torch's team (at most one per lane
    and per row): `parallel` is the address of its runtime's GOMP_parallel and `work` that of
    the `_work32`/`_work64` matching the lanes' dtype. One call from Python per batch: after a
    convolution every Python-level step is slow (its caches are cold), so the hooks' fixed cost
    is in the number of steps."""
    rows, width = x.shape[0], x.shape[1]
    y = x.reshape((rows, width, x.size // (rows * width)))
    parts = min(lanes.shape[0], rows)
    lanes = lanes[:parts]
    cuts = np.empty(parts + 1, np.int64)
    for p in range(parts + 1):
        cuts[p] = rows * p // parts
    low_bits = np.int32(0x7FFFFFFF)
    infinite = np.int32(0x7F800000)  # +Inf's key
    moments = np.empty((parts, 4))
    tallies = np.empty((parts, 5), np.int64)
    units = np.empty((parts, 3, width))
    extremes = np.empty((parts, 2, width), np.int64)
    table = team_table(y, low_bits, infinite, cuts, lanes, moments, tallies, units, extremes)
    _call_parallel(parallel, work, table.ctypes.data, parts)
    # Read after the call: the workers see only the table's address, so numba must not free it
    # before (it may, after an array's last use); every part must have been claimed.
    if table[0] < parts:
        raise RuntimeError("torch's OpenMP team left parts of a batch's statistics undone")
    keys = y.view(np.int32)
    return finish(moments, tallies, units, extremes, low_bits, keys, y, lanes, spans)
