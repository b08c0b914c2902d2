"""The one pass over the data that every statistic comes from, compiled with numba.

A chain of vectorised torch or numpy reductions reads an activation a dozen times (sums, squares,
extremes, signs, a histogram); this loop reads it once, in float64, and releases the GIL so that the
writer thread runs beside the forward pass. Compiled code is cached on disk after the first call.
"""

from __future__ import annotations

import numba
import numpy as np

EXPONENT = 0x7F800000  # float32 exponent bits: all set for Inf and NaN
MAGNITUDE = 0x7FFFFFFF
SIGN = 0x80000000


@numba.njit(nogil=True, cache=True)
def reduce_segments(y, bits, shift, counts, sums, lows, highs, tallies):
    """Fold y (rows, units, size) into per-(row, unit) results, over finite values only:

    sums[r, u] = (sum of v - shift, sum of (v - shift)**2, sum of |v|) in float64;
    lows/highs[r, u] = min/max (+inf/-inf when none); tallies[r, u] = (finite, zeros, positive,
    nan, inf) counts. `bits` are the float32 bit patterns of y (y itself when y is float32), whose
    top 16 bits index `counts`, the running histogram, for every value including NaN and Inf."""
    rows, units, size = y.shape
    for r in range(rows):
        for u in range(units):
            a = y[r, u]
            w = bits[r, u]
            s0 = 0.0
            s1 = 0.0
            q0 = 0.0
            q1 = 0.0
            b0 = 0.0
            b1 = 0.0
            lo0 = np.inf
            lo1 = np.inf
            hi0 = -np.inf
            hi1 = -np.inf
            zeros = 0
            positive = 0
            nans = 0
            infs = 0
            i = 0
            while i < size:
                x0 = np.int64(w[i])
                counts[x0 >> 16] += 1
                m0 = x0 & MAGNITUDE
                if m0 >= EXPONENT:
                    if m0 == EXPONENT:
                        infs += 1
                    else:
                        nans += 1
                else:
                    v0 = np.float64(a[i])
                    zeros += m0 == 0
                    positive += (m0 != 0) & (x0 < SIGN)
                    d0 = v0 - shift
                    s0 += d0
                    q0 += d0 * d0
                    b0 += abs(v0)
                    lo0 = min(lo0, v0)
                    hi0 = max(hi0, v0)
                if i + 1 < size:
                    x1 = np.int64(w[i + 1])
                    counts[x1 >> 16] += 1
                    m1 = x1 & MAGNITUDE
                    if m1 >= EXPONENT:
                        if m1 == EXPONENT:
                            infs += 1
                        else:
                            nans += 1
                    else:
                        v1 = np.float64(a[i + 1])
                        zeros += m1 == 0
                        positive += (m1 != 0) & (x1 < SIGN)
                        d1 = v1 - shift
                        s1 += d1
                        q1 += d1 * d1
                        b1 += abs(v1)
                        lo1 = min(lo1, v1)
                        hi1 = max(hi1, v1)
                i += 2
            sums[r, u, 0] = s0 + s1
            sums[r, u, 1] = q0 + q1
            sums[r, u, 2] = b0 + b1
            lows[r, u] = min(lo0, lo1)
            highs[r, u] = max(hi0, hi1)
            tallies[r, u, 0] = size - nans - infs
            tallies[r, u, 1] = zeros
            tallies[r, u, 2] = positive
            tallies[r, u, 3] = nans
            tallies[r, u, 4] = infs
