"""Rows of a stored dataset read on demand, only the valid ones (a run cut short or still being
written has allocated more)."""

from __future__ import annotations

import h5py
import numpy as np


class LazyArray:
    """Rows [0, valid) of an HDF5 dataset; indexing reads only what it selects."""

    def __init__(self, ds: h5py.Dataset, valid: int):
        self.ds, self.valid = ds, min(valid, len(ds))

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.valid, *self.ds.shape[1:])

    @property
    def dtype(self) -> np.dtype:
        return self.ds.dtype

    def __len__(self) -> int:
        return self.valid

    def __array__(self, dtype=None, copy=None):
        a = self[:]
        return a if dtype is None else a.astype(dtype)

    def __getitem__(self, key):
        first, rest = (key[0], key[1:]) if isinstance(key, tuple) else (key, ())
        if first is Ellipsis:
            first, rest = slice(None), (Ellipsis, *rest)
        if isinstance(first, slice):
            first = slice(*first.indices(self.valid))
            if first.step < 0:  # h5py reads increasing rows only
                every_row = (slice(None), *rest)  # (a name: mypy takes x[(a, *b)] for x[a, *b])
                return self[every_row][key[0] if isinstance(key, tuple) else key]
        elif isinstance(first, (int, np.integer)):
            if not -self.valid <= first < self.valid:
                raise IndexError(f"row {first} is outside the {self.valid} valid rows")
            first = int(first) % self.valid
        else:
            rows = np.asarray(first)
            if rows.size and (rows.max() >= self.valid or rows.min() < 0):
                raise IndexError(f"rows {rows} reach outside the {self.valid} valid rows")
            first = rows
        index = (first, *rest)
        return self.ds[index]
