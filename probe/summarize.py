"""Per-layer statistic tables from a run's streaming statistics."""

from __future__ import annotations

from collections.abc import Iterable

import pandas as pd

COLUMNS = [
    "layer",
    "site",
    "module_type",
    "shape",
    "dtype",
    "rows",
    "n",
    "mean",
    "std",
    "min",
    "max",
    "abs_mean",
    "rms",
    "frac_zero",
    "nan_count",
    "inf_count",
    "l2_mean",
]


def summary_frame(datasets: Iterable) -> pd.DataFrame:
    """One row per (layer, site) from DatasetInfo-like objects holding `.stats`."""
    rows = []
    for info in datasets:
        row = {
            "layer": info.layer,
            "site": info.site,
            "module_type": info.module_type,
            "shape": "x".join(map(str, info.shape)),
            "dtype": info.dtype,
        }
        row.update(info.stats.as_row())
        rows.append(row)
    return pd.DataFrame(rows, columns=COLUMNS)
