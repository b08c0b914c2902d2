"""Every statistic, declared once: the running state's slots and the columns of the tables.

A `Slot` is one number of the running state (`RunningStats`): its name, whether it is an
integer, and how two states merge it (`sum`, `min`, `max`, or `moments`: count, mean and M2 by
Chan's formula). `SLOTS` in order is the layout of the state everywhere: the `state` attribute and
the `scalars` record of `/stats` in probe.h5. A batch's accumulator, what each backend reduces a
batch to, is `BATCH` (the slots but `rows`, which its caller knows); in a packed batch (the torch
reference's and the numba passes' float64 vectors) it lies at `PACKED_AT`.

A `Column` is one statistic of the tables: its name, whether it is an integer, what it is derived
from (`source`) and its `value` from a state. summary.csv has the `SITE_COLUMNS`, then
`summary_names()`; train.csv has `step`, the same, then the per-step columns (`norm`):
`step_names()`. Tables read these functions when they build a header, so a column declared here
is a column of each of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

Merge = Literal["sum", "min", "max", "moments"]


@dataclass(frozen=True)
class Slot:
    """One number of the running state: its name, integer or float, how two states merge it,
    and its value before any batch (what merges into anything unchanged)."""

    name: str
    integer: bool
    merge: Merge
    empty: float


SLOTS: tuple[Slot, ...] = (
    Slot("rows", True, "sum", 0),  # rows seen (samples, tokens or batches)
    Slot("n", True, "moments", 0),  # finite values
    Slot("mean", False, "moments", 0.0),
    Slot("m2", False, "moments", 0.0),  # sum of squared deviations from the mean
    Slot("min", False, "min", math.inf),
    Slot("max", False, "max", -math.inf),
    Slot("abs_sum", False, "sum", 0.0),
    Slot("zeros", True, "sum", 0),
    Slot("nan_count", True, "sum", 0),
    Slot("inf_count", True, "sum", 0),
    Slot("l2_sum", False, "sum", 0.0),  # sum over rows of each row's L2 norm (finite values)
)
SCALARS: tuple[str, ...] = tuple(s.name for s in SLOTS)
INTEGER_SCALARS: frozenset[str] = frozenset(s.name for s in SLOTS if s.integer)

BATCH: tuple[Slot, ...] = tuple(s for s in SLOTS if s.name != "rows")
BATCH_NAMES: tuple[str, ...] = tuple(s.name for s in BATCH)
BATCH_AT: dict[str, int] = {name: i for i, name in enumerate(BATCH_NAMES)}
# A packed batch: its units' width, one count of the backend's own (the torch reference: whether
# saturation is tracked; numba: its histogram spans), the BATCH slots, then numba's smallest
# finite magnitude (where its histogram spans start), then the backend's arrays.
PACKED_FIRST = 2
PACKED_AT: dict[str, int] = {name: PACKED_FIRST + i for name, i in BATCH_AT.items()}
SMALLEST_AT = PACKED_FIRST + len(BATCH)
PACKED_HEAD = SMALLEST_AT + 1
_INTEGER_AT = tuple(i for i, s in enumerate(BATCH) if s.integer)


def batch_values(packed: Sequence[float]) -> list[Any]:
    """The BATCH slots of a packed batch (a list of floats), in BATCH order, integers as int."""
    values = list(packed[PACKED_FIRST:SMALLEST_AT])
    for i in _INTEGER_AT:
        values[i] = int(values[i])
    return values


def by_name(values: Sequence[Any]) -> dict[str, Any]:
    """A batch accumulator in BATCH order, by name (RunningStats' keywords)."""
    return dict(zip(BATCH_NAMES, values, strict=True))


Source = Literal["sum", "moments", "min", "max", "histogram", "units"]


@dataclass(frozen=True)
class Column:
    """One statistic of the tables: its name, integer or float, what it is derived from, and its
    value from a state and the state's quantiles (by column name). `source` says how it merges:
    from slots that add up (`sum`), from the `moments`, the extremes, the histogram's counts or the
    per-unit statistics. `quantile` marks a column read off the histogram at that rank;
    `per_step` one of train.csv's alone."""

    name: str
    integer: bool
    source: Source
    value: Callable[[Any, Mapping[str, float]], float]
    quantile: float | None = None
    per_step: bool = False


def _quantile(name: str) -> Callable[[Any, Mapping[str, float]], float]:
    return lambda s, q: q[name]


def _units(s: Any) -> bool:
    return s.units is not None and len(s.units.count) > 0


def _saturated_frac(s: Any, q: Mapping[str, float]) -> float:
    saturated = s.units.saturated_units() if _units(s) else None
    return math.nan if saturated is None else float(saturated.mean())


def _frac_zero(s: Any, q: Mapping[str, float]) -> float:
    total = s.n + s.nan_count + s.inf_count
    return s.zeros / total if total else math.nan


def _norm(s: Any, q: Mapping[str, float]) -> float:
    """The L2 norm of the finite values (sqrt of m2 + n mean^2, their sum of squares)."""
    n = s.n
    return math.sqrt(max(s.m2 + n * s.mean * s.mean, 0.0)) if n else math.nan


def _std(s: Any, q: Mapping[str, float]) -> float:
    return math.sqrt(max(s.m2, 0.0) / s.n) if s.n else math.nan


def _rms(s: Any, q: Mapping[str, float]) -> float:
    return math.sqrt((s.m2 + s.n * s.mean**2) / s.n) if s.n else math.nan


def _dead_frac(s: Any, q: Mapping[str, float]) -> float:
    """The fraction of units never above zero (of those that saw a finite value)."""
    return float(s.units.dead().mean()) if _units(s) else math.nan


COLUMNS: tuple[Column, ...] = (
    Column("rows", True, "sum", lambda s, q: s.rows),
    Column("n", True, "moments", lambda s, q: s.n),
    Column("mean", False, "moments", lambda s, q: s.mean if s.n else math.nan),
    Column("std", False, "moments", _std),
    Column("min", False, "min", lambda s, q: s.min if s.n else math.nan),
    Column("max", False, "max", lambda s, q: s.max if s.n else math.nan),
    Column("abs_mean", False, "sum", lambda s, q: s.abs_sum / s.n if s.n else math.nan),
    Column("rms", False, "moments", _rms),
    Column("frac_zero", False, "sum", _frac_zero),
    Column("nan_count", True, "sum", lambda s, q: s.nan_count),
    Column("inf_count", True, "sum", lambda s, q: s.inf_count),
    Column("l2_mean", False, "sum", lambda s, q: s.l2_sum / s.rows if s.rows else math.nan),
    Column("p01", False, "histogram", _quantile("p01"), 0.01),
    Column("p50", False, "histogram", _quantile("p50"), 0.5),
    Column("p99", False, "histogram", _quantile("p99"), 0.99),
    Column("units", True, "units", lambda s, q: len(s.units.count) if _units(s) else 0),
    Column("dead_frac", False, "units", _dead_frac),
    Column("saturated_frac", False, "units", _saturated_frac),
    Column("norm", False, "moments", _norm, per_step=True),
)
SITE_COLUMNS: tuple[str, ...] = ("layer", "site", "module_type", "shape", "dtype")


def summary_columns() -> list[Column]:
    """summary.csv's statistics (after SITE_COLUMNS), in order."""
    return [c for c in COLUMNS if not c.per_step]


def step_columns() -> list[Column]:
    """train.csv's statistics (after `step` and SITE_COLUMNS): summary.csv's, then the per-step
    ones."""
    return summary_columns() + [c for c in COLUMNS if c.per_step]


def summary_names() -> list[str]:
    return [c.name for c in summary_columns()]


def step_names() -> list[str]:
    return [c.name for c in step_columns()]


def integer_names() -> list[str]:
    """The integer columns of either table, in declaration order."""
    return [c.name for c in COLUMNS if c.integer]


def quantiles() -> dict[str, float]:
    """The columns read off the histogram, by name: the rank each is taken at."""
    return {c.name: c.quantile for c in COLUMNS if c.quantile is not None}


def values(state: Any, columns: Sequence[Column]) -> dict[str, float]:
    """Each of `columns` of a running state (a `RunningStats`), the histogram's quantiles taken
    once (NaN without a histogram)."""
    ranks = {c.name: c.quantile for c in columns if c.quantile is not None}
    q: dict[str, float] = {}
    if ranks:
        hist = state.hist
        found = hist.quantiles(list(ranks.values()), state.min, state.max) if hist else None
        q = dict(zip(ranks, found or [math.nan] * len(ranks), strict=True))
    return {c.name: c.value(state, q) for c in columns}
