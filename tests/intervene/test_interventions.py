"""Edits of inputs, outputs and gradients change exactly what they should."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from torch import nn

import probe
from probe.data.batches import build_batches
from probe.models.build import build_model
from probe.plan import parse
from probe.testing.compose import make_cfg
from tests.helpers import ROOT, cli, run_probe

SMALL = ["model=resnet18", "dataset.image_size=32", "dataset.num_samples=5", "dataset.batch_size=2"]


def _clean_model_and_inputs(*over):
    cfg = make_cfg(*SMALL, *over)
    model = build_model(parse(cfg).model, cfg.seed)
    inputs = torch.cat(
        [b.inputs for b in build_batches(parse(cfg).data, parse(cfg).model, cfg.seed)]
    )
    return model, inputs


def test_zeroing_layer4_leaves_only_the_fc_bias(tmp_path):
    result, f = run_probe(tmp_path, *SMALL, "intervene=zero_layer4", "probes=all_linear")
    model, inputs = _clean_model_and_inputs()
    bias = model.fc.bias.detach().numpy()
    np.testing.assert_allclose(
        f["layers/fc/output"][:], np.broadcast_to(bias, (5, 1000)), rtol=1e-6, atol=1e-7
    )
    np.testing.assert_allclose(f["model/output"][:], f["layers/fc/output"][:])
    with torch.no_grad():
        clean = model(inputs).numpy()
    np.testing.assert_allclose(f["model/output_clean"][:], clean, rtol=1e-4, atol=1e-5)
    effects = pd.read_csv(tmp_path / "effects.csv")
    np.testing.assert_allclose(effects.mean_abs_change[0], np.abs(clean - bias).mean(), rtol=1e-5)
    changed = (clean.argmax(1) != bias.argmax()).mean()
    np.testing.assert_allclose(effects.frac_argmax_changed[0], changed)
    targets = f["samples/target"][:]
    np.testing.assert_allclose(effects.accuracy_clean[0], (clean.argmax(1) == targets).mean())
    np.testing.assert_allclose(effects.accuracy_edited[0], (bias.argmax() == targets).mean())
    assert '"op": "zero"' in f.attrs["edits"] and '"layer": "layer4"' in f.attrs["edits"]


def test_scaling_a_grad_output_doubles_every_earlier_gradient(tmp_path):
    probes = [
        "probes=grads_all_convs",
        "probes.convs.types=[Conv2d,BasicBlock,Linear,Sequential]",
        "probes.convs.exclude=[layer?.?.*]",
    ]
    edit = [
        "intervene=edit",
        "intervene.edit.layers=[layer4]",
        "intervene.edit.site=grad_output",
        "intervene.edit.op=scale",
        "intervene.edit.factor=2.0",
    ]
    _, plain = run_probe(tmp_path / "plain", *SMALL, *probes)
    _, edited = run_probe(tmp_path / "edited", *SMALL, *probes, *edit)
    layers = list(plain["layers"])
    assert "layer4" in layers and "conv1" in layers and "fc" in layers
    # fc is later; layer4.1's output is the very tensor the edit hooks, seen before the edit;
    # layer4 itself records the edited gradient, and every earlier layer receives it
    unchanged = {"fc", "layer4.1"}
    for name in layers:
        np.testing.assert_array_equal(
            edited[f"layers/{name}/output"][:], plain[f"layers/{name}/output"][:]
        )
        g0, g1 = plain[f"layers/{name}/grad_output"][:], edited[f"layers/{name}/grad_output"][:]
        factor = 1.0 if name in unchanged else 2.0
        np.testing.assert_allclose(
            g1, factor * g0, rtol=1e-5, atol=1e-6 * np.abs(g0).max(), err_msg=name
        )


class Multiply(nn.Module):
    def forward(self, a, b):
        return a * b


class MultiplyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.mul = Multiply()

    def forward(self, pair):
        return self.mul(pair[:, 0], pair[:, 1])


def test_gradient_edit_worked_example(tmp_path):
    """c = a * b with a=7, b=13 and +2 on the gradient of c: a.grad 39, b.grad 21 (c.grad 3)."""
    torch.save(torch.tensor([[7.0, 13.0]]), tmp_path / "ab.pt")
    _, f = run_probe(
        tmp_path,
        "model=custom",
        "model._target_=tests.intervene.test_interventions.MultiplyModel",
        "dataset=tensors",
        f"dataset.path={tmp_path / 'ab.pt'}",
        "objective=output_sum",
        "probes=all_convs",
        "probes.convs.types=[]",
        "probes.convs.layers=[mul]",
        "probes.convs.capture=[grad_output,grad_input]",
        "probes.convs.unedited=true",
        "intervene=edit",
        "intervene.edit.layers=[mul]",
        "intervene.edit.site=grad_output",
        "intervene.edit.op=add",
        "intervene.edit.value=2.0",
    )
    assert f["layers/mul/grad_input.0"][0] == 39.0
    assert f["layers/mul/grad_input.1"][0] == 21.0
    assert f["layers/mul/grad_output"][0] == 3.0
    assert f["layers/mul/unedited_grad_output"][0] == 1.0


def test_noise_is_reproducible_and_seeded(tmp_path):
    over = [*SMALL, "intervene=noise_convs", "probes=all_convs", "probes.convs.layers=[layer1.*]"]
    _, a = run_probe(tmp_path / "a", *over)
    _, b = run_probe(tmp_path / "b", *over, "dataset.batch_size=3")  # batching does not matter
    _, c = run_probe(tmp_path / "c", *over, "intervene.noise_convs.seed=123")
    _, clean = run_probe(
        tmp_path / "clean", *SMALL, "probes=all_convs", "probes.convs.layers=[layer1.*]"
    )
    for name in a["layers"]:
        x = a[f"layers/{name}/output"][:]
        np.testing.assert_allclose(b[f"layers/{name}/output"][:], x, rtol=1e-5, atol=1e-5)
        assert not np.allclose(c[f"layers/{name}/output"][:], x, atol=1e-3)
    # noise on one conv only: the difference from a clean run is the noise itself, std 0.1
    _, one = run_probe(tmp_path / "one", *over, "intervene.noise_convs.layers=[layer1.0.conv1]")
    diff = one["layers/layer1.0.conv1/output"][:] - clean["layers/layer1.0.conv1/output"][:]
    assert abs(diff.std() - 0.1) < 0.005 and abs(diff.mean()) < 0.005


def test_input_edit_changes_the_output_as_the_edited_input_would(tmp_path):
    _, f = run_probe(
        tmp_path,
        *SMALL,
        "probes=all_convs",
        "probes.convs.layers=[layer1.0.conv1]",
        "probes.convs.capture=[input,output]",
        "probes.convs.unedited=true",
        "intervene=edit",
        "intervene.edit.layers=[layer1.0.conv1]",
        "intervene.edit.site=input",
        "intervene.edit.op=scale",
        "intervene.edit.factor=3.0",
    )
    model, _ = _clean_model_and_inputs()
    x = torch.from_numpy(f["layers/layer1.0.conv1/input"][:])
    np.testing.assert_allclose(
        x.numpy(), 3 * f["layers/layer1.0.conv1/unedited_input"][:], rtol=1e-6
    )
    with torch.no_grad():
        expected = model.layer1[0].conv1(x).numpy()
    np.testing.assert_allclose(f["layers/layer1.0.conv1/output"][:], expected, rtol=1e-5, atol=1e-5)


def test_channel_subset_and_first_pass_mean(tmp_path):
    _, clean = run_probe(
        tmp_path / "clean",
        *SMALL,
        "probes=all_convs",
        "probes.convs.types=[]",
        "probes.convs.layers=[layer3]",
    )
    _, f = run_probe(
        tmp_path / "mean",
        *SMALL,
        "intervene=mean_layer3",
        "intervene.mean_layer3.channels=[0,5,7]",
        "probes=all_convs",
        "probes.convs.types=[]",
        "probes.convs.layers=[layer3]",
    )
    x0, x1 = clean["layers/layer3/output"][:], f["layers/layer3/output"][:]
    np.testing.assert_allclose(
        x1[:, [0, 5, 7]],
        np.broadcast_to(x0[:, [0, 5, 7]].mean(0), (5, 3, 2, 2)),
        rtol=1e-5,
        atol=1e-6,
    )
    others = [c for c in range(x0.shape[1]) if c not in (0, 5, 7)]
    np.testing.assert_array_equal(x1[:, others], x0[:, others])
    # the same mean read from the earlier run's file
    _, g = run_probe(
        tmp_path / "file",
        *SMALL,
        "intervene=mean_layer3",
        f"intervene.mean_layer3.source={tmp_path / 'clean' / 'probe.h5'}",
        "probes=all_convs",
        "probes.convs.types=[]",
        "probes.convs.layers=[layer3]",
    )
    np.testing.assert_allclose(
        g["layers/layer3/output"][:], np.broadcast_to(x0.mean(0), x0.shape), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("ablation", ["zero_layer4", "mean_layer3"])
def test_gradients_after_an_ablation_equal_autograd_through_the_replaced_value(tmp_path, ablation):
    """The ablated output no longer depends on its module: what follows keeps its gradients, what
    precedes gets zeros, as autograd gives for a plain hook returning the replaced value."""
    sites = "[output,grad_output,grad_input]"
    probe = ["probes=all_linear", "probes.linear.types=[]", f"probes.linear.capture={sites}"]
    layers = "probes.linear.layers=[layer2,layer3,layer4,avgpool,fc]"
    _, f = run_probe(tmp_path, *SMALL, f"intervene={ablation}", *probe, layers)
    model, inputs = _clean_model_and_inputs()
    ablated = model.layer4 if ablation == "zero_layer4" else model.layer3
    mean = None
    if ablation == "mean_layer3":  # source=first_pass: the clean outputs' mean over the dataset
        clean = []
        handle = ablated.register_forward_hook(lambda m, a, out: clean.append(out))
        with torch.no_grad():
            model(inputs)
        handle.remove()
        mean = clean[0].mean(0)
    seen = {}

    def replace(module, args, out):
        value = torch.zeros_like(out) if mean is None else mean.expand_as(out)
        return out * 0 + value  # the value, with zero gradient back to the module

    def keep(name):
        def hook(module, args, out):
            out.retain_grad()
            seen[name] = out

        return hook

    ablated.register_forward_hook(replace)
    for name in ["layer2", "layer3", "layer4", "avgpool"]:
        getattr(model, name).register_forward_hook(keep(name))
    logits = model(inputs)
    targets = torch.as_tensor(f["samples/target"][:])
    torch.nn.functional.cross_entropy(logits, targets, reduction="sum").backward()
    for name, out in seen.items():
        np.testing.assert_allclose(f[f"layers/{name}/output"][:], out.detach().numpy(), atol=1e-5)
        np.testing.assert_allclose(
            f[f"layers/{name}/grad_output"][:], out.grad.numpy(), rtol=1e-4, atol=1e-6
        )
    zero_before = ["layer2", "layer3"] if ablation == "zero_layer4" else ["layer2"]
    for name in zero_before:
        assert not f[f"layers/{name}/grad_output"][:].any(), name
    assert f[f"layers/{ablation[-6:]}/grad_output"][:].any()
    np.testing.assert_allclose(
        f["layers/fc/grad_input"][:], seen["avgpool"].grad.flatten(1).numpy(), rtol=1e-4, atol=1e-6
    )


def test_an_ablation_followed_by_an_in_place_op_keeps_its_gradients(tmp_path):
    """A BasicBlock's bn2 feeds `out += identity`: its zeroed output is modified in place, and the
    gradients around it still equal autograd's through a plain hook returning `out * 0`."""
    edit = ["intervene=edit", "intervene.edit.layers=[layer1.0.bn2]", "intervene.edit.op=zero"]
    layers = "probes.linear.layers=[layer1.0.conv2,layer1.0]"
    probe = ["probes=all_linear", "probes.linear.types=[]", layers]
    capture = "probes.linear.capture=[output,grad_output]"
    _, f = run_probe(tmp_path, *SMALL, *edit, *probe, capture)
    model, inputs = _clean_model_and_inputs()
    block = model.layer1[0]
    block.bn2.register_forward_hook(lambda m, a, out: out * 0)
    names, seen = {block.conv2: "layer1.0.conv2", block: "layer1.0"}, {}

    def keep(module, args, out):
        out.retain_grad()
        seen[names[module]] = out

    for module in names:
        module.register_forward_hook(keep)
    targets = torch.as_tensor(f["samples/target"][:])
    torch.nn.functional.cross_entropy(model(inputs), targets, reduction="sum").backward()
    before, after = f["layers/layer1.0.conv2/grad_output"][:], f["layers/layer1.0/grad_output"][:]
    assert not before.any() and after.any()
    for name, out in seen.items():
        np.testing.assert_allclose(
            f[f"layers/{name}/grad_output"][:], out.grad.numpy(), rtol=1e-4, atol=1e-6
        )


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (
            ["intervene=edit", "intervene.edit.layers=[fc]", "intervene.edit.op=explode"],
            ["explode", "zero"],
        ),
        (
            [
                "intervene=edit",
                "intervene.edit.layers=[conv1]",
                "intervene.edit.op=zero",
                "intervene.edit.channels=[64]",
            ],
            ["channels [64]", "64 channels"],
        ),
        (
            ["intervene=edit", "intervene.edit.layers=[conv1]", "intervene.edit.op=mean"],
            ["source", "first_pass"],
        ),
        (
            ["intervene=edit", "intervene.edit.layers=[conv9]", "intervene.edit.op=zero"],
            ["conv9", "closest"],
        ),
    ],
)
def test_bad_interventions(tmp_path, args, words, cli_in_process):
    out = cli_in_process(*SMALL, *args, f"hydra.run.dir={tmp_path}")
    text = out.stdout + out.stderr
    assert out.returncode != 0 and "Traceback" not in text
    for w in words:
        assert w in text, text


def test_sweep_over_interventions_reports_each_effect(tmp_path):
    out = cli(
        "-m",
        *SMALL,
        "intervene=none,zero_layer4,noise_convs",
        "probes=all_linear",
        f"hydra.sweep.dir={tmp_path}",
        cwd=tmp_path,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    assert not (tmp_path / "0" / "effects.csv").exists()
    for job in ("1", "2"):
        effects = pd.read_csv(tmp_path / job / "effects.csv")
        with pytest.importorskip("h5py").File(tmp_path / job / "probe.h5") as f:
            change = np.abs(
                f["model/output"][:].astype(np.float64) - f["model/output_clean"][:]
            ).mean()
        np.testing.assert_allclose(effects.mean_abs_change[0], change, rtol=1e-6)
        assert change > 0
    gathered = probe.open_sweep(tmp_path).effects  # every job's effects.csv, with its override
    assert gathered.columns[0] == "run" and "intervene" in gathered.columns
    assert list(gathered.intervene) == ["zero_layer4", "noise_convs"]
    for job, row in zip(("1", "2"), gathered.itertuples(), strict=True):
        want = pd.read_csv(tmp_path / job / "effects.csv").iloc[0]
        assert row.mean_abs_change == want.mean_abs_change and str(row.run) == job
    assert "effects: samples 5, mean_abs_change" in (tmp_path / "1" / "probe.log").read_text()


def test_summarize_gathers_every_jobs_effects_at_the_sweep_root(tmp_path):
    """A 2-job sweep of edits of TinyNet's relu: `python -m probe.summarize SWEEP` writes
    SWEEP/effects.csv, equal to each job's effects.csv after its run and override columns (read
    here from .hydra/overrides.yaml), in job order; each job's one-line effects summary on the
    console gives the numbers of its effects.csv."""
    tiny = ["model=custom", "model._target_=probe.testing.models.TinyNet",
            "model.input_shape=[3,8,8]", "model.num_classes=10", "probes=all_linear",
            "dataset.num_samples=7", "dataset.batch_size=3"]  # fmt: skip
    edit = ["intervene=edit", "intervene.edit.layers=[relu]", "intervene.edit.op=scale,zero",
            "intervene.edit.factor=0.5"]  # fmt: skip
    out = cli("-m", *tiny, *edit, f"hydra.sweep.dir={tmp_path}", cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr
    console = [line for line in (out.stdout + out.stderr).splitlines() if "effects: " in line]
    assert len(console) == 2, out.stdout + out.stderr
    frames = []
    for job, line in zip(("0", "1"), console, strict=True):
        effects = pd.read_csv(tmp_path / job / "effects.csv")
        shown = line.split("effects: ", 1)[1].removesuffix(" (effects.csv)").split(", ")
        row = effects.iloc[0]
        assert [s.split(" ")[0] for s in shown] == list(effects.columns)
        for text, (key, value) in zip(shown, row.items(), strict=True):
            want = str(int(value)) if key == "samples" else f"{value:.4g}"
            assert text == f"{key} {want}", (job, line)
        assert row.samples == 7 and row.mean_abs_change > 0
        overrides = yaml.safe_load((tmp_path / job / ".hydra" / "overrides.yaml").read_text())
        assert f"intervene.edit.op={('scale', 'zero')[int(job)]}" in overrides
        for i, (key, value) in enumerate(
            [("run", job), *(o.lstrip("+~").split("=", 1) for o in overrides)]
        ):
            effects.insert(i, key, value)
        frames.append(effects)
    assert not (tmp_path / "effects.csv").exists()  # the summarizer writes it
    done = subprocess.run(
        [sys.executable, "-m", "probe.summarize", str(tmp_path)], cwd=ROOT, capture_output=True,
        text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    want = pd.read_csv(io.StringIO(pd.concat(frames, ignore_index=True).to_csv(index=False)))
    got = pd.read_csv(tmp_path / "effects.csv")
    assert got.columns[0] == "run" and "intervene.edit.op" in got.columns
    pd.testing.assert_frame_equal(got, want, check_exact=True)
