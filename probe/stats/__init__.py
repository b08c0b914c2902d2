"""Statistics: running statistics with exact merges, top-k examples per unit, and the backends
that reduce a batch (torch on any device; compiled numba passes on the CPU)."""
