"""The pass by column, for narrow segments (a linear layer's single values, a 4x4 map): a
segment's moments end in a dozen horizontal sums, which cost more than a few values, so here the
columns (unit, position) of a row are reduced side by side, in SIMD lanes, into per-column
accumulators, COLUMN_BLOCK columns at a time, folded into their units at the end. It returns what
`segments._by_segment` does, so `rows.reduce_rows` takes either.
"""

from __future__ import annotations

import numba
import numpy as np

from probe.stats.kernels.histogram import _histogram, _histogram_split
from probe.stats.kernels.keys import order_key, same_width

COLUMN_BLOCK = 4096  # columns reduced together: their scratch (44-56 bytes each) stays in L2


@numba.njit(nogil=True, cache=True, fastmath=True)
def _column_sums(a, shift, sums, squares):
    """One row of finite values into per-column float64 sums about each column's shift, in
    SIMD lanes across the columns. Returns the row's sum of |v| and sum of squares. Apart from
    `_column_keys` for the reason `segments._sums` gives."""
    b = 0.0
    sq = 0.0
    for j in range(a.size):
        v = np.float64(a[j])
        d = v - shift[j]
        sums[j] += d
        squares[j] += d * d
        b += abs(v)
        sq += v * v
    return b, sq


@numba.njit(nogil=True, cache=True, fastmath=True)
def _column_keys(keys, low_bits, positive, lows, highs):
    """The same row's order keys into per-column extremes and counts above 0 (`positive`, of
    the keys' own width, as the keys' work is). Returns the row's zeros and smallest
    magnitude."""
    zeros = 0.0
    small = low_bits
    for j in range(keys.size):
        x = keys[j]
        magnitude = same_width(x & low_bits, low_bits)
        k = same_width(x ^ low_bits, low_bits) if x < 0 else x
        lows[j] = min(lows[j], k)
        highs[j] = max(highs[j], k)
        small = min(small, magnitude)
        zeros += 1.0 if magnitude == 0 else 0.0
        positive[j] += same_width(1, low_bits) if x > 0 else same_width(0, low_bits)
    return int(zeros), small


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
    up). Returns what `segments._by_segment` does."""
    rows, width, size = y.shape
    columns = width * size
    span = min(columns, COLUMN_BLOCK)
    shift = np.empty(span)
    sums = np.empty(span)
    squares = np.empty(span)
    positive = np.empty(span, keys.dtype)
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
        positive[:] = 0
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
                b, sq = _column_sums(a, shift[:n], sums, squares)
                piece_zeros, small = _column_keys(k, low_bits, positive, lows, highs)
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
