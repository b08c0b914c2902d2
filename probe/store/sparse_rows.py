"""An SAE's latents stored sparse: per row the active latents, largest first, in a fixed number
of slots (`sae.latents.index`, -1 where empty, and `sae.latents.value`), and the dense rows they
stand for (what statistics recomputed from stored rows, and readers, see)."""

from __future__ import annotations

import h5py
import numpy as np

from probe.store.fileformat import layer_path

INDEX, VALUE = "sae.latents.index", "sae.latents.value"


def dense_latents(index: np.ndarray, value: np.ndarray, d_sae: int, axis: int = -1) -> np.ndarray:
    """The float32 latents, d_sae on `axis`, of stored slots (their places on that axis)."""
    index, value = np.moveaxis(index, axis, -1), np.moveaxis(value, axis, -1)
    out = np.zeros((*index.shape[:-1], d_sae), np.float32)
    flat, at, v = (
        out.reshape(-1, d_sae),
        index.reshape(-1, index.shape[-1]),
        value.reshape(-1, value.shape[-1]),
    )
    rows, slots = np.nonzero(at >= 0)
    flat[rows, at[rows, slots]] = v[rows, slots]
    return np.moveaxis(out, -1, axis)


class SparseRows:
    """Stored slots read as dense rows by slices of rows: `len`, `shape`, `dtype`, `[lo:hi]`."""

    def __init__(self, index: h5py.Dataset, value: h5py.Dataset):
        self.index, self.value = index, value
        self.d_sae, self.axis = int(index.attrs["d_sae"]), int(index.attrs["unit_axis"])

    def __len__(self) -> int:
        return len(self.index)

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.index.shape)
        shape[self.axis] = self.d_sae
        return tuple(shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.float32)

    def __getitem__(self, rows: slice) -> np.ndarray:
        return dense_latents(self.index[rows], self.value[rows], self.d_sae, self.axis)


def stored_rows(f: h5py.File, layer: str, site: str):
    """The dataset of (layer, site), or for latents stored sparse their SparseRows, or None."""
    ds = f.get(layer_path(layer, site))
    if ds is None and site == "sae.latents" and layer_path(layer, INDEX) in f:
        return SparseRows(f[layer_path(layer, INDEX)], f[layer_path(layer, VALUE)])
    return ds
