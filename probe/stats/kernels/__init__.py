"""The passes over the data that every statistic comes from, compiled with numba.

A chain of torch or numpy reductions reads an activation a dozen times and allocates as many
temporaries; these passes read each (row, unit) segment twice while it sits in the L1 cache, and
release the GIL so that threads can share a batch. Their disk cache is checked against every module
here (`locator`, installed below first), since a caller holds the passes it calls compiled in.
"""

from probe.stats.kernels import locator

locator.install()
