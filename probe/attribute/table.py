"""attribution.csv: one row per attribution dataset, from the run's statistics alone.

Every attribution site comes with per-sample datasets (probe.attribute.maps): `SITE.sum`, each
sample's total, whose mean and deviation are the columns sum_mean and sum_std; `SITE.units`, each
sample's |attribution| per unit, whose per-unit means rank the units; `ig_output.gap`, the
completeness gap. Their statistics merge exactly over batches, processes and resumes, so the
table needs no stored row and a stats-only run has one too.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from probe.site_keys import ATTRIBUTION_SITES, SiteKey, family_of

TOP = 5  # units named in top_units
COLUMNS = [
    "layer", "site", "module_type", "shape", "n", "mean", "abs_mean", "frac_positive",
    "sum_mean", "sum_std", "top_units", "top_units_abs_mean", "gap_mean", "gap_abs_mean",
    "gap_relative",
]  # fmt: skip


def base_site(site: str) -> str:
    """`gradcam.0@1` -> gradcam: the attribution site a dataset name holds, else ''."""
    family = family_of(site)
    return family if family in ATTRIBUTION_SITES else ""


def is_attribution(site: str) -> bool:
    """Whether a dataset holds an attribution map itself (not a total derived from one)."""
    return bool(base_site(site)) and not SiteKey.parse(site).derived


def positive_fraction(stats) -> float:
    """The share of values above zero, from the histogram's sign bit (exact counts)."""
    if not stats.n or stats.hist is None:
        return math.nan
    return float(stats.hist.counts[1:0x7F80].sum()) / stats.n


def attribution_table(datasets) -> pd.DataFrame:
    """The table of `datasets` (DatasetInfo-like: layer, site, module_type, shape, stats)."""
    by_key = {(d.layer, d.site): d for d in datasets}
    rows = []
    for d in datasets:
        if not is_attribution(d.site):
            continue
        s = d.stats
        row = {
            "layer": d.layer,
            "site": d.site,
            "module_type": d.module_type,
            "shape": "x".join(map(str, d.shape)),
            "n": s.n,
            "mean": s.mean if s.n else math.nan,
            "abs_mean": s.abs_sum / s.n if s.n else math.nan,
            "frac_positive": positive_fraction(s),
        }
        total = by_key.get((d.layer, f"{d.site}.sum"))
        if total is not None and total.stats.n:
            t = total.stats
            row["sum_mean"], row["sum_std"] = t.mean, math.sqrt(max(t.m2, 0) / t.n)
        units = by_key.get((d.layer, f"{d.site}.units"))
        if units is not None and units.stats.units is not None:
            u = units.stats.units
            means = u.sum / np.maximum(u.count, 1)
            top = np.argsort(-means, kind="stable")[:TOP]
            row["top_units"] = " ".join(str(i) for i in top)
            row["top_units_abs_mean"] = " ".join(f"{means[i]:.4g}" for i in top)
        gap = by_key.get((d.layer, f"{d.site}.gap"))
        if gap is not None and gap.stats.n:
            g = gap.stats
            row["gap_mean"], row["gap_abs_mean"] = g.mean, g.abs_sum / g.n
            if total is not None and total.stats.n:
                scale = total.stats.abs_sum / total.stats.n
                row["gap_relative"] = row["gap_abs_mean"] / scale if scale else math.nan
        rows.append(row)
    return pd.DataFrame(rows, columns=COLUMNS)
