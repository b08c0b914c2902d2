"""`reduce_rows`: a range of a batch's rows into one partial result, the share of one thread
whether on torch's team (`gomp`) or on threads of our own (`probe.stats.numba_backend`). It picks
the pass by the segments' length (`segments` or `columns`), takes each unit's sums about a value
of that unit (`first_finite`), so 1000 +- 0.01 keeps its variance, and merges the units' moments
with Chan's formula.
"""

from __future__ import annotations

import numba
import numpy as np

from probe.stats.kernels.columns import _by_column
from probe.stats.kernels.segments import _by_segment

# Segments shorter than NARROW are reduced column by column (`_by_column`) when a row has at
# least NARROW_UNITS units and there are at least an eighth as many rows as values in a segment
# (the columns' scratch is set up and folded once per call); single values always are. Measured
# on one thread: 8 rows of 49 values 1.10 against 1.30 ns per value, 64 rows of 100 0.82 against
# 0.98; 4 rows of 49 1.40 against 1.30.
NARROW = 128
NARROW_UNITS = 4


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
    """Fold y (rows, units, size) into one partial result, over finite values only: `moments`
    (mean, M2, sum of |v|, sum over rows of the row's L2 norm), `tallies` (finite, zeros, NaN, Inf
    counts, the bits of the smallest finite |v| or `low_bits`), per unit `units` (finite count, sum,
    count above 0) and `extremes` (order keys of min and max). `counts` is indexed by the top 16
    bits of `bits` (y's float32 bit patterns); `keys` is y as signed integers of its own width,
    `infinite` the key of +Inf. Each unit's sums are taken about a value of it (see the module)."""
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
