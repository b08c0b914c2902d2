"""The summary and unit tables (pandas), from running statistics however they were obtained: a
finished run's writer, a re-read file, the merged shards of torchrun."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
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
    "p01",
    "p50",
    "p99",
    "units",
    "dead_frac",
    "saturated_frac",
]
INTEGER_COLUMNS = {"rows", "n", "nan_count", "inf_count", "units"}
UNIT_COLUMNS = ["layer", "site", "unit", "count", "mean", "min", "max", "frac_positive", "dead"]


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


def units_frame(datasets: Iterable) -> pd.DataFrame:
    """One row per unit (axis 1) of every (layer, site) that has units."""
    frames = []
    for info in datasets:
        u = info.stats.units
        if u is None:
            continue
        count = u.count
        with np.errstate(invalid="ignore", divide="ignore"):
            frame = pd.DataFrame(
                {
                    "layer": info.layer,
                    "site": info.site,
                    "unit": np.arange(len(count)),
                    "count": count,
                    "mean": u.sum / count,
                    "min": u.min,
                    "max": u.max,
                    "frac_positive": u.positive / count,
                    "dead": u.dead(),
                }
            )
        sat = u.saturated_units()
        if sat is not None:
            frame["saturated"] = sat
        frames.append(frame)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=UNIT_COLUMNS)
