"""One declaration of the statistics (`probe.stats.stat_columns`) drives every table's header, the
running state's layout in probe.h5, and where each backend packs a batch's accumulator."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import h5py
import numpy as np
import pandas as pd
import pytest
import torch

from probe.read import tables
from probe.stats import fused, stat_columns
from probe.stats import torch_backend as torch_stats
from probe.stats.running import RunningStats, stats_for
from probe.stats.stat_columns import BATCH_AT, PACKED_AT, PACKED_HEAD, SCALARS, SLOTS, Column
from probe.store import stats_file, steps_file


def _batch() -> np.ndarray:
    """(rows 3, units 2, 4) float32 with a NaN, an Inf, zeros of both signs."""
    a = np.arange(24, dtype=np.float32).reshape(3, 2, 4) / 3 - 2.5
    a[0, 0, :2] = [0.0, -0.0]
    a[1, 1, 3] = np.nan
    a[2, 0, 1] = np.inf
    return a


def _expected(a: np.ndarray) -> dict:
    """The batch accumulator of `a`, by name, computed with numpy."""
    finite = a[np.isfinite(a)].astype(np.float64)
    rows = np.where(np.isfinite(a), a, 0).astype(np.float64).reshape(len(a), -1)
    return {
        "n": finite.size,
        "mean": finite.mean(),
        "m2": ((finite - finite.mean()) ** 2).sum(),
        "min": finite.min(),
        "max": finite.max(),
        "abs_sum": np.abs(finite).sum(),
        "zeros": int((finite == 0).sum()),
        "nan_count": int(np.isnan(a).sum()),
        "inf_count": int(np.isinf(a).sum()),
        "l2_sum": np.linalg.norm(rows, axis=1).sum(),
    }


def _check(values, want: dict) -> None:
    assert set(values) >= set(want)
    for name, value in want.items():
        assert values[name] == pytest.approx(value, rel=1e-9, abs=1e-12), name


def test_the_batch_accumulator_is_the_state_without_rows():
    assert tuple(f.name for f in dataclasses.fields(RunningStats))[: len(SLOTS)] == SCALARS
    assert SCALARS[1:] == stat_columns.BATCH_NAMES
    empty = RunningStats()
    assert [getattr(empty, s.name) for s in SLOTS] == [s.empty for s in SLOTS]
    assert {"rows", "n", "zeros", "nan_count", "inf_count"} == stat_columns.INTEGER_SCALARS
    assert PACKED_HEAD == 13 and PACKED_AT["n"] == 2 and PACKED_AT["l2_sum"] == 11


def test_each_backend_packs_the_accumulator_where_the_declaration_says():
    """The torch reference's packed vector read at PACKED_AT, and the fused reduction's state,
    equal the numpy values of the batch."""
    a = _batch()
    want = _expected(a)
    packed = torch_stats.reduce(torch.from_numpy(a)).numpy()
    _check({name: packed[at] for name, at in PACKED_AT.items()}, want)
    _check(stat_columns.by_name(stat_columns.batch_values(packed[:PACKED_HEAD])), want)
    p, layout = fused.reduce(torch.from_numpy(a))
    _check(stat_columns.by_name(layout.unpack(p.numpy()).accumulator()), want)


def test_the_numba_passes_pack_the_accumulator_where_the_declaration_says():
    pytest.importorskip("numba")
    from probe.stats import numba_backend
    from probe.stats.kernels import packing
    from probe.stats.running import LogHistogram

    offsets = {"n": packing._N, "mean": packing._MEAN, "m2": packing._M2, "min": packing._MIN,
               "max": packing._MAX, "abs_sum": packing._ABS, "zeros": packing._ZEROS,
               "nan_count": packing._NANS, "inf_count": packing._INFS, "l2_sum": packing._L2}  # fmt: skip
    assert offsets == BATCH_AT
    assert (
        PACKED_AT["l2_sum"],
        PACKED_AT["nan_count"],
    ) == (numba_backend.L2_AT, numba_backend.NANS_AT)
    a = _batch()
    packed = numba_backend._by_threads(a, LogHistogram().lanes(1), 1, True)
    _check({name: packed[at] for name, at in PACKED_AT.items()}, _expected(a))


def test_the_state_merges_each_slot_as_declared():
    a, b = _batch(), _batch()[:2] * 3
    s = RunningStats(rows=len(a), **_expected(a))
    s.add(len(b), [_expected(b)[name] for name in stat_columns.BATCH_NAMES])
    whole = _expected(np.concatenate([a.reshape(-1), b.reshape(-1)])[None])
    whole["l2_sum"] = _expected(a)["l2_sum"] + _expected(b)["l2_sum"]  # (a sum over rows)
    _check(stat_columns.by_name(s.accumulator()), whole)
    assert s.rows == len(a) + len(b)
    assert {s.merge for s in SLOTS} == {"sum", "min", "max", "moments"}


def _info(stats: RunningStats) -> SimpleNamespace:
    return SimpleNamespace(layer="fc", site="output", module_type="Linear", shape=(3, 2),
                           dtype="float32", stats=stats)  # fmt: skip


def _stats() -> RunningStats:
    s = stats_for("Linear", "output")
    s.merge(torch_stats.batch_stats(torch.from_numpy(_batch())))
    return s


def test_every_header_is_the_declarations(tmp_path):
    """summary.csv, train.csv and probe.h5's /train and /stats are laid out as declared."""
    site = list(stat_columns.SITE_COLUMNS)
    summary = site + [c.name for c in stat_columns.COLUMNS if not c.per_step]
    frame = tables.summary_frame([_info(_stats())])
    assert list(frame.columns) == summary == tables.COLUMNS
    steps = ["step", *summary, *(c.name for c in stat_columns.COLUMNS if c.per_step)]
    assert list(steps_file.CSV_COLUMNS) == steps
    lines, f = _watched(tmp_path, _stats())
    assert lines[0] == ",".join(steps)
    assert list(f["train/sites/fc/output"].attrs["columns"]) == steps[len(site) + 1 :]
    assert list(steps_file.read_frame(f).columns) == steps
    f.close()
    assert stats_file.SCALAR_TYPE.names == (*SCALARS, "buckets")
    for s in SLOTS:
        assert (stats_file.SCALAR_TYPE[s.name].kind == "i") == s.integer, s.name


def _watched(path, stats: RunningStats) -> tuple[list[str], h5py.File]:
    """train.csv's lines and the open probe.h5 of one recorded step of `stats`."""
    out = steps_file.StepFile(path / "probe.h5", {}, ["loss"])
    info = steps_file.SiteInfo("fc", "output", "Linear", (3, 2), "float32", "activation")
    out.append(0, {("fc", "output"): (info, steps_file.step_row(stats))}, np.ones(1))
    out.close(True)
    return (path / "train.csv").read_text().splitlines(), h5py.File(path / "probe.h5", "r")


def test_a_statistic_declared_once_is_a_column_of_every_table(tmp_path, monkeypatch):
    """A new column in the declaration alone reaches summary.csv, a sweep's table and train.csv,
    with its value, in the declared place; a per-step one train.csv alone."""
    twice_n = Column("twice_n", True, "moments", lambda s, q: 2 * s.n)
    spread = Column("spread", False, "max", lambda s, q: s.max - s.min if s.n else math.nan,
                    per_step=True)  # fmt: skip
    at = [c.name for c in stat_columns.COLUMNS].index("l2_mean")
    declared = (*stat_columns.COLUMNS[:at], twice_n, *stat_columns.COLUMNS[at:], spread)
    monkeypatch.setattr(stat_columns, "COLUMNS", declared)
    s = _stats()
    n = _expected(_batch())["n"]

    row = s.as_row()
    assert row["twice_n"] == 2 * n and "spread" not in row
    frame = tables.summary_frame([_info(s)])
    names = list(frame.columns)
    assert names[names.index("inf_count") + 1] == "twice_n" and "spread" not in names
    assert frame["twice_n"].tolist() == [2 * n]
    assert "twice_n" in tables.integer_columns()

    lines, f = _watched(tmp_path, s)
    header = lines[0].split(",")
    assert header[header.index("inf_count") + 1] == "twice_n" and header[-2:] == ["norm", "spread"]
    cells = dict(zip(header, lines[1].split(","), strict=True))
    assert cells["twice_n"] == str(2 * n)  # an integer column, written as one
    assert float(cells["spread"]) == s.max - s.min
    table = steps_file.read_frame(f)
    f.close()
    assert list(table.columns) == header and table["twice_n"].dtype == pd.Int64Dtype()


def test_the_kernels_cache_is_stamped_with_the_declaration(tmp_path, monkeypatch):
    """The numba passes compile the declared offsets in: a change to the declaration changes
    their cache's source stamp and the warm-up's key, as a change to a kernels module does."""
    pytest.importorskip("numba")
    from probe.stats import kernel_cache
    from probe.stats.kernels import locator

    copy = tmp_path / "stat_columns.py"
    copy.write_bytes(locator.COMPILED_IN[0].read_bytes())
    monkeypatch.setattr(locator, "COMPILED_IN", (copy,))
    monkeypatch.setattr(kernel_cache, "COMPILED_IN", copy)
    before = (locator.package_stamp(), kernel_cache._key())
    copy.write_text(copy.read_text() + "\n")
    after = (locator.package_stamp(), kernel_cache._key())
    assert before[0] != after[0] and before[1] != after[1]
