"""The reading API, the analysis example of docs/statistics.md, and figures whose plotted values
equal the table's."""

from __future__ import annotations

import re
import runpy
import sys

import numpy as np
import pandas as pd
import pytest

from probe.read.runs import open_run
from probe.report.summary_plots import depth_figure, features_figure, histogram_figure
from tests.helpers import ROOT, run_probe

TINY = ["model=resnet18", "dataset.image_size=32", "dataset.num_samples=5", "dataset.batch_size=2"]
TINYNET = ["model=custom", "model._target_=probe.testing.models.TinyNet", "model.input_shape=[3,8,8]",
           "model.num_classes=10", "dataset.num_samples=5", "dataset.batch_size=2",
           "probes=grads_all_convs"]  # fmt: skip


@pytest.fixture(scope="module")
def grad_run(tmp_path_factory):
    """A full run with conv outputs and their gradients."""
    path = tmp_path_factory.mktemp("run")
    result, f = run_probe(path, *TINY, "probes=grads_all_convs")
    f.close()
    return result


def test_docs_analysis_example_runs_on_a_real_run(grad_run):
    page = (ROOT / "docs" / "statistics.md").read_text()
    block = next(
        b for b in re.findall(r"```python\n(.*?)```", page, re.S) if "Analysis example" in b
    )
    code = block.replace("outputs/2026-11-21/10-00-00", str(grad_run.run_dir))
    exec(compile(code, "docs/statistics.md", "exec"), {})  # its asserts compare h5py with the API


def test_lazy_arrays_read_the_valid_rows_only(grad_run):
    with open_run(grad_run.run_dir) as run:
        assert run.layers[0] == "conv1" and run.sites("conv1") == ["output", "grad_output"]
        raw = run.file["layers/layer1.0.conv1/output"]
        a = run.array("layer1.0.conv1")
        assert a.shape == raw.shape and len(a) == 5
        np.testing.assert_array_equal(a[1:4, 2], raw[1:4, 2])
        np.testing.assert_array_equal(a[-1], raw[4])
        np.testing.assert_array_equal(a[::-2], raw[:][::-1][::2])
        np.testing.assert_array_equal(np.asarray(a), raw[:])
        a.valid = 3  # as a file cut short after three rows would say
        assert a.shape[0] == 3 and len(a[:]) == 3
        with pytest.raises(IndexError):
            a[3]
        assert run.config.model.name == "resnet18" and run.effects is None
        (run.path / "effects.csv").write_text("layer,effect\nconv1,0.5\n")
        assert run.effects.effect.tolist() == [0.5]


def test_depth_figure_plots_the_table_values(grad_run):
    summary = grad_run.summary
    fig = depth_figure(summary)
    axes = fig.axes
    out = summary[summary.site == "output"]
    grads = summary[summary.site == "grad_output"]
    for ax, values in zip(
        axes, [out["mean"], out["std"], out["dead_frac"], grads["l2_mean"]], strict=True
    ):
        (line,) = ax.get_lines()
        np.testing.assert_array_equal(line.get_ydata(), values.to_numpy())
        assert [t.get_text() for t in ax.get_xticklabels()] == list(out.layer)


def test_depth_figure_of_runs_with_different_layers_uses_relative_depth(grad_run):
    """A sweep over two models: no layer names on a shared axis (they differ), each run's line
    over relative depth with its own values."""
    one = grad_run.summary.assign(run="0", model="a")
    other = one[one.layer != one.layer.iloc[0]].assign(run="1", model="b")
    fig = depth_figure(pd.concat([one, other], ignore_index=True))
    ax = fig.axes[0]  # mean of outputs
    for line, part in zip(ax.get_lines(), [one, other], strict=True):
        rows = part[part.site == "output"]
        np.testing.assert_array_equal(line.get_ydata(), rows["mean"].to_numpy())
        np.testing.assert_allclose(line.get_xdata(), np.linspace(0, 1, len(rows)))
    assert not {t.get_text() for t in ax.get_xticklabels()} & set(one.layer)
    assert "relative depth" in ax.get_xlabel()


def test_histograms_and_feature_maps_hold_the_data(grad_run):
    with open_run(grad_run.run_dir) as run:
        fig = histogram_figure(run)
        keys = [k for k in run.keys if k[1] == "output"]
        rows = grad_run.summary.set_index(["layer", "site"])
        for ax, (layer, site) in zip(fig.axes, keys, strict=False):
            heights = np.array([p.get_height() for p in ax.patches])
            lefts = np.array([p.get_x() for p in ax.patches])
            assert heights.sum() == rows.loc[(layer, site), "n"]
            raw = run.array(layer, site)[:].ravel()
            edges = np.append(lefts, lefts[-1] + ax.patches[-1].get_width())
            exact, _ = np.histogram(raw, bins=edges)
            # bucket midpoints sit within 0.39% of each value: only values at bin edges may move
            assert np.abs(heights - exact).sum() <= 0.02 * len(raw)
        sample = run.array("layer2.0.conv1")[3]
        fig = features_figure(sample, max_maps=16)
        images = [ax.images[0].get_array() for ax in fig.axes if ax.images]
        assert len(images) == 16
        for c, image in enumerate(images):
            np.testing.assert_array_equal(np.asarray(image), sample[c])


def _script(monkeypatch, *argv: str) -> int:
    """A script of scripts/ run as `python scripts/NAME.py ARGS` would run it, in this process
    (torch and matplotlib are imported once, not per script)."""
    monkeypatch.setattr(sys, "argv", [str(ROOT / argv[0]), *argv[1:]])
    try:
        runpy.run_path(str(ROOT / argv[0]), run_name="__main__")
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def test_plot_scripts_write_their_pictures(tmp_path, monkeypatch, capsys):
    """The wrappers in scripts/ of `python -m probe.plot` (whose figures test_plots_report reads
    back) write the pictures, and a layer that is not there is a message, not a traceback. (A
    TinyNet run: the figures of resnet18's 40 sites take long to draw and say nothing more.)"""
    result, f = run_probe(tmp_path, *TINYNET)
    f.close()
    run_dir = str(result.run_dir)
    assert _script(monkeypatch, "scripts/plot_summary.py", run_dir) == 0
    args = ["--layer", "conv", "--sample", "2"]
    assert _script(monkeypatch, "scripts/plot_features.py", run_dir, *args) == 0
    for name in ("depth.png", "histograms.png", "features_conv_output_2.png"):
        assert (result.run_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    assert _script(monkeypatch, "scripts/plot_features.py", run_dir, "--layer", "nope") == 2
    err = capsys.readouterr().err
    assert "nope" in err and "Traceback" not in err
