"""A watched step's CPU values on the numba backend's short path (`numba_backend.solo_packed`:
one compiled call, the micro-batches merged from the packed arrays by `packed_running` and
`merge_packed`) against the general one (`batch_stats`, a RunningStats per batch, merged by
`StepStats._fold`): every scalar (its repr: bits and type), every unit array (values and dtype),
the histogram's counts and the step table's values equal, over the micro-batches of a step;
and bucket ranges holding float64 counts (as the pass packs them) equal to int64 ones.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from probe.stats import backend
from probe.stats.running import BucketSpans, LogHistogram
from probe.stats.stat_columns import step_columns, values
from probe.train.step_stats import StepStats

pytest.importorskip("numba")  # the compiled kernels are the `fast` extra's


def _steps() -> dict[str, list[torch.Tensor]]:
    """name -> a site's values over one step's micro-batches."""
    g = torch.Generator().manual_seed(3)

    def normal(*shape, scale=1.0, shift=0.0):
        return torch.randn(*shape, generator=g) * scale + shift

    nan = normal(6, 10, 7)
    nan[2, 3, 1], nan[4, 0, 0], nan[5, 9, 6] = float("nan"), float("inf"), -float("inf")
    return {
        "conv maps": [normal(8, 16, 5, 5), normal(8, 16, 5, 5, scale=3.0)],
        "narrow ReLU maps (by column)": [torch.relu(normal(64, 32, 4, 4)) for _ in range(2)],
        "a parameter (one row)": [normal(1, 64, 3, 3, 3, scale=0.02)],
        "NaN and Inf in the first": [nan, normal(6, 10, 7)],
        "zeros, then values": [torch.zeros(4, 8, 9), normal(4, 8, 9)],
        "no finite value first": [torch.full((3, 5, 6), float("nan")), normal(3, 5, 6)],
        "two dimensions, 3 batches": [normal(32, 20), normal(16, 20, shift=100.0), normal(1, 20)],
        "positive, then negative": [normal(4, 6, 200).abs() + 1, -normal(4, 6, 200).abs() - 5],
    }


STEPS = _steps()


def _step(values_: list[torch.Tensor], short: bool):
    stats = StepStats()
    if not short:  # (as under another backend: every value through batch_stats)
        stats.solo, stats.solo_known = None, True
    returned = [stats.add(("layer", "output"), x, None, 1) for x in values_]
    assert (stats.solo is not None) == short
    return stats.stats[("layer", "output")], returned


@pytest.mark.parametrize("name", list(STEPS))
def test_short_path_equals_batch_stats(name, monkeypatch):
    monkeypatch.setattr(backend, "_cpu", "numba")
    ours, returned = _step(STEPS[name], short=True)
    general, returned_general = _step(STEPS[name], short=False)
    assert type(ours.hist) is BucketSpans and type(general.hist) is BucketSpans
    table = values(ours, step_columns())
    expected = values(general, step_columns())
    assert {k: repr(v) for k, v in table.items()} == {k: repr(v) for k, v in expected.items()}
    scalars = {k: repr(v) for k, v in vars(ours).items() if k not in ("hist", "units")}
    assert scalars == {k: repr(v) for k, v in vars(general).items() if k not in ("hist", "units")}
    assert ours.units is not None and general.units is not None
    for field, array in vars(general.units).items():
        mine = getattr(ours.units, field)
        if array is None:
            assert mine is None
        else:
            assert mine.dtype == array.dtype and np.array_equal(mine, array), field
    assert np.array_equal(ours.whole_histogram().counts, general.whole_histogram().counts)
    for a, b in zip(returned, returned_general, strict=True):  # (what the NaN check reads)
        assert (a.nan_count, a.inf_count) == (b.nan_count, b.inf_count)


def test_float_bucket_counts_equal_integer_ones():
    rng = np.random.default_rng(5)
    heads = np.array([[100, 300], [0x8000 + 50, 200]], dtype=np.int64)
    counts = rng.integers(0, 1000, 500)
    other_heads = np.array([[250, 400], [0x8000 + 10, 30]], dtype=np.int64)
    other = rng.integers(0, 1000, 430)
    qs = [0.0, 0.01, 0.25, 0.5, 0.75, 0.99, 1.0]
    as_int = BucketSpans(heads, counts).union(BucketSpans(other_heads, other))
    as_float = BucketSpans(heads, counts.astype(np.float64)).union(
        BucketSpans(other_heads, other.astype(np.float64))
    )
    assert np.array_equal(as_int.heads, as_float.heads)
    assert np.array_equal(as_int.spans, as_float.spans)
    whole = LogHistogram()
    as_float.add_to(whole.counts)
    assert whole.counts.dtype == np.int64
    assert np.array_equal(whole.counts, as_int.whole().counts)
    assert as_float.quantiles(qs, -1e9, 1e9) == as_int.quantiles(qs, -1e9, 1e9)
    assert as_float.quantiles(qs, -1e9, 1e9) == whole.quantiles(qs, -1e9, 1e9)
