"""Dataset-wide examples per unit, streamed: the K largest values (`stats.topk`), the K smallest
(`stats.bottomk`) and a seeded sample of the active rows for quantile groups
(`stats.topk_quantiles`), each with its row, in O(units x K) memory.

A row is a key, `sample * 2**20 + position` (the position within the sample: a token, a map's
flattened pixel; 0 for one row a sample), so ties break by (value desc, key asc) whatever the
batch order, process count or resumes. Each batch is reduced on its tensor's device to its own
K per unit, exactly (the threshold value, then the tied rows with the smallest keys), and the
writer merges those into the run's K by sorting at most 2K per unit. The sample keeps the active
rows (value > 0) with the smallest hash of (key, unit, seed): a uniform sample whose merge is
the same selection, so it is exact and order-free too; its rows are split into equal-count
groups by rank when read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from probe.hooks.batch_topk import POSITION_BITS, TopKSpec, priority  # noqa: F401

KINDS = ("top", "bottom", "sample")


@dataclass
class TopKState:
    """A site's kept rows: per kind, values (units, n) float64 and keys (units, n) int64, best
    first; merged exactly with another state or a batch's partial."""

    spec: TopKSpec
    kinds: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def merge(self, other: dict[str, tuple]) -> None:
        for kind, (values, keys) in other.items():
            values = np.asarray(values, np.float64)
            keys = np.asarray(keys, np.int64)
            if kind in self.kinds:
                held_values, held_keys = self.kinds[kind]
                values = np.concatenate([held_values, values], 1)
                keys = np.concatenate([held_keys, keys], 1)
            self.kinds[kind] = best(kind, values, keys, self.spec)

    @property
    def units(self) -> int:
        return next(iter(self.kinds.values()))[0].shape[0] if self.kinds else 0


def best(kind: str, values: np.ndarray, keys: np.ndarray, spec: TopKSpec):
    """The kind's best n per unit of candidates (units, m), by (score desc, key asc); empty
    slots (key -1) last."""
    n = spec.sizes()[kind]
    if kind == "top":
        score = values
    elif kind == "bottom":
        score = -values
    else:  # (the active rows only)
        units = np.arange(values.shape[0])[:, None]
        score = np.where(values > 0, -priority(keys, units, spec.seed), -np.inf)
    score = np.where((keys >= 0) & ~np.isnan(score), score, -np.inf)
    empty_last = np.where(keys >= 0, keys, np.iinfo(np.int64).max)
    order = np.lexsort((empty_last, -score), axis=1)[:, :n]
    values, keys = np.take_along_axis(values, order, 1), np.take_along_axis(keys, order, 1)
    empty = np.take_along_axis(score, order, 1) == -np.inf
    values = np.where(empty, np.inf if kind == "bottom" else -np.inf, values)
    keys = np.where(empty, -1, keys)
    if values.shape[1] < n:  # fewer candidates than slots
        pad = n - values.shape[1]
        fill = np.inf if kind == "bottom" else -np.inf
        values = np.pad(values, ((0, 0), (0, pad)), constant_values=fill)
        keys = np.pad(keys, ((0, 0), (0, pad)), constant_values=-1)
    return values, keys


def quantile_groups(values: np.ndarray, keys: np.ndarray, groups: int) -> np.ndarray:
    """Of one unit's sampled rows (-1 keys empty): each row's group, 0 (lowest) to groups - 1,
    equal-count by rank of value; -1 for empty slots."""
    out = np.full(len(keys), -1)
    kept = np.flatnonzero(keys >= 0)
    if len(kept):
        ranks = np.empty(len(kept), np.int64)
        ranks[np.lexsort((keys[kept], values[kept]))] = np.arange(len(kept))
        out[kept] = ranks * groups // len(kept)
    return out
