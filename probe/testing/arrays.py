"""A run file's contents as plain arrays by name, to compare two files value for value (a killed
and resumed run against a whole one, two processes' files)."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np

from probe.stats.running import SCALARS, occupied
from probe.store import stats_file
from probe.store.fileformat import is_scale
from probe.store.runfile import open_probe_file


def file_arrays(f: h5py.File) -> dict:
    """Every captured or per-sample dataset of an open run file by its path (virtual ones read
    through their sources), and its statistics decoded from /stats (the slot layout, which
    depends on how many flushes wrote it, is left out), under stats/<layer>/<site>/..."""
    arrays = {}

    def take(name, obj):
        plain = name == "sample" or not is_scale(obj)
        own_slots = name[:6] in ("stats/", "topk/")  # (decoded below: which slot is the file's)
        if isinstance(obj, h5py.Dataset) and plain and name != "progress" and not own_slots:
            arrays[name] = obj[()]

    f.visititems(take)
    for (layer, site), info in stats_file.read(f).items():
        s, at = info.stats, f"stats/{layer}/{site}"
        arrays[f"{at}/scalars"] = np.array([getattr(s, k) for k in SCALARS], dtype=np.float64)
        assert s.hist is not None  # statistics read back from a file hold their histogram
        arrays[f"{at}/hist"] = occupied(s.whole_histogram().counts, False)
        if s.units is not None:
            arrays[f"{at}/units"] = s.units.packed()
        for kind, (values, keys) in (info.topk.kinds if info.topk is not None else {}).items():
            arrays[f"topk/{layer}/{site}/{kind}"] = np.stack([values, keys.astype(np.float64)])
    return arrays


def h5_arrays(path: Path) -> dict:
    """`file_arrays` of the run file at `path`."""
    with open_probe_file(path, ours_only=False) as f:
        return file_arrays(f)
