"""An SAE's latents stored sparse (`sae.latents.index` and `sae.latents.value`: per row the
active latents, largest first, in a fixed number of slots) read back as dense rows, so
`run.array(layer, "sae.latents")` reads the same whichever way they were stored."""

from __future__ import annotations

import numpy as np

from probe.read.lazy import LazyArray
from probe.store.sparse_rows import dense_latents


class SparseLatents(LazyArray):
    """Rows [0, valid) of stored slots, as float32 latents with d_sae on the unit axis."""

    def __init__(self, index, value, valid: int):
        super().__init__(index, valid)
        self.indices, self.values = LazyArray(index, valid), LazyArray(value, valid)
        self.d_sae, self.axis = int(index.attrs["d_sae"]), int(index.attrs["unit_axis"])

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(super().shape)
        shape[self.axis] = self.d_sae
        return tuple(shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.float32)

    def __getitem__(self, key):
        first, rest = (key[0], key[1:]) if isinstance(key, tuple) else (key, ())
        if first is Ellipsis:  # (the rest counts from the last axis: read every row first)
            return self[:][key]
        index, value = self.indices[first], self.values[first]
        one_row = index.ndim < self.ds.ndim
        dense = dense_latents(index, value, self.d_sae, self.axis - one_row)
        every_row = (slice(None), *rest)  # (a name: mypy takes x[(a, *b)] for x[a, *b])
        return dense[rest] if one_row else dense[every_row]
