"""probe.hooks.site_table: the module table against named_modules, plain hooks of our own and probe.hooks.module_select."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from collections import Counter

import pandas as pd
import pytest
import torch
import torchvision
from torch import nn

import probe
from probe.errors import ConfigError, ModelError
from probe.hooks.module_select import select_modules
from probe.hooks.site_table import main
from probe.plan import probe_specs
from probe.testing.models import Raises, TinyLM, TinyNet, assert_no_hooks, registrations
from tests.helpers import ROOT


class Twice(nn.Module):
    """`lin` runs twice per forward; `split` returns a tuple."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.split = Split()

    def forward(self, x):
        a, b = self.split(self.lin(self.lin(x)))
        return a + b.sum(1, keepdim=True)


class Split(nn.Module):
    def forward(self, x):
        return x[:, :3], x[:, 3:]


def test_rows_are_named_modules_with_their_parameters(resnet):
    table = probe.sites(resnet)
    modules = list(resnet.named_modules())
    assert table.layer.tolist() == [n for n, _ in modules]
    assert table.type.tolist() == [type(m).__name__ for _, m in modules]
    own = {n: sum(p.numel() for p in m.parameters(recurse=False)) for n, m in modules}
    assert dict(zip(table.layer, table.params, strict=True)) == own
    assert table.params.sum() == sum(p.numel() for p in resnet.parameters())
    assert table.set_index("layer").params_total["layer1"] == sum(
        p.numel() for p in resnet.layer1.parameters()
    )
    assert table.set_index("layer").leaf.to_dict() == {
        n: not list(m.children()) for n, m in modules
    }
    assert "calls" not in table and "probes" not in table


def test_calls_and_shapes_match_plain_hooks(resnet):
    x = torch.randn(2, 3, 32, 32)
    counts, first_out = Counter(), {}

    def hook(name):
        def seen(module, args, output):
            counts[name] += 1
            first_out.setdefault(name, tuple(output.shape))

        return seen

    handles = [m.register_forward_hook(hook(n)) for n, m in resnet.named_modules()]
    try:
        with torch.no_grad():
            resnet(x)
    finally:
        for h in handles:
            h.remove()
    table = probe.sites(resnet, x).set_index("layer")
    assert table.calls.to_dict() == {n: counts[n] for n, _ in resnet.named_modules()}
    assert table.calls["layer1.0.relu"] == 2  # torchvision's BasicBlock reuses its ReLU
    for name, shape in first_out.items():
        assert table.output_shape[name] == str(shape), name
    assert table.input_shape["conv1"] == "(2, 3, 32, 32)"
    assert table.output_shape["layer4.1.conv2"] == "(2, 512, 1, 1)"
    assert_no_hooks(resnet)


def test_reused_module_and_structured_output():
    table = probe.sites(Twice(), torch.randn(2, 4)).set_index("layer")
    assert table.calls.to_dict() == {"": 1, "lin": 2, "split": 1}
    assert table.output_shape["split"] == "output.0: (2, 3); output.1: (2, 1)"


def test_token_example_as_keywords():
    model = TinyLM(vocab=50, width=8)
    ids = torch.randint(0, 50, (2, 5))
    mask = torch.ones(2, 5, dtype=torch.long)
    table = probe.sites(model, {"input_ids": ids, "attention_mask": mask}).set_index("layer")
    assert table.calls["embed"] == 1 and table.calls["blocks.0.0"] == 1
    assert table.output_shape["head"] == "(2, 5, 50)"
    positional = probe.sites(model, (ids, mask)).set_index("layer")
    assert positional.output_shape.to_dict() == table.output_shape.to_dict()
    assert positional.input_shape[""] == "input.0: (2, 5); input.1: (2, 5)"


def test_probes_column_is_what_select_selects(resnet):
    probes = {
        "convs": {"types": ["Conv2d"]},
        "late": {"layers": ["layer4.*"], "exclude": ["*.bn*"]},
        "nothing": {"layers": ["no_such_layer"]},
    }
    table = probe.sites(resnet, probes=probes)
    for name in ("convs", "late"):
        expected = {s.name for s in select_modules(resnet, probe_specs({name: probes[name]}))}
        shown = {layer for layer, p in zip(table.layer, table.probes, strict=True) if name in p}
        assert shown == expected
    convs = {n for n, m in resnet.named_modules() if isinstance(m, nn.Conv2d)}
    both = set(table.layer[table.probes == "convs,late"])
    assert both == {n for n in convs if n.startswith("layer4.")}
    assert "nothing" in table.attrs["unmatched"]
    assert not table.probes.str.contains("nothing").any()
    with pytest.raises(ConfigError, match="layerz"):
        probe.sites(resnet, probes={"bad": {"layerz": ["fc"]}})


@pytest.mark.parametrize("k", [1, 8])  # 8: the last of TinyNet's 4 modules x 2 hooks
def test_a_refused_registration_leaves_no_hook_and_the_next_table_is_unchanged(k):
    model, x = TinyNet(), torch.randn(2, 3, 8, 8)
    want = probe.sites(copy.deepcopy(model), x)
    with registrations(refuse=k), pytest.raises(RuntimeError, match=f"registration {k} refused"):
        probe.sites(model, x)
    assert_no_hooks(model)
    pd.testing.assert_frame_equal(probe.sites(model, x), want)


def test_hooks_removed_when_the_forward_raises():
    model = Raises()
    with pytest.raises(ModelError, match="deliberate failure"):
        probe.sites(model, torch.randn(2, 3, 8, 8))
    assert_no_hooks(model)
    assert probe.sites(TinyNet(), torch.randn(2, 3, 8, 8), probes="all_convs").probes.tolist() == [
        "",
        "convs",
        "",
        "",
    ]


def _cli(*args: str):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "probe.sites", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_prints_the_table():
    done = _cli(
        "model=resnet18",
        "probes=all_convs",
        "dataset.image_size=32",
        "dataset.batch_size=2",
        "dataset.num_samples=2",
    )
    assert done.returncode == 0, done.stderr
    row = next(line for line in done.stdout.splitlines() if "layer4.1.conv2 " in line)
    assert "(2, 512, 1, 1)" in row and row.rstrip().endswith("convs")
    assert len(done.stdout.splitlines()) == 1 + len(list(torchvision.models.resnet18().modules()))


def test_cli_errors_exit_2(capsys):
    done = _cli("model=no_such_model")
    assert done.returncode == 2
    assert done.stderr.startswith("probe.sites: error:") and "no_such_model" in done.stderr
    assert "Traceback" not in done.stderr
    assert main(["dataset.batch_size=0"]) == 2  # in-process: the same path, no interpreter start
    assert "probe.sites: error: dataset.batch_size=0 must be" in capsys.readouterr().err


def test_a_pattern_that_matches_nothing_points_to_the_listing():
    from probe.errors import SelectionError

    model = torchvision.models.resnet18()
    with pytest.raises(SelectionError, match=r"matches no module.*python -m probe.sites"):
        probe.capture(model, {"p": {"layers": ["layer9.*"]}})
