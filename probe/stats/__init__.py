"""Stage 3, stats: running statistics with exact merges, and the backends that reduce a batch
(torch on any device; compiled numba passes on the CPU)."""
