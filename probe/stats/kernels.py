"""The passes over the data that every statistic comes from, compiled with numba.

A chain of torch or numpy reductions reads an activation a dozen times (sums, squares, extremes,
signs, a histogram) and allocates as many temporaries; here each (row, unit) segment is read twice
while it sits in the L1 cache: a vectorised pass for the moments, in float64, and the extremes,
as integer order keys, then a scalar pass for the histogram (over two arrays when the segment is
mostly zeros). Extremes beyond +-Inf's keys mean the segment holds NaN or Inf, and only then is
it read a third time, checking every value. Segments of fewer than NARROW values (a linear
layer's outputs are segments of one) are reduced a row at a time across their columns instead
(`_by_column`: a row's piece is read for its largest magnitude, then its moments, then its
histogram), and rows of a single value all as one segment. The functions release the GIL,
so several threads can share a batch. `finish` merges a batch's parts (`combine`) and copies out
its histogram (`take_spans`), and `team_batch` does a whole batch on torch's threads, in one call
each: in a hook, with the caches just emptied by a convolution, each of the dozen Python-level
steps they replace took tens of us.
Compiled code is cached on disk after the first call, checked against this file's contents: the
callers of these passes (`probe.stats.team`'s entry points) are here too, so a change here never leaves
a stale copy of a pass compiled into a caller cached elsewhere.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import carray, types
from numba.core import cgutils
from numba.extending import intrinsic, overload
from numba.np.numpy_support import as_dtype


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


LINE = 16  # values of 4 bytes in a 64-byte cache line
AHEAD_MIN = 1024  # segments of at least a page ask for the next one; smaller ones need not
# Segments shorter than NARROW are reduced column by column (`_by_column`) when a row has at
# least NARROW_UNITS units and there are at least an eighth as many rows as values in a segment
# (the columns' scratch is set up and folded once per call); single values always are. Measured
# on one thread: 8 rows of 49 values 1.10 against 1.30 ns per value, 64 rows of 100 0.82 against
# 0.98; 4 rows of 49 1.40 against 1.30.
NARROW = 128
NARROW_UNITS = 4
COLUMN_BLOCK = 4096  # columns reduced together: their scratch (52-56 bytes each) stays in L2


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
def order_key(x, low_bits):
    """An integer that sorts as the float whose bit pattern is x (`low_bits` = all bits but the
    sign): negative floats have their magnitude bits flipped. It is its own inverse. Integer
    min/max run in SIMD lanes where float min/max (NaN rules) do not."""
    return x ^ low_bits if x < 0 else x


def same_width(x, like):
    """x as an integer of like's type (numba promotes int32 arithmetic to int64)."""
    return type(like)(x)


@overload(same_width, jit_options={"cache": True})
def _same_width(x, like):
    kind = as_dtype(like).type
    return lambda x, like: kind(x)


@numba.njit(nogil=True, cache=True, fastmath=True)
def _moments(a, keys, low_bits, shift):
    """Moments about `shift` of a segment known to hold only finite values (so fast-math rules
    are exact enough: sums may be reassociated, which is what lets them run in SIMD lanes);
    extremes as order keys, the smallest magnitude as the bits of |v|, and the sum of squares
    itself (a row's norm from the shifted sums would cancel when its values are far below the
    shift). Integer work stays at the keys' width and the counts are floats: lanes of one width
    vectorise best (20% faster than int64 tallies)."""
    sign = same_width(keys.itemsize * 8 - 1, low_bits)
    s = 0.0
    q = 0.0
    b = 0.0
    sq = 0.0
    lo = same_width(order_key(keys[0], low_bits), low_bits)
    hi = lo
    small = low_bits
    zeros = 0.0
    positive = 0.0
    for i in range(a.size):
        v = np.float64(a[i])
        d = v - shift
        s += d
        q += d * d
        b += abs(v)
        sq += v * v
        x = keys[i]
        magnitude = same_width(x & low_bits, low_bits)
        k = same_width(x ^ (low_bits & (x >> sign)), low_bits)  # order_key without a branch
        lo = min(lo, k)
        hi = max(hi, k)
        small = min(small, magnitude)
        zeros += 1.0 if magnitude == 0 else 0.0
        positive += 1.0 if x > 0 else 0.0
    return s, q, b, sq, lo, hi, small, int(zeros), int(positive)


@numba.njit(nogil=True, cache=True)
def _moments_checked(a, keys, low_bits, shift):
    """The same over the finite values of a segment that holds NaN or Inf; also counts them.
    Kept apart from `_moments`: under fast-math the compiler may assume no NaN and drop these
    tests, and with them in one loop the fast path would no longer vectorise."""
    s = 0.0
    q = 0.0
    b = 0.0
    sq = 0.0
    lo = low_bits  # the key of NaN: above every finite key
    hi = -low_bits - 1
    small = low_bits
    zeros = 0
    positive = 0
    nans = 0
    infs = 0
    for i in range(a.size):
        v = np.float64(a[i])
        if np.isnan(v):
            nans += 1
        elif np.isinf(v):
            infs += 1
        else:
            d = v - shift
            s += d
            q += d * d
            b += abs(v)
            sq += v * v
            zeros += v == 0
            positive += v > 0
            k = order_key(keys[i], low_bits)
            lo = min(lo, k)
            hi = max(hi, k)
            small = min(small, keys[i] & low_bits)
    return s, q, b, sq, lo, hi, small, zeros, positive, nans, infs


@numba.njit(nogil=True, cache=True)
def _by_segment(y, bits, keys, low_bits, infinite, counts, shifts, unit_s, unit_q, units, extremes):
    """`reduce_rows`' loop by (row, unit) segment, each read while it sits in L1. Returns (sum
    of |v|, L2 sum, zeros, NaN, Inf, smallest magnitude, spare histogram)."""
    rows, width, size = y.shape
    absolute = 0.0
    l2 = 0.0
    zeros = 0
    nans = 0
    infs = 0
    smallest = low_bits
    spare = counts[:0]  # a second histogram, made for the first segment of many zeros
    flat = bits.reshape(-1)
    for r in range(rows):
        row_sq = 0.0
        for u in range(width):
            shift = shifts[u]
            seg_nans = 0
            seg_infs = 0
            s, q, b, sq, lo, hi, small, seg_zeros, positive = _moments(
                y[r, u], keys[r, u], low_bits, shift
            )
            split = seg_zeros * 8 > size
            if split and spare.size == 0:
                spare = np.zeros(counts.size, counts.dtype)
            if size >= AHEAD_MIN:
                pair = spare if split else spare[:0]
                _histogram_ahead(bits[r, u], counts, pair, flat, (r * width + u + 1) * size)
            elif split:
                _histogram_split(bits[r, u], counts, spare)
            else:
                _histogram(bits[r, u], counts)
            if lo <= -infinite - 1 or hi >= infinite:  # NaN or Inf: again, over finite values
                checked = _moments_checked(y[r, u], keys[r, u], low_bits, shift)
                s, q, b, sq, lo, hi, small, seg_zeros, positive, seg_nans, seg_infs = checked
            smallest = min(smallest, small)
            k = size - seg_nans - seg_infs
            nans += seg_nans
            infs += seg_infs
            absolute += b
            zeros += seg_zeros
            row_sq += sq
            unit_s[u] += s
            unit_q[u] += q
            units[0, u] += k
            units[2, u] += positive
            extremes[0, u] = min(extremes[0, u], lo)
            extremes[1, u] = max(extremes[1, u], hi)
        l2 += np.sqrt(row_sq)
    return absolute, l2, zeros, nans, infs, smallest, spare


@numba.njit(nogil=True, cache=True, fastmath=True)
def _columns(a, keys, low_bits, shift, sums, squares, positive, lows, highs):
    """One row of finite values into per-column accumulators (each column's sums about its
    shift, its count above 0 and extremes as order keys), in SIMD lanes across the columns.
    Returns the row's sum of |v|, sum of squares, zeros and smallest magnitude."""
    sign = same_width(keys.itemsize * 8 - 1, low_bits)
    b = 0.0
    sq = 0.0
    zeros = 0.0
    small = low_bits
    for j in range(a.size):
        v = np.float64(a[j])
        d = v - shift[j]
        sums[j] += d
        squares[j] += d * d
        b += abs(v)
        sq += v * v
        x = keys[j]
        magnitude = same_width(x & low_bits, low_bits)
        k = same_width(x ^ (low_bits & (x >> sign)), low_bits)  # order_key without a branch
        lows[j] = min(lows[j], k)
        highs[j] = max(highs[j], k)
        small = min(small, magnitude)
        zeros += 1.0 if magnitude == 0 else 0.0
        positive[j] += 1.0 if x > 0 else 0.0
    return b, sq, int(zeros), small


@numba.njit(nogil=True, cache=True)
def _columns_checked(a, keys, low_bits, shift, sums, squares, positive, lows, highs, bad):
    """The same for a row holding NaN or Inf, over its finite values; `bad` counts the others
    per column. Returns also the row's NaN and Inf counts."""
    b = 0.0
    sq = 0.0
    zeros = 0
    small = low_bits
    nans = 0
    infs = 0
    for j in range(a.size):
        v = np.float64(a[j])
        if not np.isfinite(v):
            nans += np.isnan(v)
            infs += np.isinf(v)
            bad[j] += 1
            continue
        d = v - shift[j]
        sums[j] += d
        squares[j] += d * d
        b += abs(v)
        sq += v * v
        zeros += v == 0
        positive[j] += v > 0
        k = order_key(keys[j], low_bits)
        lows[j] = min(lows[j], k)
        highs[j] = max(highs[j], k)
        small = min(small, keys[j] & low_bits)
    return b, sq, zeros, small, nans, infs


@numba.njit(nogil=True, cache=True)
def _worst(keys, low_bits):
    """The largest magnitude's bits in a row: at least +Inf's when it holds NaN or Inf."""
    worst = same_width(0, low_bits)
    for j in range(keys.size):
        worst = max(worst, same_width(keys[j] & low_bits, low_bits))
    return worst


@numba.njit(nogil=True, cache=True)
def _by_column(y, bits, keys, low_bits, infinite, counts, shifts, unit_s, unit_q, units, extremes):
    """`reduce_rows`' loop for narrow segments (a linear layer's single values, a 4x4 map): a
    segment's moments end in a dozen horizontal sums, which cost more than a few values. Here
    the columns (unit, position) of every row are reduced in blocks of COLUMN_BLOCK: each
    block's piece of a row is one pass across its columns, whose sums, counts and extremes
    accumulate in arrays over all rows, then fold into the units (sums about a unit's shift add
    up). Returns what `_by_segment` does."""
    rows, width, size = y.shape
    columns = width * size
    span = min(columns, COLUMN_BLOCK)
    shift = np.empty(span)
    sums = np.empty(span)
    squares = np.empty(span)
    positive = np.empty(span)
    lows = np.empty(span, keys.dtype)
    highs = np.empty(span, keys.dtype)
    bad = np.empty(span, np.int64)
    row_sq = np.zeros(rows)
    absolute = 0.0
    zeros = 0
    nans = 0
    infs = 0
    smallest = low_bits
    spare = counts[:0]
    for c0 in range(0, columns, span):
        c1 = min(columns, c0 + span)
        n = c1 - c0
        first = c0 // size  # the unit of column c0
        sums[:] = 0.0
        squares[:] = 0.0
        positive[:] = 0.0
        lows[:] = low_bits
        highs[:] = -low_bits - 1
        bad[:] = 0
        u, j = first, 0
        while j < n:  # each unit's run of columns in the block
            stop = min(n, (u + 1) * size - c0)
            shift[j:stop] = shifts[u]
            u, j = u + 1, stop
        for r in range(rows):
            a = y[r].reshape(-1)[c0:c1]
            k = keys[r].reshape(-1)[c0:c1]
            if _worst(k, low_bits) < infinite:
                b, sq, piece_zeros, small = _columns(
                    a, k, low_bits, shift[:n], sums, squares, positive, lows, highs
                )
            else:
                b, sq, piece_zeros, small, piece_nans, piece_infs = _columns_checked(
                    a, k, low_bits, shift[:n], sums, squares, positive, lows, highs, bad
                )
                nans += piece_nans
                infs += piece_infs
            absolute += b
            row_sq[r] += sq
            zeros += piece_zeros
            smallest = min(smallest, small)
            piece = bits[r].reshape(-1)[c0:c1]
            if piece_zeros * 8 > n:
                if spare.size == 0:
                    spare = np.zeros(counts.size, counts.dtype)
                _histogram_split(piece, counts, spare)
            else:
                _histogram(piece, counts)
        u, j = first, 0
        while j < n:  # folded a unit at a time: one chain of adds per unit, not per column
            stop = min(n, (u + 1) * size - c0)
            s = 0.0
            q = 0.0
            p = 0.0
            missing = 0
            lo = extremes[0, u]
            hi = extremes[1, u]
            for c in range(j, stop):
                s += sums[c]
                q += squares[c]
                p += positive[c]
                missing += bad[c]
                lo = min(lo, lows[c])
                hi = max(hi, highs[c])
            unit_s[u] += s
            unit_q[u] += q
            units[0, u] += (stop - j) * rows - missing
            units[2, u] += p
            extremes[0, u] = lo
            extremes[1, u] = hi
            u, j = u + 1, stop
    l2 = 0.0
    for r in range(rows):
        l2 += np.sqrt(row_sq[r])
    return absolute, l2, zeros, nans, infs, smallest, spare


@numba.njit(nogil=True, cache=True)
def first_finite(y):
    """Each unit's first finite value (row by row), else 0: the shift its sums are taken about."""
    rows, width, size = y.shape
    shifts = np.zeros(width)
    found = np.zeros(width, np.bool_)
    left = width
    for r in range(rows):
        for u in range(width):
            if found[u]:
                continue
            for i in range(size):
                if np.isfinite(y[r, u, i]):
                    shifts[u] = y[r, u, i]
                    found[u] = True
                    left -= 1
                    break
        if left == 0:
            break
    return shifts


@numba.njit(nogil=True, cache=True)
def reduce_rows(y, bits, keys, low_bits, infinite, counts, moments, tallies, units, extremes):
    """Fold y (rows, units, size) into one partial result, over finite values only.

    moments = (mean, M2, sum of |v|, sum over rows of the row's L2 norm), float64;
    tallies = (finite, zeros, NaN, Inf) counts and the smallest finite magnitude (the bits of
    |v|; `low_bits` when none); per unit, `units` (3, units) float64 holds the
    finite count, sum and count above 0, `extremes` (2, units) int64 the order keys of the min and
    the max (meaningless when the count is 0). Each unit's sums are taken about one of its values
    (its first finite one, else 0), and the units merged with Chan's formula at the end,
    so 1000 +- 0.01 keeps its variance. `bits` are the float32 bit patterns of y (y itself when
    float32), whose top 16 bits index `counts` for every value including NaN and Inf; `keys` is y
    viewed as signed integers of its own width, `low_bits` that width's largest value and
    `infinite` the key of +Inf."""
    rows, width, size = y.shape
    shifts = first_finite(y)
    unit_s = np.zeros(width)
    unit_q = np.zeros(width)
    for u in range(width):
        units[0, u] = 0.0
        units[2, u] = 0.0
        extremes[0, u] = low_bits
        extremes[1, u] = -low_bits - 1
    given = (y, bits, keys, low_bits, infinite, counts, shifts, unit_s, unit_q, units, extremes)
    if width * size == 1:  # one value a row: all rows as one segment, a row's L2 norm its |v|
        whole = (y.reshape(1, 1, rows), bits.reshape(1, 1, rows), keys.reshape(1, 1, rows))
        absolute, l2, zeros, nans, infs, smallest, spare = _by_segment(*whole, *given[3:])
        l2 = absolute
    elif size == 1 or (size < NARROW and width >= NARROW_UNITS and 8 * rows >= size):
        absolute, l2, zeros, nans, infs, smallest, spare = _by_column(*given)
    else:
        absolute, l2, zeros, nans, infs, smallest, spare = _by_segment(*given)
    for i in range(spare.size):
        counts[i] += spare[i]
    n = 0.0
    mean = 0.0
    m2 = 0.0
    for u in range(width):
        k = units[0, u]
        units[1, u] = k * shifts[u] + unit_s[u]
        if k == 0:
            continue
        unit_mean = shifts[u] + unit_s[u] / k
        unit_m2 = max(unit_q[u] - unit_s[u] * unit_s[u] / k, 0.0)
        total = n + k
        delta = unit_mean - mean
        mean += delta * k / total
        m2 += unit_m2 + delta * delta * n * k / total
        n = total
    moments[0] = mean
    moments[1] = m2
    moments[2] = absolute
    moments[3] = l2
    tallies[0] = n
    tallies[1] = zeros
    tallies[2] = nans
    tallies[3] = infs
    tallies[4] = smallest


@numba.njit(nogil=True, cache=True)
def combine(moments, tallies, units, extremes, low_bits, keys, values):
    """One batch's statistics from its parts' `reduce_rows` results (stacked on axis 0): Chan's
    merge of (count, mean, M2), sums of the rest, and the extremes' order keys turned back into
    values (of `values`' dtype, `keys` being their integer view). Returns scalars (finite count,
    mean, M2, min, max, sum of |v|, zeros, NaN, Inf, L2 sum, smallest finite |v|) and per unit
    (count, sum, min, max, count above 0); a unit without a finite value has min +Inf and max
    -Inf."""
    parts, _, width = units.shape
    n = 0.0
    mean = 0.0
    m2 = 0.0
    scalars = np.zeros(11)
    smallest = np.empty(1, keys.dtype)
    smallest[0] = low_bits
    for p in range(parts):
        smallest[0] = min(smallest[0], tallies[p, 4])
        k = float(tallies[p, 0])
        if k > 0 and n == 0:  # the first part as it is: (delta * k) / k may move the last bit
            n, mean, m2 = k, moments[p, 0], moments[p, 1]
        elif k > 0:
            total = n + k
            delta = moments[p, 0] - mean
            mean += delta * k / total
            m2 += moments[p, 1] + delta * delta * n * k / total
            n = total
        scalars[5] += moments[p, 2]
        scalars[6] += tallies[p, 1]
        scalars[7] += tallies[p, 2]
        scalars[8] += tallies[p, 3]
        scalars[9] += moments[p, 3]
    count = np.zeros(width, np.int64)
    sums = np.zeros(width)
    positive = np.zeros(width, np.int64)
    low_keys = np.empty(width, keys.dtype)
    high_keys = np.empty(width, keys.dtype)
    for u in range(width):
        lo = extremes[0, 0, u]
        hi = extremes[0, 1, u]
        for p in range(parts):
            count[u] += np.int64(units[p, 0, u])
            sums[u] += units[p, 1, u]
            positive[u] += np.int64(units[p, 2, u])
            lo = min(lo, extremes[p, 0, u])
            hi = max(hi, extremes[p, 1, u])
        low_keys[u] = order_key(lo, low_bits)
        high_keys[u] = order_key(hi, low_bits)
    lows = low_keys.view(values.dtype).astype(np.float64)
    highs = high_keys.view(values.dtype).astype(np.float64)
    scalars[3] = np.inf
    scalars[4] = -np.inf
    for u in range(width):
        if count[u] == 0:
            lows[u] = np.inf
            highs[u] = -np.inf
        scalars[3] = min(scalars[3], lows[u])
        scalars[4] = max(scalars[4], highs[u])
    scalars[0] = n
    scalars[1] = mean
    scalars[2] = m2
    scalars[10] = smallest.view(values.dtype)[0] if n > 0 else np.inf
    return scalars, count, sums, lows, highs, positive


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


# -- the team's entry points (`probe.stats.team`): a table of addresses, parts claimed atomically ------
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


PACKED_HEAD = 13  # width, spans, then the 11 scalars of `combine`


@numba.njit(nogil=True, cache=True)
def finish(moments, tallies, units, extremes, low_bits, keys, values, lanes, spans):
    """A batch's result from its parts' `reduce_rows`, packed into one float64 array (after a
    convolution each array handed back to Python costs microseconds): the units' width w and
    the number k of histogram spans, `combine`'s 11 scalars, its count, sums, lows, highs and
    positive (w each), then with `spans` the (first bucket, length) of each span and the counts
    its finite values left in the lanes (`take_spans`; all exact below 2**53). The buckets of
    NaN and Inf are cleared first when there were any (or the values are float64, whose values
    beyond float32's range count there): they never hold a finite value."""
    scalars, count, sums, lows, highs, positive = combine(
        moments, tallies, units, extremes, low_bits, keys, values
    )
    if scalars[7] > 0 or scalars[8] > 0 or values.itemsize == 8:
        for lane in lanes:
            lane[0x7F80:0x8000] = 0
            lane[0xFF80:] = 0
    if spans and scalars[0] > 0:
        heads = span_heads(scalars[3], scalars[4], scalars[10])
    else:
        heads = np.empty((0, 2), np.int64)
    width, k = count.size, heads.shape[0]
    packed = np.zeros(PACKED_HEAD + 5 * width + 2 * k + heads[:, 1].sum())
    packed[0], packed[1] = width, k
    packed[2:PACKED_HEAD] = scalars
    o = PACKED_HEAD
    packed[o : o + width] = count
    packed[o + width : o + 2 * width] = sums
    packed[o + 2 * width : o + 3 * width] = lows
    packed[o + 3 * width : o + 4 * width] = highs
    packed[o + 4 * width : o + 5 * width] = positive
    o += 5 * width
    packed[o : o + 2 * k] = heads.ravel()
    take_spans(lanes, heads, packed[o + 2 * k :])
    return packed


@numba.njit(nogil=True, cache=True)
def fold_packed(packed, counts, count, sums, lows, highs, positive):
    """Adds a `finish` result's units and histogram spans into running ones, in place."""
    width, k = int(packed[0]), int(packed[1])
    o = PACKED_HEAD
    for u in range(width):
        count[u] += np.int64(packed[o + u])
        sums[u] += packed[o + width + u]
        lows[u] = np.minimum(lows[u], packed[o + 2 * width + u])
        highs[u] = np.maximum(highs[u], packed[o + 3 * width + u])
        positive[u] += np.int64(packed[o + 4 * width + u])
    o += 5 * width
    offset = o + 2 * k
    for j in range(k):
        start, length = int(packed[o + 2 * j]), int(packed[o + 2 * j + 1])
        for i in range(length):
            counts[start + i] += np.int64(packed[offset + i])
        offset += length


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
