"""Attributes and small datasets of HDF5 objects just created, in the fewest HDF5 calls.

h5py's `attrs[name] = value` first asks whether the attribute exists (to replace it), and
`create_dataset` walks every storage option; for the /stats of a run, written at its close, those
steps cost more than the objects themselves. Values are converted the way h5py converts them (a
str as a variable-length UTF-8 string, a bool as h5py's enum), so readers see no difference.
"""

from __future__ import annotations

from functools import lru_cache

import h5py
import numpy as np
from h5py import h5a, h5d, h5p, h5s, h5t

TEXT = h5py.string_dtype()


def _array(value) -> np.ndarray:
    return np.asarray(value, dtype=TEXT if isinstance(value, str) else None, order="C")


def _types(dtype: np.dtype) -> tuple:
    """(type in the file, type in memory) of `dtype`; HDF5 copies a type it is given, so the
    same two serve every object (each costs microseconds to build). Keyed with the metadata too:
    numpy's object dtypes compare equal whatever string encoding h5py marks on them."""
    return _types_of(dtype, repr(dtype.metadata))


@lru_cache(maxsize=64)
def _types_of(dtype: np.dtype, _metadata: str) -> tuple:
    return h5t.py_create(dtype, logical=True), h5t.py_create(dtype)


@lru_cache(maxsize=256)
def _space(shape: tuple[int, ...]):
    return h5s.create_simple(shape) if shape else h5s.create(h5s.SCALAR)


def _track_nothing():
    dcpl = h5p.create(h5p.DATASET_CREATE)
    dcpl.set_obj_track_times(False)  # as h5py creates them: files of equal content are equal
    return dcpl


DCPL = _track_nothing()


def add_attrs(obj: h5py.HLObject, values: dict) -> None:
    """Attributes of `obj`, none of which exists yet."""
    for name, value in values.items():
        a = _array(value)
        stored, held = _types(a.dtype)
        attr = h5a.create(obj.id, name.encode(), stored, _space(a.shape))
        try:
            attr.write(a, mtype=held)
        finally:
            attr.close()


def add_dataset(group: h5py.Group, name: str, a: np.ndarray) -> None:
    """A contiguous dataset holding `a`, which `group` does not hold yet."""
    a = np.ascontiguousarray(a)
    ds = h5d.create(group.id, name.encode(), _types(a.dtype)[0], _space(a.shape), dcpl=DCPL)
    try:
        if a.size:
            ds.write(h5s.ALL, h5s.ALL, a)
    finally:
        ds.close()
