"""Many one-row batches reduced together (probe.stats.batched) give each tensor the statistics
the reference gives it alone (probe.stats.torch_backend.reduce): the same counts, extremes (a
zero's sign too) and histograms, the moments within float64 rounding; NaN, Inf, signed zeros,
float64, half precision, a value alone and a vector among them."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from probe.stats import torch_backend
from probe.stats.batched import reduce_many

EXACT = ("rows", "n", "min", "max", "zeros", "nan_count", "inf_count", "units", "dead_frac",
         "p01", "p50", "p99")  # fmt: skip


def tensors(dtype):
    g = torch.Generator().manual_seed(0)
    out = [
        torch.randn(8, 3, 3, 3, generator=g),  # a conv weight
        torch.randn(8, generator=g) + 1000,  # a bias far from 0 (the moments' cancellation)
        torch.randn(5, 7, generator=g),
        torch.tensor(2.5),  # a value alone
        torch.zeros(4, 2),
    ]
    out[2][1, 3], out[2][4, 0], out[2][0, 0] = float("nan"), float("inf"), -0.0
    out[4][1, 1] = -0.0
    return [t.to(dtype) for t in out]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_each_tensor_gets_what_the_reference_gives_it_alone(dtype):
    values = tensors(dtype)
    got = reduce_many(values)
    for t, packed in zip(values, got, strict=True):
        row = t[None]  # (one row; its units along the tensor's first axis)
        want = torch_backend.batch_stats(row.float() if dtype == torch.bfloat16 else row)
        have = torch_backend.unpack(packed.numpy(), 1, 1)
        a, b = have.as_row(), want.as_row()
        for k, v in b.items():
            if k in EXACT or isinstance(v, int):
                assert (a[k] == v) or (math.isnan(a[k]) and math.isnan(v)), (tuple(t.shape), k)
            else:
                np.testing.assert_allclose(a[k], v, rtol=1e-12, atol=1e-300, err_msg=k)
        if want.hist is not None:
            np.testing.assert_array_equal(have.hist.counts, want.hist.counts)
        if want.units is not None:
            for field in ("count", "min", "max", "positive"):
                np.testing.assert_array_equal(
                    getattr(have.units, field), getattr(want.units, field)
                )
            np.testing.assert_allclose(have.units.sum, want.units.sum, rtol=1e-12)
        assert math.copysign(1, have.min) == math.copysign(1, want.min)  # (-0.0 stays -0.0)
