"""The fused reduction (`probe.stats.fused`): how many torch operations a batch costs, counted by a
TorchDispatchMode, and its statistics against the reference path of the torch backend.

Equality, as in test_stats_backends.py: counts, extremes (bit for bit, signed zeros included),
per-unit counts and histograms equal; sums (mean, m2, abs_sum, l2_sum, unit sums) within 1e-9
relative, float64 rounding of the same sums added in another order (unit sums that cancel: 1e-12
of their largest magnitude). One exception, stated in docs/statistics.md: a unit holding NaN or
Inf has its moments taken with those values as zeros, which are then taken out (Chan), so m2
carries a further error of up to 2**-52 * k * mean**2 * sqrt(n) for k such values among a unit's n
(measured on the CPU's var_mean, which adds in sequence; `test_a_unit_holding_nan_...`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from probe.errors import ConfigError
from probe.stats import fused
from probe.stats import torch_backend as torch_stats
from probe.stats.backend import DeviceStats
from probe.stats.running import RunningStats
from tests.stats.test_stats_backends import CASES, _check_against, _dense

OPS = 12  # per reduced tensor, views and the packing included


class Dispatched(TorchDispatchMode):
    """The ATen operations dispatched while it is active, in order."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def dispatched(fn) -> list[str]:
    fn()  # once first: the constants of a kind of batch are made once and kept
    with Dispatched() as mode:
        fn()
    return mode.ops


def _without_alias_detach(ops: list[str]) -> list[str]:
    """The operations less the `aten.detach` a dispatch mode makes torch dispatch for the integer
    view of a tensor outside inference mode (its alias is a shallow copy, which under a Python
    mode goes through `detach`; torch's profiler records no such operation there)."""
    return [op for i, op in enumerate(ops) if not (op == "aten.detach.default" and i and
                                                   ops[i - 1] == "aten.view.dtype")]  # fmt: skip


SHAPES = {  # name -> (batch, unit axis, saturation bounds)
    "conv": ((16, 32, 8, 8), 1, None),  # per-unit statistics over channels
    "conv_tanh": ((16, 32, 8, 8), 1, (-1.0, 1.0)),
    "tokens": ((4, 24, 64), -1, None),  # (N, T, D), units last
}


@pytest.mark.parametrize("hist", [True, False], ids=["quantiles", "no_quantiles"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_a_batch_takes_at_most_a_dozen_operations(name, hist):
    """Reducing one tensor dispatches at most 12 operations (the reference: well over a hundred),
    whether the tensor comes from a hook under inference mode or from a training step."""
    shape, axis, bounds = SHAPES[name]
    x = torch.randn(shape).relu()

    def reduce(t):
        return lambda: fused.reduce(t, bounds, axis, hist=hist)

    with torch.inference_mode():
        captured = x.clone()
    in_hook = dispatched(reduce(captured))
    training = dispatched(reduce(x.clone().requires_grad_()))
    assert len(in_hook) <= (OPS if hist else OPS - 2), in_hook
    assert _without_alias_detach(training) == in_hook
    reference = dispatched(lambda: torch_stats.reduce(captured, bounds, axis))
    assert len(reference) > 100


def test_the_counted_reduction_is_the_one_off_the_host(monkeypatch):
    """auto reduces a GPU batch with the fused path and a CPU batch with the reference, which is
    faster there (docs/engineering/performance_internals.md); float64 always with the reference."""
    x = torch.randn(4, 3, 5)
    assert not torch_stats.takes_fused(x)
    monkeypatch.setattr(torch_stats, "_host", lambda device: False)
    assert torch_stats.takes_fused(x) and not torch_stats.takes_fused(x.double())
    assert len(_without_alias_detach(dispatched(lambda: torch_stats.on_device(x)))) <= OPS
    monkeypatch.setenv(torch_stats.REDUCTION_ENV, "reference")
    assert not torch_stats.takes_fused(x)
    monkeypatch.setenv(torch_stats.REDUCTION_ENV, "fastest")
    with pytest.raises(
        ConfigError, match="'fastest' is unknown; choose from auto, fused, reference"
    ):
        torch_stats.takes_fused(x)


def _reference(x, bounds, axis) -> RunningStats:
    rows = x.shape[0] if x.dim() else 1
    if x.numel() == 0:
        return RunningStats(rows=rows, hist=None, unit_axis=axis)
    return torch_stats.unpack(torch_stats.reduce(x, bounds, axis).numpy(), rows, axis)


def _fused(x, bounds, axis, **kw) -> RunningStats:
    packed, layout = fused.reduce(x, bounds, axis, **kw)
    return layout.unpack(packed.numpy())


def _edge_cases() -> dict:
    """name -> (tensor, bounds, unit axis): what the reference cases leave out."""
    g = torch.Generator().manual_seed(3)
    signed = torch.randn(7, 6, 5, generator=g)
    signed[:, 0] = -0.0  # a unit of -0.0 alone
    signed[:, 1] = 0.0
    signed[:, 2] = torch.where(signed[:, 2] > 0, 0.0, -0.0)  # both zeros
    signed[:, 3] = signed[:, 3].abs() + 1  # positive only, then with NaN and Inf
    signed[2, 3, 1], signed[4, 3, 0] = float("nan"), float("inf")
    signed[:, 4] = -signed[:, 4].abs() - 1  # negative only, with -inf
    signed[5, 4, 4] = -float("inf")
    payloads = torch.tensor([0x7F800001, 0xFF800002, 0x7FC00000, 0x7F800000], dtype=torch.int64)
    odd_nans = torch.randn(3, 4, generator=g)
    odd_nans[0] = payloads.to(torch.int32).view(torch.float32)  # NaNs beside +-Inf's bucket
    sat = torch.sigmoid(torch.randn(10, 6, 3, 3, generator=g) * 20)
    sat[:, 0] = 1.0  # a unit saturated throughout
    return {
        "signed_zeros": (signed, None, 1),
        "nan_payloads": (odd_nans, None, 1),
        "constant": (torch.full((6, 3, 4), 2.5), None, 1),
        "one_row": (torch.randn(1, 9, 4, 4, generator=g), None, 1),
        "one_row_tokens": (torch.randn(1, 5, 8, generator=g), None, -1),
        "empty": (torch.zeros(0, 4, 3), None, 1),
        "empty_rows": (torch.zeros(5, 0), None, 1),
        "saturated": (sat, (0.0, 1.0), 1),
        "relu6_tokens": (torch.clamp(torch.randn(3, 7, 9, generator=g) * 4, 0, 6), (0.0, 6.0), -1),
        "column": (torch.randn(12, 1, generator=g), None, 1),
        "channels_last": (
            torch.randn(4, 8, 5, 5, generator=g).to(memory_format=torch.channels_last),
            None,
            1,
        ),
        "bfloat16_specials": (
            torch.tensor([[float("nan"), -0.0, 1e-40], [float("inf"), 3.0, -2.0]]).bfloat16(),
            None,
            1,
        ),
    }


EDGES = _edge_cases()
ALL = {**{k: v for k, v in CASES.items() if v[0].dtype != torch.float64}, **EDGES}


@pytest.mark.parametrize("name", list(ALL))
def test_fused_statistics_equal_the_reference(name):
    x, bounds, axis = ALL[name]
    _check_against(_fused(x, bounds, axis), _reference(x, bounds, axis))


@pytest.mark.parametrize("name", ["specials", "relu", "tanh", "ntc", "signed_zeros", "float16"])
def test_slabs_and_the_sorted_histogram_give_the_same_statistics(name):
    """Rows reduced a few at a time (merged on the host) and histograms counted by sorting (as a
    large GPU slab does) equal one slab counted by histc."""
    x, bounds, axis = ALL[name]
    whole = _fused(x, bounds, axis)
    per_row = x.numel() // len(x)
    for kw in (
        {"slab": 3 * per_row},
        {"slab": 1},
        {"sorted_from": 1},
        {"slab": 1, "sorted_from": 1},
    ):
        _check_against(_fused(x, bounds, axis, **kw), whole)


def test_a_unit_holding_nan_keeps_its_m2_within_the_stated_bound():
    """Units of 1000 +- 0.01 with one NaN, and with six Inf: counts, extremes and sums as the
    reference's; m2 within 2**-52 * k * mean**2 * sqrt(n) (about 1e-7 relative here: the zeros
    lie 1000 from values whose spread is 0.006)."""
    g = torch.Generator().manual_seed(4)
    x = 1000 + torch.rand(30, 4, 6, generator=g) * 0.02 - 0.01
    x[3, 1, 2] = float("nan")
    x[9, 2, :] = float("inf")
    got, want = _fused(x, None, 1), _reference(x, None, 1)
    bound = 2.0**-52 * 7 * want.mean**2 * np.sqrt(30 * 6)
    assert abs(got.m2 - want.m2) <= bound, (got.m2, want.m2, bound)
    got.m2 = want.m2
    _check_against(got, want)
    clean = x.nan_to_num(1000.0, 1000.0)  # the same units without NaN and Inf: to 1e-9
    _check_against(_fused(clean, None, 1), _reference(clean, None, 1))


@pytest.mark.parametrize("name", ["specials", "float64", "tanh", "ntc", "float16"])
def test_the_reference_still_reduces_off_the_host_when_chosen(name, monkeypatch):
    """PROBE_TORCH_REDUCTION=reference on a GPU: the reference's branch-free path (run on the CPU
    here) equals its host path."""
    x, bounds, axis = ALL.get(name) or CASES[name]
    host = torch_stats.batch_stats(x, bounds, axis)
    monkeypatch.setattr(torch_stats, "_host", lambda device: False)
    monkeypatch.setenv(torch_stats.REDUCTION_ENV, "reference")
    _check_against(torch_stats.batch_stats(x, bounds, axis), host)


def test_without_quantiles_the_rest_is_the_same():
    x, bounds, axis = ALL["tanh"]
    full, bare = _fused(x, bounds, axis), _fused(x, bounds, axis, hist=False)
    assert bare.hist is None
    bare.hist = full.hist
    _check_against(bare, full)


def test_device_stats_read_the_fused_result_once():
    """What the hooks keep for a GPU batch: the packed tensor and its reader, read on the host;
    its NaN, Inf and bucket counts are those of the statistics it folds into."""
    x, bounds, axis = ALL["specials"]
    packed, read = fused.reduce(x, bounds, axis)
    kept = DeviceStats(packed, read.unpack)
    reference = _reference(x, bounds, axis)
    assert (kept.nan_count, kept.inf_count) == (reference.nan_count, reference.inf_count) == (55, 3)
    assert kept.buckets == np.count_nonzero(_dense(reference.hist))
    s = RunningStats(unit_axis=axis)
    kept.fold_into(s)
    _check_against(s, reference)
    assert (kept.nan_count, kept.inf_count) == (55, 3)  # (read again: s holds the first reading)


CUDA = pytest.mark.cuda


@CUDA
@pytest.mark.parametrize("name", ["specials", "tanh", "ntc", "float16", "bfloat16", "signed_zeros"])
def test_on_cuda_the_fused_statistics_equal_the_reference(name):
    x, bounds, axis = ALL[name]
    packed, layout = fused.reduce(x.cuda(), bounds, axis)
    assert packed.device.type == "cuda"
    _check_against(layout.unpack(packed.cpu().numpy()), _reference(x, bounds, axis))
    sorted_, layout = fused.reduce(x.cuda(), bounds, axis, sorted_from=1)
    _check_against(layout.unpack(sorted_.cpu().numpy()), _reference(x, bounds, axis))


@CUDA
def test_the_fused_reduction_does_not_synchronise_on_cuda():
    x = CASES["specials"][0].cuda()
    for sorted_from in (None, 1):  # the constants, made once (copied from pinned memory)
        fused.reduce(x, (0.0, 1.0), sorted_from=sorted_from)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        packed, _ = fused.reduce(x, (0.0, 1.0))
        fused.reduce(x, (0.0, 1.0), sorted_from=1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert packed.device == x.device


@CUDA
@pytest.mark.parametrize("name", list(SHAPES))
def test_on_cuda_a_capture_takes_at_most_a_dozen_operations(name):
    shape, axis, bounds = SHAPES[name]
    with torch.inference_mode():
        x = torch.randn(shape, device="cuda").relu()
        ops = dispatched(lambda: torch_stats.on_device(x, bounds, axis))
    assert torch_stats.takes_fused(x) and len(ops) <= OPS, ops
