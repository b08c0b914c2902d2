"""probe.analysis.plot figures read back against the stored data, and probe.analysis.report's one-page HTML."""

from __future__ import annotations

import shutil
import subprocess
from html.parser import HTMLParser

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from probe.analysis.plot import figures, main  # noqa: E402
from probe.analysis.reading import open_run  # noqa: E402
from probe.analysis.report import write  # noqa: E402
from probe.launch.run import run  # noqa: E402
from tests.helpers import cli, make_cfg  # noqa: E402

TINYNET = [
    "model=custom",
    "model._target_=tests.models_for_tests.TinyNet",
    "model.input_shape=[3,8,8]",
    "model.num_classes=10",
    "dataset.batch_size=3",
    "probes=none",
    "+probes.all.layers=[conv,relu,fc]",
    "+probes.all.capture=[output,grad_output]",
    "+probes.pg.layers=[conv,fc]",
    "+probes.pg.capture=[param_grad]",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("run")
    run(make_cfg(*TINYNET, "dataset.num_samples=6"), run_dir=path)
    return path


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    out = cli("-m", *TINYNET, "dataset.num_samples=4,6", f"hydra.sweep.dir={root}", cwd=root)
    assert out.returncode == 0, out.stderr
    return root


def test_run_figures_hold_the_stored_values(tiny):
    _, made = figures(tiny, sample=2)
    with open_run(tiny) as r:
        summary = r.summary
        out = summary[summary.site == "output"]
        depth = made["depth.png"]
        assert "custom TinyNet" in depth._suptitle.get_text()
        assert "6 samples" in depth._suptitle.get_text()
        band_ax = depth.axes[0]
        (line,) = band_ax.get_lines()
        np.testing.assert_array_equal(line.get_ydata(), out["mean"].to_numpy())
        band = band_ax.collections[0].get_paths()[0].vertices[:, 1]
        assert np.isclose(band, out["p01"].to_numpy()[:, None]).any(axis=1).all()
        assert np.isclose(band, out["p99"].to_numpy()[:, None]).any(axis=1).all()
        assert np.isclose(out["p99"].to_numpy()[:, None], band).any(axis=1).all()
        np.testing.assert_array_equal(
            depth.axes[2].get_lines()[0].get_ydata(), out["dead_frac"].to_numpy()
        )
        grads = made["gradients.png"]
        titles = [ax.get_title() for ax in grads.axes if ax.patches]
        assert "conv grad_output" in titles and "fc param_grad.weight" in titles
        for ax in grads.axes:
            if ax.patches:
                layer, site = ax.get_title().split(" ")
                n = summary.set_index(["layer", "site"]).loc[(layer, site), "n"]
                assert sum(p.get_height() for p in ax.patches) == n
        maps = made["features_conv_output_2.png"]
        row = r.array("conv")[2]
        images = [ax.images[0] for ax in maps.axes if ax.images]
        assert len(images) == row.shape[0]
        for c, image in enumerate(images):
            np.testing.assert_array_equal(np.asarray(image.get_array()), row[c])
            assert image.get_clim() == (row.min(), row.max())
        assert len(maps.axes) == 4 + 1  # the maps and one colour bar
        heat = made["linear.png"].axes[0].images[0]
        np.testing.assert_array_equal(np.asarray(heat.get_array()), r.array("fc")[:].T)


def test_sweep_legend_names_only_the_differing_override(sweep):
    _, made = figures(sweep)
    legend = made["depth.png"].axes[0].get_legend()
    labels = [t.get_text() for t in legend.get_texts()]
    assert labels == ["0: dataset.num_samples=4", "1: dataset.num_samples=6"]


def test_plot_command_writes_pngs_and_reports_errors(tiny, capsys):
    assert main([str(tiny)]) == 0
    for name in ("depth.png", "histograms.png", "gradients.png", "linear.png"):
        assert (tiny / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main([str(tiny), "--layer", "nope"]) == 2
    assert "nope" in capsys.readouterr().err


class Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.images, self.cells, self.pre, self.links, self._in = [], [], [], [], None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "img":
            self.images.append(a)
        if tag == "a":
            self.links.append(a.get("href"))
        self._in = tag

    def handle_data(self, data):
        if self._in == "td":
            self.cells.append(data.strip())
        if self._in == "pre":
            self.pre.append(data)


def test_run_report_is_one_self_contained_page(tiny):
    out = write(tiny, analyze="yes")
    text = out.read_text()
    page = Page()
    page.feed(text)
    assert len(page.images) >= 6  # 5 figures and the CKA heatmap
    assert all(i["src"].startswith("data:image/png;base64,") for i in page.images)
    assert 'src="http' not in text and "<link" not in text and "<script" not in text
    summary = open_run(tiny).summary
    assert set(summary["layer"]) <= set(page.cells)
    assert str(summary["n"].iloc[0]) in page.cells
    assert "Linear probes" in text and "accuracy" in text
    assert "tests.models_for_tests.TinyNet" in "".join(page.pre)
    browser = next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)
    if browser is None:
        pytest.skip("no headless Chromium installed (apt install chromium)")
    dom = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--dump-dom", out.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert dom.returncode == 0 and "Summary (summary.csv)" in dom.stdout


BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def test_sweep_report_gathers_the_runs(sweep):
    out = write(sweep, analyze="no")
    page = Page()
    page.feed(out.read_text())
    assert page.images and page.images[0]["src"].startswith("data:image/png;base64,")
    assert "0/report.html" in page.links and "1/report.html" in page.links
    assert (sweep / "1" / "report.html").is_file()
    assert "dataset.num_samples" in out.read_text()
