"""The pass by (row, unit) segment, for segments of at least `rows.NARROW` values (a
convolution's maps): each is read while it sits in L1, first for its moments (float64 sums about
its unit's shift, `_sums`), then for its extremes as order keys and its counts (`_keys`), both
vectorised under fast-math, then for its histogram; a fourth time, checking every value, only
when its extremes show NaN or Inf, so the common case never pays for those tests. Narrower
segments go by column (`columns`).
"""

from __future__ import annotations

import numba
import numpy as np

from probe.stats.kernels.histogram import (
    AHEAD_MIN,
    _histogram,
    _histogram_ahead,
    _histogram_split,
)
from probe.stats.kernels.keys import order_key, same_width


@numba.njit(nogil=True, cache=True, fastmath=True)
def _sums(a, shift):
    """Float64 sums of a segment known to hold only finite values (so fast-math rules are
    exact enough: the sums may be reassociated, which is what lets them run in SIMD lanes):
    about `shift` (d and d*d), of |v|, and of v*v itself (a row's norm from the shifted sums
    would cancel when its values are far below the shift). Alone in their loop: beside the
    integer work of `_keys` the loop vectorised at neither width's best (0.75 ns a value on one
    core, against 0.2 + 0.2 for the two loops, the second over values still in L1)."""
    s = 0.0
    q = 0.0
    b = 0.0
    sq = 0.0
    for i in range(a.size):
        v = np.float64(a[i])
        d = v - shift
        s += d
        q += d * d
        b += abs(v)
        sq += v * v
    return s, q, b, sq


@numba.njit(nogil=True, cache=True, fastmath=True)
def _keys(keys, low_bits):
    """A segment's extremes as order keys, the smallest magnitude as the bits of |v|, and how
    many values are zero (of either sign) and above 0. Integer work at the keys' own width
    (numba widens int32 shifts to int64, so the key is a select, not a shift), the counts as
    floats: lanes of one width vectorise best. NaN and Inf show in the extremes (their keys lie
    at and beyond +-Inf's), which is how `_by_segment` knows to check the segment."""
    lo = same_width(order_key(keys[0], low_bits), low_bits)
    hi = lo
    small = low_bits
    zeros = 0.0
    positive = 0.0
    for i in range(keys.size):
        x = keys[i]
        magnitude = same_width(x & low_bits, low_bits)
        k = same_width(x ^ low_bits, low_bits) if x < 0 else x
        lo = min(lo, k)
        hi = max(hi, k)
        small = min(small, magnitude)
        zeros += 1.0 if magnitude == 0 else 0.0
        positive += 1.0 if x > 0 else 0.0
    return lo, hi, small, int(zeros), int(positive)


@numba.njit(nogil=True, cache=True)
def _moments_checked(a, keys, low_bits, shift):
    """The same over the finite values of a segment that holds NaN or Inf; also counts them.
    Kept apart from `_sums` and `_keys`: under fast-math the compiler may assume no NaN and
    drop these tests, and with them in one loop the fast path would no longer vectorise."""
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
            s, q, b, sq = _sums(y[r, u], shift)
            lo, hi, small, seg_zeros, positive = _keys(keys[r, u], low_bits)
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
