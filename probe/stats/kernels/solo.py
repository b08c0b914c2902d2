"""A whole float32 batch on the calling thread in one call from Python (`solo_batch`): what
`gomp.team_batch` does on torch's team, for a batch that is not split (one torch thread, as a
training watched on one core has). Each Python-level step around a pass costs microseconds, more
after a convolution has emptied the caches, and a watched step reduces about 170 values.
"""

from __future__ import annotations

import numba
import numpy as np

from probe.stats.kernels.packing import finish
from probe.stats.kernels.rows import reduce_rows


@numba.njit(nogil=True, cache=True)
def solo_batch(y, counts, spans):
    """`finish` of y (rows, units, rest; C-contiguous float32, not empty) reduced in one part
    on this thread, its histogram counted into `counts` (one lane, zero on entry and left zero
    wherever `finish` takes the batch's spans out: `spans`)."""
    width = y.shape[1]
    moments = np.empty((1, 4))
    tallies = np.empty((1, 5), np.int64)
    units = np.empty((1, 3, width))
    extremes = np.empty((1, 2, width), np.int64)
    low_bits = np.int32(0x7FFFFFFF)
    infinite = np.int32(0x7F800000)  # +Inf's key
    keys = y.view(np.int32)
    reduce_rows(y, y.view(np.uint32), keys, low_bits, infinite, counts,
                moments[0], tallies[0], units[0], extremes[0])  # fmt: skip
    lanes = counts.reshape((1, counts.size))
    return finish(moments, tallies, units, extremes, low_bits, keys, y, lanes, spans)
