"""A batch's result from its parts' `rows.reduce_rows`: `combine` merges them (Chan's formula,
the extremes' keys turned back into values), `finish` packs that and the histogram's occupied
spans into one float64 array (after a convolution each array handed back to Python costs
microseconds), and `fold_packed` adds such an array into running statistics in place.
"""

from __future__ import annotations

import numba
import numpy as np

from probe.stats.kernels.histogram import span_heads, take_spans
from probe.stats.kernels.keys import order_key
from probe.stats.stat_columns import BATCH_AT, PACKED_FIRST, PACKED_HEAD, SMALLEST_AT

# Where `combine`'s scalars hold each slot of the batch accumulator (`stat_columns.BATCH`; numba
# compiles these in: `locator` stamps the kernels' cache with the declaration too)
_N, _MEAN, _M2 = BATCH_AT["n"], BATCH_AT["mean"], BATCH_AT["m2"]
_MIN, _MAX, _ABS = BATCH_AT["min"], BATCH_AT["max"], BATCH_AT["abs_sum"]
_ZEROS, _NANS, _INFS = BATCH_AT["zeros"], BATCH_AT["nan_count"], BATCH_AT["inf_count"]
_L2, _SMALLEST = BATCH_AT["l2_sum"], SMALLEST_AT - PACKED_FIRST
_SCALARS = PACKED_HEAD - PACKED_FIRST  # the accumulator, then the smallest finite |v|


@numba.njit(nogil=True, cache=True)
def combine(moments, tallies, units, extremes, low_bits, keys, values):
    """One batch's statistics from its parts' `reduce_rows` results (stacked on axis 0): Chan's
    merge of (count, mean, M2), sums of the rest, and the extremes' order keys turned back into
    values (of `values`' dtype, `keys` being their integer view). Returns scalars (the batch
    accumulator in `stat_columns.BATCH` order, then the smallest finite |v|) and per unit
    (count, sum, min, max, count above 0); a unit without a finite value has min +Inf and max
    -Inf."""
    parts, _, width = units.shape
    n = 0.0
    mean = 0.0
    m2 = 0.0
    scalars = np.zeros(_SCALARS)
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
        scalars[_ABS] += moments[p, 2]
        scalars[_ZEROS] += tallies[p, 1]
        scalars[_NANS] += tallies[p, 2]
        scalars[_INFS] += tallies[p, 3]
        scalars[_L2] += moments[p, 3]
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
    scalars[_MIN] = np.inf
    scalars[_MAX] = -np.inf
    for u in range(width):
        if count[u] == 0:
            lows[u] = np.inf
            highs[u] = -np.inf
        scalars[_MIN] = min(scalars[_MIN], lows[u])
        scalars[_MAX] = max(scalars[_MAX], highs[u])
    scalars[_N] = n
    scalars[_MEAN] = mean
    scalars[_M2] = m2
    scalars[_SMALLEST] = smallest.view(values.dtype)[0] if n > 0 else np.inf
    return scalars, count, sums, lows, highs, positive


@numba.njit(nogil=True, cache=True)
def finish(moments, tallies, units, extremes, low_bits, keys, values, lanes, spans):
    """A batch's result from its parts' `reduce_rows`, packed into one float64 array (after a
    convolution each array handed back to Python costs microseconds): the units' width w and
    the number k of histogram spans, `combine`'s scalars (`stat_columns.PACKED_AT`), its count, sums, lows, highs and
    positive (w each), then with `spans` the (first bucket, length) of each span and the counts
    its finite values left in the lanes (`take_spans`; all exact below 2**53). The buckets of
    NaN and Inf are cleared first when there were any (or the values are float64, whose values
    beyond float32's range count there): they never hold a finite value."""
    scalars, count, sums, lows, highs, positive = combine(
        moments, tallies, units, extremes, low_bits, keys, values
    )
    if scalars[_NANS] > 0 or scalars[_INFS] > 0 or values.itemsize == 8:
        for lane in lanes:
            lane[0x7F80:0x8000] = 0
            lane[0xFF80:] = 0
    if spans and scalars[_N] > 0:
        heads = span_heads(scalars[_MIN], scalars[_MAX], scalars[_SMALLEST])
    else:
        heads = np.empty((0, 2), np.int64)
    width, k = count.size, heads.shape[0]
    packed = np.zeros(PACKED_HEAD + 5 * width + 2 * k + heads[:, 1].sum())
    packed[0], packed[1] = width, k
    packed[PACKED_FIRST:PACKED_HEAD] = scalars
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
