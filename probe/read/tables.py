"""The summary and unit tables (pandas), from running statistics however they were obtained: a
finished run's writer, a re-read file, the merged shards of torchrun."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pandas as pd

from probe.stats import stat_columns


def summary_columns() -> list[str]:
    """summary.csv's header: what each row is of, then the statistics (`stat_columns`)."""
    return [*stat_columns.SITE_COLUMNS, *stat_columns.summary_names()]


def integer_columns() -> set[str]:
    """The columns of summary.csv that hold integers."""
    return set(stat_columns.integer_names()) & set(summary_columns())


COLUMNS = summary_columns()
INTEGER_COLUMNS = integer_columns()
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
    return pd.DataFrame(rows, columns=summary_columns())


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
