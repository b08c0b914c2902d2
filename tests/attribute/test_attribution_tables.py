"""attribution.csv against numpy over the stored maps; the CLI with the shipped probe files, the
Python API on the same path, a sweep's gathered table, and the figures drawn from a run."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

import probe
from probe.plan import parse
from tests.helpers import cli, run_probe

RESNET = [
    "model=resnet18", "model.num_classes=10", "dataset.image_size=64", "dataset.num_samples=5",
    "dataset.batch_size=2", "objective=logit", "objective.index=predicted",
]  # fmt: skip


def test_attribution_csv_equals_numpy_over_the_stored_maps(tmp_path):
    args = [*RESNET, "probes=attributions", "+probes.cams.layers=[layer4]",
            "+probes.cams.capture=[gradcam,ig_output]", "attribution.steps=4"]  # fmt: skip
    result, f = run_probe(tmp_path, *args)
    table = pd.read_csv(tmp_path / "attribution.csv")
    assert set(table.site) == {"grad_x_output", "gradcam", "ig_output"}
    assert sorted(set(table.layer)) == sorted(f["layers"])  # every block, and layer4
    for row in table.itertuples():
        a = f[f"layers/{row.layer}/{row.site}"][:].astype(np.float64)
        np.testing.assert_allclose(
            [row.mean, row.abs_mean, row.frac_positive],
            [a.mean(), np.abs(a).mean(), (a > 0).mean()],
            rtol=1e-9,
        )
        totals = f[f"layers/{row.layer}/{row.site}.sum"][:].astype(np.float64)  # float32 rows
        np.testing.assert_allclose(totals, a.reshape(len(a), -1).sum(1), rtol=1e-5)
        np.testing.assert_allclose([row.sum_mean, row.sum_std], [totals.mean(), totals.std()])
        if a.ndim == 4:  # channel sites: the units with the largest mean |attribution|
            per_unit = np.abs(a).sum((2, 3)).mean(0)
            assert [int(u) for u in row.top_units.split()] == list(np.argsort(-per_unit)[:5])
        if row.site == "ig_output":
            gap = f[f"layers/{row.layer}/ig_output.gap"][:].astype(np.float64)
            np.testing.assert_allclose(row.gap_mean, gap.mean(), rtol=1e-6, atol=1e-12)


def test_the_cli_with_the_shipped_cams_and_the_python_api_write_the_same_maps(tmp_path):
    """`python -m probe probes=cams objective=logit objective.index=predicted` and probe.run with
    the same probe and objective as mappings, on the same model and inputs."""
    from probe.data.batches import build_batches
    from probe.models.build import build_model
    from probe.testing.compose import make_cfg

    out = cli(*RESNET, "probes=cams", f"hydra.run.dir={tmp_path / 'cli'}")
    assert out.returncode == 0, out.stderr[-2000:]
    cfg = make_cfg(*RESNET)
    plan = parse(cfg)
    model = build_model(plan.model, cfg.seed)
    batches = [b.inputs for b in build_batches(plan.data, plan.model, cfg.seed, model)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (the backward on several CPU threads varies in its last bits)
    try:
        api = probe.run(
            model, batches, {"cam": {"layers": ["layer4"], "capture": ["gradcam", "layercam"]}},
            out=tmp_path / "api", objective={"name": "logit", "index": "predicted"},
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    with probe.open_run(tmp_path / "cli") as shipped, api:
        assert shipped.layers == ["layer4"]
        for site in ("gradcam", "layercam"):
            np.testing.assert_allclose(
                np.asarray(api.array("layer4", site)), np.asarray(shipped.array("layer4", site)),
                rtol=1e-5, atol=1e-7,
            )  # fmt: skip


def test_a_sweep_gathers_every_runs_attribution_table(tmp_path):
    out = cli(
        "-m", *RESNET, "probes=attributions", "objective.index=1,2",
        f"hydra.sweep.dir={tmp_path}",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    done = cli_summarize(tmp_path)
    assert done.returncode == 0, done.stderr
    gathered = pd.read_csv(tmp_path / "attribution.csv", dtype={"run": str})
    for job in ("0", "1"):
        own = pd.read_csv(tmp_path / job / "attribution.csv")
        part = gathered[gathered.run == job].reset_index(drop=True)
        assert (part["objective.index"] == int(job) + 1).all()
        pd.testing.assert_frame_equal(part[own.columns], own)
    pd.testing.assert_frame_equal(probe.open_sweep(tmp_path).attribution, gathered)


def cli_summarize(path):
    import subprocess
    import sys

    from tests.helpers import ROOT

    return subprocess.run(
        [sys.executable, "-m", "probe.summarize", str(path)], cwd=ROOT, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip


@pytest.mark.parametrize("kind", ["images", "tokens"])
def test_the_figures_draw_the_stored_maps(tmp_path, kind, tiny_gpt2):
    """cams.png shows each stored map on its own symmetric scale; a token run's coloured text
    has one box per real token, coloured by the attribution summed over features."""
    pytest.importorskip("matplotlib")
    from probe.report.figures import figures

    if kind == "images":
        args = [*RESNET, "probes=cams"]
    else:
        model, tok = tiny_gpt2
        args = ["model=hf", f"model.name={model}", "model.task=causal_lm", f"dataset.tokenizer={tok}",
                "dataset=random_tokens", "dataset.num_samples=3", "dataset.seq_len=5",
                "probes=attributions", "objective=lm_loss"]  # fmt: skip
    run_probe(tmp_path, *args)
    _, drawn = figures(tmp_path)
    import matplotlib.pyplot as plt

    for name, fig in drawn.items():
        if name not in ("cams.png",) and not name.startswith("tokens_"):
            plt.close(fig)
    with probe.open_run(tmp_path) as run:
        if kind == "images":
            fig = drawn["cams.png"]
            images = [
                im for ax in fig.axes for im in ax.get_images() if im.get_cmap().name == "RdBu_r"
            ]
            want = np.asarray(run.array("layer4", "gradcam")[0])
            np.testing.assert_allclose(images[0].get_array(), want)
            low, high = images[0].get_clim()
            assert low == -high == -np.abs(want).max()
            plt.close("all")
            return
        layer = run.layers[0]
        fig = drawn[f"tokens_{layer}_grad_x_output.png"]
        boxes = [t for t in fig.axes[0].texts if t.get_bbox_patch() is not None]
        assert len(boxes) == 3 * 5
        values = np.asarray(run.array(layer, "grad_x_output")[0], dtype=np.float64).sum(-1)
        from matplotlib import colormaps

        limit = np.abs(values).max()
        want = [colormaps["RdBu_r"](0.5 + 0.5 * v / limit) for v in values]
        got = [b.get_bbox_patch().get_facecolor() for b in boxes[:5]]
        np.testing.assert_allclose(got, want, atol=1e-6)
        plt.close("all")
