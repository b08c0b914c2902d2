"""Attributes and datasets made by probe.store.h5fresh read back as h5py's own would."""

from __future__ import annotations

import h5py
import numpy as np
from h5py import h5t

from probe.store.h5fresh import add_attrs, add_dataset

VALUES = {
    "order": 3,
    "module_type": "Conv2d",
    "per_batch": False,
    "state": np.linspace(0.0, 1.0, 11),
    "shape": [64, 56, 56],
    "dtype": "float32",
    "empty": "",
    "ascii": np.array(["a", "b"], dtype=h5py.string_dtype("ascii")),  # after the UTF-8 ones
}
ARRAYS = {
    "hist": np.arange(12, dtype=np.int64).reshape(2, 6),
    "units": np.random.default_rng(0).standard_normal((5, 7)),
    "none": np.empty((2, 0), np.int64),
}


def stored(obj) -> tuple:
    """An attribute's or dataset's HDF5 type with a string's encoding: numpy's dtypes (and
    HDF5's type equality) do not tell UTF-8 from ASCII apart."""
    t = obj.get_type()
    return t, t.get_cset() if t.get_class() == h5t.STRING else None


def test_fresh_attributes_and_datasets_read_back_as_h5pys(tmp_path):
    with h5py.File(tmp_path / "f.h5", "w") as f:
        ours, theirs = f.create_group("ours"), f.create_group("theirs")
        add_attrs(ours, VALUES)
        for name, a in ARRAYS.items():
            add_dataset(ours, name, a)
        for name, v in VALUES.items():
            theirs.attrs[name] = v
        for name, a in ARRAYS.items():
            theirs.create_dataset(name, data=a)
    with h5py.File(tmp_path / "f.h5", "r") as f:
        ours, theirs = f["ours"], f["theirs"]
        for name in VALUES:
            a, b = ours.attrs[name], theirs.attrs[name]
            assert type(a) is type(b) and np.array_equal(a, b), name
            assert stored(ours.attrs.get_id(name)) == stored(theirs.attrs.get_id(name)), name
        for name in ARRAYS:
            a, b = ours[name], theirs[name]
            assert (a.dtype, a.shape, a.chunks) == (b.dtype, b.shape, b.chunks), name
            assert stored(a.id) == stored(b.id), name
            assert np.array_equal(a[()], b[()]), name
