"""A watched training's figures read back against train.csv (lines and heatmaps hold its values),
its report's training section, and a report that leaves out what would mean nothing: a CAM-only
run has no empty panel and no linear probes on too few rows."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch

import probe

pytest.importorskip("matplotlib")

from probe.launch.run import run  # noqa: E402
from probe.report.figures import figures  # noqa: E402
from probe.report.page import write  # noqa: E402
from probe.report.train_plots import lines_figure, series  # noqa: E402
from probe.testing.trainings import cnn, image_batches, image_loss, one_thread, train  # noqa: E402
from tests.helpers import ROOT, make_cfg  # noqa: E402

PROBES = {"net": {"layers": ["conv1", "layer1", "layer2", "fc"],
                  "capture": ["output", "grad_output", "param", "param_grad", "param_update"]}}  # fmt: skip


@pytest.fixture(scope="module")
def watched(tmp_path_factory):
    out = tmp_path_factory.mktemp("watched") / "w"
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with one_thread():
        train(model, opt, image_batches(4), image_loss, watch={"probes": PROBES, "out": out})
    return out


def panel(fig, label: str):
    (ax,) = [ax for ax in fig.axes if ax.get_ylabel() == label or ax.get_title().endswith(label)]
    return ax


def test_lines_and_heatmap_hold_train_csv(watched):
    table = pd.read_csv(watched / "train.csv")
    _, made = figures(watched)
    assert set(made) == {"train_lines.png", "train_heatmap.png"}
    lines, heat = made["train_lines.png"], made["train_heatmap.png"]
    out = table[table.site == "output"]
    ax = panel(lines, "abs_mean (output)")
    for line in ax.get_lines():
        rows = out[out.layer == line.get_label()]
        np.testing.assert_array_equal(line.get_xdata(), rows.step)
        np.testing.assert_array_equal(line.get_ydata(), rows.abs_mean)
    assert [ln.get_label() for ln in ax.get_lines()] == PROBES["net"]["layers"]
    # update/weight of a layer: its parameters' update norms over their weights', together
    ax = panel(lines, "update / weight")
    for line in ax.get_lines():
        rows = table[table.layer == line.get_label()]
        for step, y in zip(line.get_xdata(), line.get_ydata(), strict=True):
            at = rows[rows.step == step]
            upd = at[at.site.str.startswith("param_update.")].norm
            wgt = at[at.site.str.startswith("param.")].norm
            np.testing.assert_allclose(y, np.sqrt((upd**2).sum() / (wgt**2).sum()), rtol=1e-12)
    # the heatmap: layers down, steps across, log10 of the grad_output norms
    grads = table[table.site == "grad_output"].pivot(index="layer", columns="step", values="norm")
    image = panel(heat, "grad norm (grad_output)").get_images()[0]
    want = np.log10(grads.loc[PROBES["net"]["layers"]].to_numpy())
    np.testing.assert_allclose(np.asarray(image.get_array()), want, rtol=1e-12)
    # the loss panel holds the scalars
    scalars = probe.open_run(watched).train_scalars()
    loss = panel(lines, "training").get_lines()[0]
    np.testing.assert_array_equal(loss.get_ydata(), scalars["loss"])
    # one legend, beside the panels and smaller than one of them
    (legend,) = lines.legends
    lines.canvas.draw()
    box, plot = legend.get_window_extent(), ax.get_window_extent()
    assert box.width * box.height < plot.width * plot.height
    assert [t.get_text() for t in legend.get_texts()] == PROBES["net"]["layers"]


def test_many_layers_get_a_depth_colour_bar_not_a_legend():
    steps = np.arange(3)
    frame = pd.DataFrame({f"l{i}": steps * i for i in range(12)}, index=steps)
    fig = lines_figure({"abs_mean (output)": frame})
    assert not fig.legends and len(fig.axes) == 2  # the panel and its colour bar
    ys = [line.get_ydata() for line in fig.axes[0].get_lines()]
    np.testing.assert_array_equal(ys, frame.to_numpy().T)


def test_a_table_without_a_statistic_leaves_its_panel_out(watched):
    table = pd.read_csv(watched / "train.csv")
    only = table[table.site.str.startswith("param")]  # no output, no grad_output
    assert set(series(only)) == {"grad norm (param_grad)", "update / weight"}
    assert series(only.iloc[:0]) == {} and lines_figure({}) is None


def test_plot_and_report_of_a_watched_run(watched):
    done = subprocess.run([sys.executable, "-m", "probe.plot", str(watched)], cwd=ROOT,
                          capture_output=True, text=True, env={"PYTHONPATH": str(ROOT)})  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert {p.name for p in watched.glob("*.png")} == {"train_lines.png", "train_heatmap.png"}
    html = write(watched).read_text()
    assert "<h2>Training</h2>" in html and html.count("data:image/png;base64") == 2
    last = pd.read_csv(watched / "train.csv").step.max()
    assert f"<td>{last}</td>" in html  # the last step's table


def test_cam_only_report_has_no_empty_panel_and_no_probes_on_too_few_rows(tmp_path):
    cfg = make_cfg(
        "model=custom", "model._target_=probe.testing.models.TinyNet",
        "model.input_shape=[3,8,8]", "model.num_classes=10", "dataset.batch_size=8",
        "dataset.num_samples=16", "probes=none", "+probes.cam.layers=[conv]",
        "+probes.cam.capture=[gradcam]",
    )  # fmt: skip
    run(cfg, run_dir=tmp_path)
    _, made = figures(tmp_path)
    assert "depth.png" not in made and "histograms.png" not in made
    for fig in made.values():  # no panel that only says it has nothing
        assert not any("sites in" in t.get_text() for ax in fig.axes for t in ax.texts)
    html = write(tmp_path).read_text()
    assert "No linear probes: 16 samples of" in html and "too few" in html
    assert not (tmp_path / "linear_probes.csv").exists() and "Linear probes (" not in html
    assert "no output sites: no histograms.png" in html
