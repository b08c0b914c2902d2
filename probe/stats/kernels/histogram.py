"""The log-histogram's buckets: a value's bucket is the top 16 bits of its float32 bit pattern.

Here are the loops that count a segment into them while it sits in L1 (a scalar, memory-bound
pass kept apart from the vectorised moments: `_histogram`, over two arrays for runs of one value,
asking ahead for the next segment when it is long), and after a batch the ranges of buckets its
finite values can fall in (`bucket_ranges`, `span_heads`), copied out and zeroed (`take_spans`).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils

from probe.stats.kernels import intrinsic

LINE = 16  # values of 4 bytes in a 64-byte cache line
AHEAD_MIN = 1024  # segments of at least a page ask for the next one; smaller ones need not


@intrinsic
def _prefetch(typingctx, array, index):
    """Ask for the cache line holding array[index] (llvm.prefetch: read, keep in all levels)."""

    def codegen(context, builder, signature, args):
        kind = signature.args[0]
        view = context.make_array(kind)(context, builder, args[0])
        item = cgutils.get_item_pointer(context, builder, kind, view, [args[1]], wraparound=False)
        byte = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [byte, i32, i32, i32]), "llvm.prefetch"
        )
        flags = [ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)]
        builder.call(fn, [builder.bitcast(item, byte), *flags])
        return context.get_dummy_value()

    return types.void(array, types.intp), codegen


@numba.njit(nogil=True, cache=True)
def _histogram(w, counts):
    """counts[top 16 bits] += 1 for every float32 bit pattern of w."""
    for i in range(w.size):
        counts[w[i] >> 16] += 1


@numba.njit(nogil=True, cache=True)
def _histogram_split(w, counts, spare):
    """The same, alternate values counted into `spare`: a run of one value (the zeros of a
    ReLU) makes each increment wait for the last one to the same bucket; two arrays halve the
    chain (0.9 -> 0.5 ns per value on half-zero data)."""
    n = w.size
    for i in range(0, n - 1, 2):
        counts[w[i] >> 16] += 1
        spare[w[i + 1] >> 16] += 1
    if n % 2:
        counts[w[n - 1] >> 16] += 1


@numba.njit(nogil=True, cache=True)
def _histogram_ahead(w, counts, spare, flat, ahead):
    """`_histogram` (or `_histogram_split` when `spare` has buckets) of a segment of at least
    AHEAD_MIN values, asking for a line of flat[ahead:] (the next segment) every LINE values:
    the increments leave the memory system idle, and the hardware prefetcher stops at every
    4 KiB page, so the next moments pass would start on values still in memory (a fresh
    capture's statistics took twice as long as the same pass over values in cache). Smaller
    segments keep the plain loops, which the blocks here slow down."""
    n = w.size
    end = min(n, flat.size - ahead)
    for block in range(0, n, LINE):
        if block < end:
            _prefetch(flat, ahead + block)
        stop = min(block + LINE, n)
        if spare.size:
            for i in range(block, stop - 1, 2):
                counts[w[i] >> 16] += 1
                spare[w[i + 1] >> 16] += 1
            if (stop - block) % 2:
                counts[w[stop - 1] >> 16] += 1
        else:
            for i in range(block, stop):
                counts[w[i] >> 16] += 1


@numba.njit(nogil=True, cache=True)
def _magnitude(v):
    """The bucket of |v| as a float32 (beyond float32's range: the Inf bucket)."""
    a = np.empty(1, np.float32)
    a[0] = abs(v)
    return np.int64(a.view(np.int32)[0] >> 16)


@numba.njit(nogil=True, cache=True)
def bucket_ranges(lo, hi, smallest=0.0):
    """[start, stop) bucket ranges holding every float32 in [lo, hi] whose magnitude is at least
    `smallest`, one per sign. A bucket is the top 16 bits of a float32: 0x0000 up for +0.0 and
    growing magnitudes, 0x8000 up for -0.0 and growing negative magnitudes. Zeros of either sign
    are within [lo, hi] whenever 0 is (a min or max of 0.0 may carry either sign), so both zero
    buckets are then included unless `smallest` is above 0."""
    ranges = [(np.int64(0), np.int64(0))][:0]
    if hi >= 0.0:
        ranges.append((_magnitude(max(lo, smallest)), _magnitude(hi) + 1))
    if lo <= 0.0:
        nearest = _magnitude(min(hi, -smallest))
        ranges.append((0x8000 | nearest, (0x8000 | _magnitude(lo)) + 1))
    return ranges


@numba.njit(nogil=True, cache=True)
def span_heads(lo, hi, smallest):
    """(first bucket, length) per sign of the buckets finite values in [lo, hi] with magnitudes
    from `smallest` up can fall in."""
    ranges = bucket_ranges(lo, hi, smallest)
    heads = np.empty((len(ranges), 2), np.int64)
    for j, (start, stop) in enumerate(ranges):
        heads[j, 0] = start
        heads[j, 1] = stop - start
    return heads


@numba.njit(nogil=True, cache=True)
def take_spans(lanes, heads, out):
    """The lanes' summed counts over the buckets of `heads`, one span after another into `out`,
    leaving the lanes zero there."""
    offset = 0
    for j in range(heads.shape[0]):
        piece = out[offset : offset + heads[j, 1]]
        for lane in lanes:
            drain(lane, heads[j, 0], piece)
        offset += heads[j, 1]


@numba.njit(nogil=True, cache=True)
def drain(counts, first, out):
    """out += counts[first:first + out.size], leaving those counts zero."""
    for i in range(out.size):
        out[i] += counts[first + i]
        counts[first + i] = 0
