"""The passes over the data that every statistic comes from, compiled with numba.

A chain of torch or numpy reductions reads an activation a dozen times (sums, squares, extremes,
signs, a histogram) and allocates as many temporaries; here each (row, unit) segment is read twice
while it sits in the L1 cache (`segments`): a vectorised pass for the moments, in float64, and the
extremes, as integer order keys (`keys`), then a scalar pass for the histogram (`histogram`, over
two arrays when the segment is mostly zeros). Extremes beyond +-Inf's keys mean the segment holds
NaN or Inf, and only then is it read a third time, checking every value. Segments of fewer than
`rows.NARROW` values (a linear layer's outputs are segments of one) are reduced a row at a time
across their columns instead (`columns`: a row's piece is read for its largest magnitude, then its
moments, then its histogram), and rows of a single value all as one segment; `rows.reduce_rows`
picks the pass for a part of a batch. The functions release the GIL, so several threads can share
a batch. `packing.finish` merges a batch's parts and copies out its histogram, and
`gomp.team_batch` does a whole batch on torch's threads, in one call each: in a hook, with the
caches just emptied by a convolution, each of the dozen Python-level steps they replace took tens
of us.

Compiled code is cached on disk after the first call, checked against the contents of every
module here (`locator`, installed below before any module compiles): the callers of these passes
(`probe.stats.team`'s entry points among them) are in this package too, so a change here never
leaves a stale copy of a pass compiled into a caller cached elsewhere.
"""

from probe.stats.kernels import locator

locator.install()
