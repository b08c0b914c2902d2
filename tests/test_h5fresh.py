"""Attributes and datasets made by probe.h5fresh read back as h5py's own would."""

from __future__ import annotations

import h5py
import numpy as np

from probe.h5fresh import add_attrs, add_dataset

VALUES = {
    "order": 3,
    "module_type": "Conv2d",
    "per_batch": False,
    "state": np.linspace(0.0, 1.0, 11),
    "shape": [64, 56, 56],
    "dtype": "float32",
    "empty": "",
}
ARRAYS = {
    "hist": np.arange(12, dtype=np.int64).reshape(2, 6),
    "units": np.random.default_rng(0).standard_normal((5, 7)),
    "none": np.empty((2, 0), np.int64),
}


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
            assert ours.attrs.get_id(name).dtype == theirs.attrs.get_id(name).dtype, name
        for name in ARRAYS:
            a, b = ours[name], theirs[name]
            assert (a.dtype, a.shape, a.chunks) == (b.dtype, b.shape, b.chunks), name
            assert np.array_equal(a[()], b[()]), name
