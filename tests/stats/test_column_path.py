"""The compiled pass by column (`probe.stats.kernels.columns`) where NaN and Inf first appear after
finite rows of a column block, in a second block, in every row from some row on, and among many
zeros: each row is looked at before its values reach the block's per-column sums and extremes,
so those rows' finite values must count and the others must not. Checked against numpy float64
on the same data (`test_stats_backends._reference`) and against the torch backend (the portable
reference): counts, extremes and histograms equal, sums within the tolerances stated there.
(The backends' shared cases hold their NaN in a row's first block row or in every row.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from probe.stats import torch_backend as torch_stats

pytest.importorskip("numba")  # the compiled kernels are the `fast` extra's

from probe.stats.kernels.columns import COLUMN_BLOCK
from probe.stats.kernels.rows import NARROW
from tests.stats.test_stats_backends import _check_against, _check_numpy, _reference, numba_stats


def _late_specials() -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(11)
    units = COLUMN_BLOCK // 16 + 7  # columns of 16 values: two blocks, the second partly full
    one = rng.standard_normal((24, units, 16)).astype(np.float32)
    one[9, 3, 5] = np.nan  # the first block's first, at row 9 after finite rows
    one[15, 40, 0] = np.inf  # a later row of the same block
    one[20, units - 2, 7] = -np.inf  # the second block's first, at row 20
    many = rng.standard_normal((16, 8, 6)).astype(np.float32)
    many[3:, 2, 1] = np.nan  # in every row from row 3 on
    many[7, :, :] = np.inf
    tokens = rng.standard_normal((40, 64)).astype(np.float32)  # one value a unit: by column
    tokens[33, 5] = np.nan
    relu = np.maximum(rng.standard_normal((12, 32, 9)), 0).astype(np.float32)
    relu[6, 4, 2] = -np.inf  # (a block of many zeros: the split histogram too)
    return {k: torch.from_numpy(v) for k, v in
            {"two_blocks": one, "many_rows": many, "tokens": tokens, "relu": relu}.items()}  # fmt: skip


LATE = _late_specials()


@pytest.mark.parametrize("name", list(LATE))
def test_late_nan_and_inf_by_column(name):
    x = LATE[name]
    size = int(np.prod(x.shape[2:])) if x.dim() > 2 else 1
    assert size < NARROW  # (each case goes by column)
    ours = numba_stats(x)
    assert ours.nan_count == int(torch.isnan(x).sum())
    assert ours.inf_count == int(torch.isinf(x).sum())
    reference = torch_stats.batch_stats(x)
    _check_against(reference, ours)
    _check_numpy(ours, _reference(x, None, 1))
