"""A pass's running state in the run's file (a circuit's score sums), saved after every batch
of the pass and read back when a stopped run resumes; dropped once the pass's result is written.

`/passes/<name>` holds the state as of its last save in a group of its own (arrays as datasets,
numbers and strings as attributes); a save writes the new state beside the old one and flushes
it, then points the root's `current` at it and flushes again, then removes the old one: a kill
leaves one whole state, the old or the new. Only a stopped run's file holds `/passes`.
"""

from __future__ import annotations

from collections.abc import Mapping

import h5py
import numpy as np

ROOT = "passes"
# a saved state's value: an array (a dataset), or an attribute's number or string (a bool: an int)
Value = np.ndarray | str | int | float


class PassState:
    """The state of the pass `name` in an open, writable h5py file."""

    def __init__(self, file: h5py.File, name: str) -> None:
        self.file, self.path = file, f"{ROOT}/{name}"

    def load(self) -> dict[str, Value] | None:
        """The last saved state (arrays and the attributes' values by name), None when the file
        holds none."""
        root = self.file.get(self.path)
        if root is None or "current" not in root.attrs:
            return None
        g = root.get(f"s{int(root.attrs['current'])}")
        if g is None:
            return None
        state: dict[str, Value] = {k: _plain(v) for k, v in g.attrs.items()}
        state.update({k: ds[()] for k, ds in g.items()})
        return state

    def save(self, state: Mapping[str, object]) -> None:
        """`state` (numpy arrays become datasets, numbers and strings attributes) as the pass's
        state, whole before it replaces the last one."""
        root = self.file.require_group(self.path)
        old = int(root.attrs.get("current", -1))
        g = root.create_group(f"s{old + 1}")
        for k, v in state.items():
            if isinstance(v, np.ndarray) and v.ndim > 0:
                g.create_dataset(k, data=v)
            else:
                g.attrs[k] = v
        self.file.flush()
        root.attrs["current"] = old + 1
        self.file.flush()
        if f"s{old}" in root:
            del root[f"s{old}"]

    def drop(self) -> None:
        """The state removed (the pass wrote its result), with `/passes` once it is empty."""
        if self.path in self.file:
            del self.file[self.path]
        if ROOT in self.file and not len(self.file[ROOT]):
            del self.file[ROOT]
        self.file.flush()


def _plain(value):
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.generic):
        return value.item()
    return value
