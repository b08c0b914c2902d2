"""A watched training's figures read back against train.csv (lines and heatmaps hold its values),
its report's training section, and a report that leaves out what would mean nothing: a CAM-only
run has no empty panel and no linear probes on too few rows."""

from __future__ import annotations

import re
import subprocess
import sys

import matplotlib
import numpy as np
import pandas as pd
import pytest
import torch

import probe

pytest.importorskip("matplotlib")

from probe.launch.run import run  # noqa: E402
from probe.read.train_series import series  # noqa: E402
from probe.report.figures import figures  # noqa: E402
from probe.report.page import write  # noqa: E402
from probe.report.train_plots import heatmap_figure, lines_figure, train_figures  # noqa: E402
from probe.report.train_sites import kind_of, places  # noqa: E402
from probe.testing.trainings import (  # noqa: E402
    DEEP_PROBES,
    cnn,
    deep_llama,
    image_batches,
    image_loss,
    one_thread,
    token_batches,
    token_loss,
    train,
)
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
    """The axes named `label` ("std (output) | attention", "training | loss")."""
    (ax,) = [ax for ax in fig.axes if ax.get_label() == label]
    return ax


def kinds_of(fig, stat: str) -> dict:
    """{kind: axes} of a statistic's panels."""
    return {ax.get_label().split(" | ")[1]: ax for ax in fig.axes
            if ax.get_label().startswith(f"{stat} | ")}  # fmt: skip


def test_lines_and_heatmap_hold_train_csv(watched):
    table = pd.read_csv(watched / "train.csv")
    _, made = figures(watched)
    assert set(made) == {"train_lines.png", "train_heatmap.png"}
    lines, heat = made["train_lines.png"], made["train_heatmap.png"]
    out = table[table.site == "output"]
    # a panel per kind: the residual blocks (type Block), the rest (conv1, fc)
    panels = kinds_of(lines, "abs_mean (output)")
    assert {k: [ln.get_label() for ln in ax.get_lines()] for k, ax in panels.items()} == {
        "block outputs": ["layer1", "layer2"], "other": ["conv1", "fc"]}  # fmt: skip
    for ax in panels.values():
        for line in ax.get_lines():
            rows = out[out.layer == line.get_label()]
            np.testing.assert_array_equal(line.get_xdata(), rows.step)
            np.testing.assert_array_equal(line.get_ydata(), rows.abs_mean)
    # update/weight of a layer: its parameters' update norms over their weights', together
    ax = panel(lines, "update / weight | parameters")
    assert ax.get_yscale() == "log" and ax.get_ylabel() == "update / weight (log)"
    for line in ax.get_lines():
        rows = table[table.layer == line.get_label()]
        for step, y in zip(line.get_xdata(), line.get_ydata(), strict=True):
            at = rows[rows.step == step]
            upd = at[at.site.str.startswith("param_update.")].norm
            wgt = at[at.site.str.startswith("param.")].norm
            np.testing.assert_allclose(y, np.sqrt((upd**2).sum() / (wgt**2).sum()), rtol=1e-12)
    # the heatmaps: layers down, steps across, log10 of the grad_output norms
    grads = table[table.site == "grad_output"].pivot(index="layer", columns="step", values="norm")
    for kind, layers in (("block outputs", ["layer1", "layer2"]), ("other", ["conv1", "fc"])):
        ax = panel(heat, f"grad norm (grad_output) | {kind}")
        assert [t.get_text() for t in ax.get_yticklabels()] == layers
        want = np.log10(grads.loc[layers].to_numpy())
        np.testing.assert_allclose(np.asarray(ax.get_images()[0].get_array()), want, rtol=1e-12)
    # the loss panel holds the scalars
    scalars = probe.open_run(watched).train_scalars()
    loss = panel(lines, "training | loss").get_lines()[0]
    np.testing.assert_array_equal(loss.get_ydata(), scalars["loss"])
    norm = panel(lines, "training | global grad norm").get_lines()
    assert [ln.get_label() for ln in norm] == ["grad_norm", "grad_norm_preclip"]
    for ln in norm:
        np.testing.assert_array_equal(ln.get_ydata(), scalars[ln.get_label()])
    # one legend, beside the panels and smaller than one of them, the layers by depth
    (legend,) = lines.legends
    lines.canvas.draw()
    box, plot = legend.get_window_extent(), ax.get_window_extent()
    assert box.width * box.height < plot.width * plot.height
    assert [t.get_text() for t in legend.get_texts()] == PROBES["net"]["layers"]


def test_many_layers_get_a_depth_colour_bar_not_a_legend():
    steps = np.arange(3)
    frame = pd.DataFrame({f"l{i}": steps * i for i in range(12)}, index=steps)
    fig = lines_figure({"abs_mean (output)": frame})
    assert not fig.legends and len(fig.axes) == 2  # the panel ("other" modules), its colour bar
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


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """A 30-block Llama (width 8) watched for 3 clipped AdamW steps over DEEP_PROBES: each
    block's output and output gradient, its attention and MLP outputs, the final norm, and the
    parameters of block 0's q_proj (watched for nothing else), block 15's down_proj and lm_head.
    Block 20's MLP writes 1000x its weight (a massive activation: the residual's std jumps), and
    the global norm before clipping is kept by hand."""
    out = tmp_path_factory.mktemp("deep") / "w"
    model = deep_llama(width=8)
    with torch.no_grad():
        model.model.layers[20].mlp.down_proj.weight.mul_(1000.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    preclip = []
    with one_thread(), probe.watch(model, DEEP_PROBES, out=out, optimizer=opt) as w:
        for batch in token_batches(3):
            opt.zero_grad()
            loss = token_loss(model, batch)
            loss.backward()
            w.loss(loss)
            preclip.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
            opt.step()
    return out, preclip


BLOCK = re.compile(r"^model\.layers\.(\d+)")
KINDS = {"block outputs": r"^model\.layers\.\d+$", "attention": r"^model\.layers\.\d+\.self_attn$",
         "MLP": r"^model\.layers\.\d+\.mlp$", "other": r"^model\.norm$"}  # fmt: skip
OUTPUT_STATS = ("abs_mean (output)", "std (output)", "dead_frac (output)")


def depth_of(colour, bar) -> float:
    """The depth a colour says on the figure's colour bar (the nearest of 4096 colours)."""
    ts = np.linspace(0, 1, 4096)
    nearest = ts[np.abs(bar.cmap(ts)[:, :3] - np.asarray(colour)[:3]).sum(axis=1).argmin()]
    return float(bar.norm.inverse(nearest))


def squashed(lines: pd.DataFrame) -> bool:
    """Whether on a linear axis from 0 up some line (a column) would stay in the bottom tenth:
    its highest value below a tenth of the highest of all."""
    peaks = lines.max()
    peaks = peaks[peaks > 0]
    return bool(peaks.min() < 0.1 * peaks.max())


def test_a_30_block_model_reads_by_kind_scale_and_depth(deep):
    out, preclip = deep
    run = probe.open_run(out)
    table = pd.read_csv(out / "train.csv")
    assert table.layer.nunique() == 94  # 30 x (block, attention, MLP), the final norm, 3 params
    scalars = run.train_scalars()
    if "grad_norm_preclip" not in scalars:  # the norm before clipping, where the file lacks it
        scalars = scalars.assign(grad_norm_preclip=preclip)
    order = list(run.config["modules"])
    made = train_figures(run.train(), scalars, "deep", order)
    lines, heat = made["train_lines.png"], made["train_heatmap.png"]
    outputs = table[table.site.isin(["output", "output.0"])]
    (bar,) = [ax._colorbar for ax in lines.axes if hasattr(ax, "_colorbar")]
    scales = set()
    for stat in OUTPUT_STATS:
        panels = kinds_of(lines, stat)
        assert set(panels) == set(KINDS)  # a panel per kind, each of its kind alone
        for kind, ax in panels.items():
            names = [ln.get_label() for ln in ax.get_lines()]
            assert names and all(re.match(KINDS[kind], n) for n in names), (stat, kind)
            column = stat.split(" ")[0]
            want = outputs[outputs.layer.isin(names)]
            for line in ax.get_lines():  # drawn values: train.csv's
                rows = want[want.layer == line.get_label()].sort_values("step")
                np.testing.assert_array_equal(line.get_xdata(), rows.step)
                np.testing.assert_array_equal(line.get_ydata(), rows[column])
            lines_of = want.pivot(index="step", columns="layer", values=column)
            expected = "linear"
            if column != "dead_frac" and squashed(lines_of):
                expected = "log" if (lines_of.to_numpy() > 0).all() else "symlog"
            assert ax.get_yscale() == expected, (stat, kind)
            assert ax.get_ylabel().endswith(f" ({expected})") == (expected != "linear")
            scales.add(ax.get_yscale())
        assert len(panels["block outputs"].get_lines()) == 30
    assert scales == {"log", "linear"}  # the massive activation's std is drawn on a log scale
    # the parameters: one panel per statistic, the three modules, each in a colour of its own
    # named by the panel's legend (in depth order)
    params = ["model.layers.0.self_attn.q_proj", "model.layers.15.mlp.down_proj", "lm_head"]
    for stat in ("grad norm (param_grad)", "update / weight"):
        ax = panel(lines, f"{stat} | parameters")
        assert [ln.get_label() for ln in ax.get_lines()] == params
        legend = ax.get_legend()
        assert [t.get_text() for t in legend.get_texts()] == params
        drawn = [matplotlib.colors.to_rgb(ln.get_color()) for ln in ax.get_lines()]
        named = [matplotlib.colors.to_rgb(h.get_color()) for h in legend.legend_handles]
        assert named == drawn
        apart = [
            np.linalg.norm(np.subtract(a, b)) for i, a in enumerate(drawn) for b in drawn[i + 1 :]
        ]
        assert min(apart) > 0.3, apart  # (RGB distance: told apart at a glance)
    # every other line's colour says its module's depth: its block's index; the final norm
    # after the last block, deepest and darkest
    depths, lightness = {}, {}
    for ax in lines.axes:
        label = ax.get_label()
        if " | " in label and not label.startswith("training") and "parameters" not in label:
            for line in ax.get_lines():
                depths[line.get_label()] = depth_of(line.get_color(), bar)
                rgb = np.asarray(matplotlib.colors.to_rgb(line.get_color()))
                lightness[line.get_label()] = rgb @ [0.2126, 0.7152, 0.0722]
    assert len(depths) == 91
    for name, d in depths.items():
        block = BLOCK.match(name)
        if block:
            assert int(block.group(1)) < d < int(block.group(1)) + 1, (name, d)
        else:
            assert d >= 30, (name, d)
    assert max(depths, key=depths.get) == "model.norm" == min(lightness, key=lightness.get)
    for i in range(30):  # within a block: attention, MLP, the block's output
        a, m, b = (depths[f"model.layers.{i}{s}"] for s in (".self_attn", ".mlp", ""))
        assert a < m < b
    # the colour bar: its numbered ticks at their blocks, the modules after them by name
    ticks = dict(zip(bar.get_ticks(), [t.get_text() for t in bar.ax.get_yticklabels()],
                     strict=True))  # fmt: skip
    assert "block index" in bar.ax.get_ylabel()
    assert all(float(label) + 0.5 == t for t, label in ticks.items() if label.isdigit())
    assert {"0", "model.norm"} <= set(ticks.values()) and "lm_head" not in ticks.values()
    assert depths["model.norm"] == pytest.approx(max(ticks), abs=0.1)
    # the training panel: the norm after clipping and before it
    ax = panel(lines, "training | global grad norm")
    drawn = {ln.get_label(): ln.get_ydata() for ln in ax.get_lines()}
    assert set(drawn) == {"grad_norm", "grad_norm_preclip"}
    np.testing.assert_array_equal(drawn["grad_norm"], scalars["grad_norm"])
    np.testing.assert_allclose(drawn["grad_norm_preclip"], preclip, rtol=1e-5)
    # the heatmaps: every row labelled, rows by depth, the values train.csv's (log10 where
    # the panel is log)
    for ax in heat.axes:
        if " | " not in ax.get_label():
            continue  # a colour bar
        stat, kind = ax.get_label().split(" | ")
        title = ax.get_title()
        pattern = title.split(": ")[1] if ": " in title else ""
        labels = [t.get_text() for t in ax.get_yticklabels()]
        values = np.asarray(ax.get_images()[0].get_array())
        assert list(ax.get_yticks()) == list(range(values.shape[0])) and all(labels)
        names = [pattern.replace("*", lb) if pattern else lb for lb in labels]
        if kind in KINDS:
            assert all(re.match(KINDS[kind], n) for n in names)
        else:
            assert names == params
        blocks = [int(BLOCK.match(n).group(1)) if BLOCK.match(n) else 99 for n in names]
        assert blocks == sorted(blocks)
        if stat in OUTPUT_STATS:
            rows = outputs.pivot(index="layer", columns="step", values=stat.split(" ")[0])
            want = rows.loc[names].to_numpy()
            if title.startswith("log10"):
                want = np.log10(want)
            np.testing.assert_allclose(values, want, rtol=1e-12)


def test_past_48_rows_a_heatmap_labels_each_block_once():
    names = [f"model.layers.{i}.self_attn.{p}_proj" for i in range(30) for p in "qkvo"]
    frame = pd.DataFrame(np.ones((2, len(names))), columns=names)
    fig = heatmap_figure({"std (output)": frame})
    (ax,) = [ax for ax in fig.axes if ax.get_label() == "std (output) | attention"]
    assert list(ax.get_yticks()) == list(range(0, 120, 4))
    assert [t.get_text() for t in ax.get_yticklabels()] == [str(i) for i in range(30)]
    assert ax.get_title().endswith(": model.layers.*")


@pytest.mark.parametrize(("name", "kind"), [
    ("transformer.h.3", "block outputs"), ("transformer.h.3.attn", "attention"),
    ("transformer.h.3.attn.c_proj", "attention"), ("transformer.h.3.mlp", "MLP"),
    ("transformer.h.3.ln_1", "other"), ("transformer.ln_f", "other"), ("lm_head", "other"),
    ("bert.encoder.layer.2.attention.self", "attention"),
    ("bert.encoder.layer.2.attention.output.dense", "attention"),
    ("bert.encoder.layer.2.intermediate", "MLP"), ("bert.encoder.layer.2.output.dense", "MLP"),
    ("gpt_neox.layers.1.attention", "attention"), ("layer1.0", "block outputs"),
])  # fmt: skip
def test_kinds_by_name(name, kind):
    assert kind_of(name) == kind


def test_depth_counts_on_across_lists_of_blocks_and_types_name_a_block():
    order = ["conv1", "layer1.0", "layer1.1", "layer2.0", "layer2.0.conv1", "fc"]
    found = places(order)
    deep = ["conv1", "layer1.0", "layer1.1", "layer2.0.conv1", "layer2.0", "fc"]  # a block last
    assert sorted(order, key=lambda n: found[n].depth) == deep
    assert [found[n].depth for n in ("layer1.0", "layer1.1", "layer2.0")] == [0.5, 1.5, 2.75]
    assert kind_of("encoder", "T5Block") == "block outputs"
    assert kind_of("blocks.0.attn_thing", "MyAttention") == "attention"


def test_the_scale_is_chosen_by_how_the_lines_would_look_on_a_linear_axis():
    """30 block outputs at levels 1 to 60 (84x from the lowest value to the highest, below the
    100x a fixed rule would need) squash the lowest blocks into the bottom of a linear axis: log.
    30 lines that each rise 150x over the steps to about the same height are all legible on a
    linear axis: linear. The choice is checked against matplotlib's own linear axis from 0:
    the fraction of its height the lowest line reaches."""
    import matplotlib.pyplot as plt

    steps = np.arange(10)
    blocks = [f"model.layers.{i}" for i in range(30)]
    wobble = 1 + 0.4 * (steps % 2)[:, None]  # each line between its level and 1.4x it
    spread = pd.DataFrame(np.geomspace(1, 60, 30)[None, :] * wobble, steps, blocks)
    rising = pd.DataFrame(np.geomspace(0.01, 1.5, 10)[:, None] * np.linspace(0.8, 1.2, 30), steps,
                          blocks)  # fmt: skip
    ratio = [f.to_numpy().max() / f.to_numpy().min() for f in (spread, rising)]
    assert ratio[0] == pytest.approx(84) and ratio[1] > 100
    for frame, want in ((spread, "log"), (rising, "linear")):
        fig = lines_figure({"std (output)": frame})
        ax = panel(fig, "std (output) | block outputs")
        assert ax.get_yscale() == want
        linear = plt.figure().add_subplot()
        for column in frame:
            linear.plot(frame.index, frame[column])
        linear.set_ylim(bottom=0)
        reach = frame.max().min() / linear.get_ylim()[1]
        assert (reach < 0.1) == (want == "log"), reach
        plt.close("all")


@pytest.fixture(scope="module")
def warmup(tmp_path_factory):
    """The small CNN trained 4 steps with a linear warmup: the learning rate is 0 at step 0."""
    out = tmp_path_factory.mktemp("warmup") / "w"
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ramp = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: step / 2)
    with one_thread(), probe.watch(model, PROBES, out=out, optimizer=opt) as w:
        for batch in image_batches(4):
            opt.zero_grad()
            image_loss(model, batch).backward()
            opt.step()
            ramp.step()
        steps = w.step_count
    return out, steps


def test_a_step_whose_learning_rate_is_0_is_left_out_of_update_per_weight_with_a_note(warmup):
    """At step 0 the learning rate is 0: no weight moves, update/weight is 0. The figure leaves
    the step out and says why in the panel (a zero on its log axis would be a drop to its
    bottom); the other steps are train.csv's ratios."""
    out, steps = warmup
    run = probe.open_run(out)
    scalars = run.train_scalars()
    assert steps == 4 and list(scalars["lr.0"]) == [0.05 * s / 2 for s in range(4)]
    table = run.train()
    frames = run.train_series()
    assert (frames["update / weight"].loc[0] == 0).all()  # the values themselves keep it
    fig = train_figures(table, scalars, "warmup")["train_lines.png"]
    ax = panel(fig, "update / weight | parameters")
    assert [t.get_text() for t in ax.texts] == ["step 0 left out: learning rate 0, no update"]
    for line in ax.get_lines():
        assert list(line.get_xdata()) == [1, 2, 3]
        rows = table[table.layer == line.get_label()]
        for step, y in zip(line.get_xdata(), line.get_ydata(), strict=True):
            at = rows[rows.step == step]
            upd = at[at.site.str.startswith("param_update.")].norm
            wgt = at[at.site.str.startswith("param.")].norm
            np.testing.assert_allclose(y, np.sqrt((upd**2).sum() / (wgt**2).sum()), rtol=1e-12)
    grads = panel(fig, "grad norm (param_grad) | parameters")  # (its gradients are there)
    assert all(list(line.get_xdata()) == [0, 1, 2, 3] for line in grads.get_lines())
