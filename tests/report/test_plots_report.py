"""probe.report.figures figures read back against the stored data, and probe.report.page's one-page HTML."""

from __future__ import annotations

import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

plt = pytest.importorskip("matplotlib.pyplot")

from probe.launch.run import run  # noqa: E402
from probe.read.runs import open_run, open_sweep  # noqa: E402
from probe.report.figures import figures, main  # noqa: E402
from probe.report.page import write  # noqa: E402
from probe.testing.compose import make_cfg  # noqa: E402
from tests.helpers import cli  # noqa: E402

TINYNET = [
    "model=custom",
    "model._target_=probe.testing.models.TinyNet",
    "model.input_shape=[3,8,8]",
    "model.num_classes=10",
    "dataset.batch_size=3",
    "probes=none",
    "+probes.all.layers=[conv,relu,fc]",
    "+probes.all.capture=[output,grad_output]",
    "+probes.pg.layers=[conv,fc]",
    "+probes.pg.capture=[param_grad]",
]


EDIT = [
    "intervene=edit",
    "intervene.edit.layers=[conv]",
    "intervene.edit.op=scale",
    "intervene.edit.factor=0.5",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A run whose conv output is halved: its effects on the answer are in effects.csv."""
    path = tmp_path_factory.mktemp("run")
    run(make_cfg(*TINYNET, *EDIT, "dataset.num_samples=6"), run_dir=path)
    return path


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    args = ("-m", *TINYNET, *EDIT, "dataset.num_samples=4,6", f"hydra.sweep.dir={root}")
    out = cli(*args, cwd=root)
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
    """What a page holds: images, links, <pre> texts, and each table's rows of cells under the
    caption (the <h3>) before it."""

    def __init__(self, text: str):
        super().__init__()
        self.images, self.pre, self.links, self.tables = [], [], [], {}
        self._in, self._caption, self._rows = None, "", None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "img":
            self.images.append(a)
        elif tag == "a":
            self.links.append(a.get("href"))
        elif tag == "h3":
            self._caption = ""
        elif tag == "table":
            self._rows = self.tables.setdefault(self._caption, [])
        elif tag == "tr" and self._rows is not None:
            self._rows.append([])
        elif tag in ("td", "th") and self._rows:
            self._rows[-1].append("")
        self._in = tag

    def handle_endtag(self, tag):
        if tag == "table":
            self._rows = None
        self._in = None

    def handle_data(self, data):
        if self._in == "pre":
            self.pre.append(data)
        elif self._in == "h3":
            self._caption += data.strip()
        elif self._in in ("td", "th") and self._rows:
            self._rows[-1][-1] += data.strip()

    def frame(self, caption: str) -> pd.DataFrame:
        """The table under `caption` as strings, its header row as the columns."""
        head, *rows = self.tables[caption]
        return pd.DataFrame(rows, columns=head)


BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def rendered(page: Path, shot: Path) -> tuple[Page, np.ndarray]:
    """The DOM a headless Chromium builds from `page`, and a screenshot of its top 1000x2400
    pixels (RGB in [0, 1]) written to `shot`."""
    browser = next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)
    if browser is None:
        pytest.skip("no headless Chromium installed (apt install chromium)")
    flags = [browser, "--headless", "--no-sandbox", "--hide-scrollbars", "--window-size=1000,2400"]
    for extra in ("--dump-dom", f"--screenshot={shot}"):
        done = subprocess.run(
            [*flags, extra, page.as_uri()], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr[-2000:]
        if extra == "--dump-dom":
            dom = done.stdout
    return Page(dom), plt.imread(shot)[..., :3]


def coloured(pixels: np.ndarray) -> int:
    """Pixels of a clear colour: the figures' (the page's text and rules are grey)."""
    return int((pixels.max(axis=-1) - pixels.min(axis=-1) > 0.25).sum())


def assert_shown(page: Page, frame: pd.DataFrame, caption: str) -> None:
    """The table under `caption` shows `frame`: the same columns, text equal, numbers to the
    precision pandas prints (six decimals, or six significant digits in scientific notation)."""
    shown = page.frame(caption)
    assert list(shown.columns) == list(frame.columns), caption
    assert len(shown) == len(frame), caption
    for name in frame.columns:
        want = frame[name]
        if pd.api.types.is_numeric_dtype(want):
            got = pd.to_numeric(shown[name].replace("", np.nan))
            np.testing.assert_allclose(
                got, want.astype(float), rtol=1e-6, atol=5.1e-7, err_msg=name
            )
        else:
            assert shown[name].tolist() == want.fillna("").astype(str).tolist(), name


def test_run_report_is_one_self_contained_page_a_browser_shows(tiny, tmp_path):
    out = write(tiny, analyze="yes")
    text = out.read_text()
    page = Page(text)
    assert len(page.images) >= 6  # 5 figures and the CKA heatmap
    assert all(i["src"].startswith("data:image/png;base64,") for i in page.images)
    assert 'src="http' not in text and "<link" not in text and "<script" not in text
    assert "probe.testing.models.TinyNet" in "".join(page.pre)
    shown, pixels = rendered(out, tmp_path / "run.png")
    with open_run(tiny) as r:
        summary, effects = r.summary, r.effects
    assert_shown(shown, summary, "Summary (summary.csv)")
    assert_shown(
        shown, pd.read_csv(tiny / "linear_probes.csv"), "Linear probes (linear_probes.csv)"
    )
    assert_shown(shown, pd.read_csv(tiny / "effects.csv"), "Effects (effects.csv)")
    assert len(effects) == 1 and effects["samples"].iloc[0] == 6
    assert [i["alt"] for i in shown.images] == [i["alt"] for i in page.images]
    assert "cka" in [i["alt"] for i in shown.images]
    # the figures are decoded and drawn: the same page without its images shows no colour
    bare = tmp_path / "bare.html"
    bare.write_text(re.sub(r"<img [^>]*>", "", text))
    _, blank = rendered(bare, tmp_path / "bare.png")
    assert coloured(blank) == 0 and coloured(pixels) > 10_000


def test_sweep_report_gathers_the_runs_a_browser_shows(sweep, tmp_path):
    out = write(sweep, analyze="yes")
    page = Page(out.read_text())
    assert page.images and page.images[0]["src"].startswith("data:image/png;base64,")
    assert "0/report.html" in page.links and "1/report.html" in page.links
    assert (sweep / "1" / "report.html").is_file()
    assert "dataset.num_samples" in out.read_text()
    shown, pixels = rendered(out, tmp_path / "sweep.png")
    gathered = open_sweep(sweep).effects
    assert sorted(gathered["samples"]) == [4, 6]  # one row per job, each job's own effects.csv
    for job in ("0", "1"):
        own = pd.read_csv(sweep / job / "effects.csv").iloc[0]
        row = gathered[gathered["run"].astype(str) == job].iloc[0]
        assert row["mean_abs_change"] == pytest.approx(own["mean_abs_change"], rel=1e-12)
    assert_shown(shown, gathered, "Effects of every run")
    cka = pd.read_csv(sweep / "cka.csv")  # the same model and seed: runs 0 and 1 share 4 samples
    same = cka[(cka.layer_a == cka.layer_b) & (cka.site_a == cka.site_b)]
    assert set(zip(cka.run_a, cka.run_b, strict=True)) == {(0, 1)} and len(same) >= 3
    assert (same.samples == 4).all() and np.allclose(same.cka, 1.0, atol=1e-9)
    assert "cka" in [i["alt"] for i in shown.images] and coloured(pixels) > 10_000


def test_the_title_says_the_runs_own_sample_count_and_none_for_no_probes():
    """A run of every sample (dataset.num_samples null) and no probes (a graphs-only run): the
    title counts the file's samples, and says `probes none`, never None."""
    from probe.report.figures import run_title

    config = {"model": {"name": "gpt2"}, "probes": None, "dataset": {"num_samples": None}}
    assert (
        run_title(config, "r", 12) == "run r | model gpt2 | probes none | 12 samples | objective ?"
    )
    assert "| all samples |" in run_title(config)
    assert "probes a, b | 5 samples" in run_title({"probes": {"a": {}, "b": {}}}, samples=5)
