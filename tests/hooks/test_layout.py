"""Selecting transformer blocks, alternative layer patterns, and the unit axis: where per-unit
statistics and reductions find the units, compared with numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchvision
from torch import nn

from probe.errors import ConfigError, SelectionError
from probe.hooks.module_select import block_names, select_modules
from probe.layout import class_axis, unit_axis
from probe.models.zoo import LeNet
from probe.plan import probe_specs
from probe.stats import backend
from probe.stats.backend import batch_stats
from probe.stats.running import RunningStats
from probe.testing.models import TinyLM


def spec(**kw):
    return probe_specs({"p": kw})


def test_blocks_are_the_children_of_the_outermost_stacks():
    resnet = torchvision.models.resnet18()
    assert block_names(resnet) == [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)]
    assert block_names(TinyLM()) == ["blocks.0", "blocks.1"]
    assert block_names(LeNet()) == []  # a Sequential of mixed layers is no stack
    with pytest.raises(SelectionError, match="has none"):
        select_modules(LeNet(), spec(layers=["@blocks"]))
    chosen = select_modules(TinyLM(), spec(layers=["@blocks.0", "@blocks.2"]))
    assert [s.name for s in chosen] == ["blocks.0.0", "blocks.0.2", "blocks.1.0", "blocks.1.2"]


def test_match_any_takes_patterns_as_alternatives():
    model = TinyLM()
    picked = select_modules(model, spec(layers=["@blocks.attn", "@blocks.0"], match="any"))
    assert [s.name for s in picked] == ["blocks.0.0", "blocks.1.0"]
    with pytest.raises(SelectionError, match="match: any"):
        select_modules(model, spec(layers=["@blocks.attn", "@blocks.0"]))
    with pytest.raises(SelectionError, match="attn"):
        select_modules(model, spec(layers=["@blocks.attn", "nowhere"], match="any"))


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"unit_axis": 0}, ["unit_axis=0", "auto"]),
        ({"unit_axis": "last"}, ["unit_axis='last'", "-1"]),
        ({"rows": "token"}, ["rows='token'", "samples, tokens"]),
        ({"rows": "tokens", "reduce": "token_mean"}, ["reduce: none", "token_mean"]),
        ({"reduce": "mean"}, ["reduce='mean'", "token_mean"]),
        ({"match": "some"}, ["match='some'", "all or any"]),
    ],
)
def test_bad_layout_settings_are_named(kw, words):
    with pytest.raises(ConfigError) as e:
        select_modules(TinyLM(), spec(layers=["embed"], **kw))
    for w in words:
        assert w in str(e.value)


def test_auto_unit_axis_by_class_then_by_layout():
    mro = lambda m: tuple(c.__name__ for c in type(m).__mro__)  # noqa: E731
    assert class_axis(mro(nn.Conv1d(2, 2, 1))) == "first"
    assert class_axis(mro(nn.BatchNorm1d(2))) == "first"
    assert class_axis(mro(nn.Linear(2, 2))) == "last"
    assert class_axis(mro(nn.ReLU())) is None
    assert unit_axis("auto", "first", 3, "x") == 1  # Conv1d's (N, C, L)
    assert unit_axis("auto", "last", 4, "x") == 3  # a Linear over (N, H, W, C)
    assert unit_axis("auto", None, 4, "x") == 1  # an activation of an image layout
    assert unit_axis("auto", None, 3, "x") == 2  # ... of a token layout
    assert unit_axis(-1, None, 4, "x") == 3 and unit_axis(2, None, 4, "x") == 2
    with pytest.raises(ConfigError, match="unit_axis=5"):
        unit_axis(5, None, 3, "probe 'p' layer 'a'")


@pytest.mark.parametrize("axis", [1, 2, 3])
def test_per_unit_statistics_along_any_axis_equal_numpy(axis):
    """(N, T, H, C) data with a NaN: units along axis 1, 2 or 3 give numpy's per-unit counts,
    sums and extremes; the scalars and each sample's L2 norm do not depend on the axis."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 4, 3, 6, generator=g)
    x[1, 2, 0, 3] = float("nan")
    s = RunningStats(unit_axis=axis)
    backend.fold(s, x[:2])
    backend.fold(s, x[2:])
    a = np.moveaxis(x.double().numpy(), axis, 1).reshape(5, x.shape[axis], -1)
    finite = np.isfinite(a)
    u = s.units
    np.testing.assert_array_equal(u.count, finite.sum(axis=(0, 2)))
    np.testing.assert_allclose(u.sum, np.where(finite, a, 0).sum(axis=(0, 2)), rtol=1e-6)
    np.testing.assert_array_equal(u.min, np.nanmin(a, axis=(0, 2)).astype(np.float32))
    np.testing.assert_array_equal(u.max, np.nanmax(a, axis=(0, 2)).astype(np.float32))
    rows = np.where(np.isfinite(x.double().numpy()), x.double().numpy(), 0).reshape(5, -1)
    np.testing.assert_allclose(s.l2_sum, np.linalg.norm(rows, axis=1).sum(), rtol=1e-9)
    plain = batch_stats(x)
    assert (s.rows, s.n, s.nan_count) == (5, plain.n, 1)
    np.testing.assert_allclose([s.mean, s.m2], [plain.mean, plain.m2], rtol=1e-9)
