"""Attributes and small datasets of HDF5 objects just created, in the fewest HDF5 calls.

h5py's `attrs[name] = value` first asks whether the attribute exists (to replace it), and
`create_dataset` walks every storage option; for the /stats of a run, written at its close, those
steps cost more than the objects themselves. Values are converted the way h5py converts them (a
str as a variable-length UTF-8 string, a bool as h5py's enum), so readers see no difference.
"""

from __future__ import annotations

import h5py
import numpy as np
from h5py import h5a, h5d, h5p, h5s, h5t

TEXT = h5py.string_dtype()


def _array(value) -> np.ndarray:
    return np.asarray(value, dtype=TEXT if isinstance(value, str) else None, order="C")


def _space(a: np.ndarray):
    return h5s.create_simple(a.shape) if a.ndim else h5s.create(h5s.SCALAR)


def add_attrs(obj: h5py.HLObject, values: dict) -> None:
    """Attributes of `obj`, none of which exists yet."""
    for name, value in values.items():
        a = _array(value)
        attr = h5a.create(obj.id, name.encode(), h5t.py_create(a.dtype, logical=True), _space(a))
        try:
            attr.write(a, mtype=h5t.py_create(a.dtype))
        finally:
            attr.close()


def add_dataset(group: h5py.Group, name: str, a: np.ndarray) -> None:
    """A contiguous dataset holding `a`, which `group` does not hold yet."""
    a = np.ascontiguousarray(a)
    dcpl = h5p.create(h5p.DATASET_CREATE)
    dcpl.set_obj_track_times(False)  # as h5py creates them: files of equal content are equal
    tid = h5t.py_create(a.dtype, logical=True)
    ds = h5d.create(group.id, name.encode(), tid, _space(a), dcpl=dcpl)
    try:
        if a.size:
            ds.write(h5s.ALL, h5s.ALL, a)
    finally:
        ds.close()
