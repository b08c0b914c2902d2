"""probe.site_keys: every site name the pipeline writes (the datasets under /layers and /stats,
the rows of summary.csv, attribution.csv and train.csv) parses into the fields the run was
asked for, as plain hooks on the same model count its calls and flatten its outputs, and prints
back to the same name; nothing else in probe/ splits a site name."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import h5py
import pandas as pd
import pytest
import torch
import torchvision
from torch import nn

import probe
from probe.hooks.names import flatten
from probe.site_keys import (
    CAM_SITES,
    FAMILIES,
    PARAM_SITES,
    SiteKey,
    family_of,
    parse_or_none,
)
from probe.store.fileformat import captured
from probe.testing.tiny_lms import make_tiny
from probe.testing.trainings import cnn, image_batches, image_loss, one_thread, train
from tests.helpers import ROOT, run_probe

VALUES = ("output", "input", "grad_output", "grad_input")
RESNET = ["model=resnet18", "model.num_classes=10", "dataset.image_size=32",
          "dataset.num_samples=2", "dataset.batch_size=2", "objective=logit",
          "objective.index=3"]  # fmt: skip


class Pair(nn.Module):
    """Returns a tuple: the first two features and the rest."""

    def forward(self, x):
        return x[:, :2], x[:, 2:]


class TwiceNet(nn.Module):
    """`lin` and `pair` run twice per forward; `pair` returns a tuple."""

    def __init__(self, num_classes: int = 4):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.pair = Pair()
        self.head = nn.Linear(4, num_classes)

    def forward(self, x):
        a, b = self.pair(self.lin(x))
        c, d = self.pair(self.lin(torch.cat([b, a], 1)))
        return self.head(torch.cat([c, d], 1))


def fields(key: SiteKey) -> tuple[str, str, int, str]:
    return key.family, key.path, key.call, key.derived


def stored(run_dir: Path) -> dict[str, set[str]]:
    """{layer: its dataset names} under /layers, and under /stats."""
    out: dict[str, set[str]] = {}
    with h5py.File(run_dir / "probe.h5", "r") as f:
        for top in ("layers", "stats"):
            for layer, group in captured(f[top]):
                out.setdefault(layer, set()).update(name for name, _ in captured(group))
    return out


def table_sites(path: Path) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for layer, site in pd.read_csv(path)[["layer", "site"]].drop_duplicates().itertuples(False):
        out.setdefault(layer, set()).add(site)
    return out


def parsed(sites: dict[str, set[str]]) -> dict[str, set[tuple[str, str, int, str]]]:
    """{layer: the fields of each name}, each name printed back from its key exactly."""
    out = {}
    for layer, names in sites.items():
        keys = [SiteKey.parse(n) for n in names]
        assert sorted(str(k) for k in keys) == sorted(names), layer
        out[layer] = {fields(k) for k in keys}
    return out


def calls_and_paths(model: nn.Module, x, layers) -> tuple[Counter, dict[str, list[str]]]:
    """Per layer: its calls in one forward, and the paths of its first output's tensors."""
    calls, paths, handles = Counter(), {}, []
    for name in layers:

        def seen(module, args, output, name=name):
            calls[name] += 1
            paths.setdefault(name, [p for p, _ in flatten(output)])

        handles.append(model.get_submodule(name).register_forward_hook(seen))
    try:
        with torch.no_grad():
            model.eval()(**x) if isinstance(x, dict) else model.eval()(x)
    finally:
        for h in handles:
            h.remove()
    return calls, paths


def test_names_round_trip_with_their_fields():
    cases = {
        "output": ("output", "", 0, ""),
        "output.0@1": ("output", ".0", 1, ""),
        "input.logits.0": ("input", ".logits.0", 0, ""),
        "grad_output@12": ("grad_output", "", 12, ""),
        "param_grad.attn.c_attn.bias": ("param_grad", ".attn.c_attn.bias", 0, ""),
        "param_update.weight": ("param_update", ".weight", 0, ""),
        "param.*.bias": ("param", ".*.bias", 0, ""),
        "sae.latents.index": ("sae.latents", ".index", 0, ""),
        "sae.error": ("sae.error", "", 0, ""),
        "unedited_grad_output.1@2": ("unedited_grad_output", ".1", 2, ""),
        "gradcam_pp.sum": ("gradcam_pp", "", 0, "sum"),
        "grad_x_output.0@1.units": ("grad_x_output", ".0", 1, "units"),
        "ig_output@1.gap": ("ig_output", "", 1, "gap"),
    }
    for name, want in cases.items():
        key = SiteKey.parse(name)
        assert fields(key) == want
        assert str(key) == name == str(SiteKey(*want))
    assert SiteKey.parse("param_grad.layer1.weight").parameter == "layer1.weight"
    assert SiteKey.parse("output.0@1").unedited() == SiteKey("unedited_output", ".0", 1)


@pytest.mark.parametrize(
    "name", ["", "outputs", "sae", "output@0", "output@", "output@x", "param_grad@1", "layers/fc"]
)
def test_a_name_that_is_no_sites_is_refused(name):
    with pytest.raises(ValueError, match="site"):
        SiteKey.parse(name)
    assert parse_or_none(name) is None and family_of(name) is None


def test_keys_refuse_what_no_name_holds():
    for bad in [("nope",), ("output", "0"), ("param", ".w", 1), ("output", "", 0, "sum")]:
        with pytest.raises(ValueError):
            SiteKey(*bad)
    assert set(CAM_SITES) | set(PARAM_SITES) <= set(FAMILIES)


def test_resnet_values_gradients_edits_and_attribution_maps(tmp_path):
    """Every site of a resnet18's last block (its relu runs twice), the values before an edit,
    parameter gradients and every attribution map but ig_output, as plain hooks predict them."""
    run_probe(
        tmp_path, *RESNET, "probes=none",
        "+probes.values.layers=[layer4.1,layer4.1.*,fc]",
        f"+probes.values.capture=[{','.join(VALUES)}]", "+probes.values.unedited=true",
        "+probes.params.layers=[layer4.1.conv1,fc]", "+probes.params.capture=[param_grad]",
        "+probes.attr.layers=[layer3,layer4]",
        f"+probes.attr.capture=[grad_x_output,grad_x_input,{','.join(CAM_SITES)}]",
        "intervene=edit", "intervene.edit.layers=[layer4.1.relu]", "intervene.edit.op=scale",
    )  # fmt: skip
    model = torchvision.models.resnet18(num_classes=10)
    block = ["layer4.1", *(f"layer4.1.{n}" for n, _ in model.layer4[1].named_children()), "fc"]
    calls, _ = calls_and_paths(model, torch.zeros(1, 3, 32, 32), block)
    assert calls["layer4.1.relu"] == 2
    want: dict[str, set] = {}
    for layer in block:
        want[layer] = {(s, "", k, "") for s in VALUES for k in range(calls[layer])}
    want["layer4.1.relu"] |= {("unedited_output", "", k, "") for k in range(2)}
    for layer in ("layer4.1.conv1", "fc"):
        params = model.get_submodule(layer).named_parameters()
        want[layer] |= {("param_grad", f".{n}", 0, "") for n, _ in params}
    for layer in ("layer3", "layer4"):
        want[layer] = {(s, "", 0, d) for s in ("grad_x_output", "grad_x_input")
                       for d in ("", "sum", "units")}  # fmt: skip
        want[layer] |= {(s, "", 0, d) for s in CAM_SITES for d in ("", "sum")}
    assert parsed(stored(tmp_path)) == want
    summary = parsed(table_sites(tmp_path / "summary.csv"))
    assert summary == {layer: want[layer] for layer in summary} and set(summary) == set(want)
    attribution = parsed(table_sites(tmp_path / "attribution.csv"))
    assert attribution == {
        layer: {w for w in want[layer] if not w[3]} for layer in ("layer3", "layer4")
    }


def test_integrated_gradients_and_a_module_called_twice_with_tuple_outputs(tmp_path):
    """ig_output with its totals and gap; `lin` and the tuple-returning `pair` called twice."""
    run_probe(tmp_path / "ig", *RESNET, "probes=none", "+probes.ig.layers=[layer4]",
              "+probes.ig.capture=[ig_output]", "attribution.steps=2")  # fmt: skip
    assert parsed(stored(tmp_path / "ig")) == {
        "layer4": {("ig_output", "", 0, d) for d in ("", "sum", "units", "gap")}
    }
    torch.save(torch.randn(3, 4, generator=torch.Generator().manual_seed(0)), tmp_path / "x.pt")
    run_probe(
        tmp_path / "twice", "model=custom", f"model._target_={__name__}.TwiceNet",
        "model.num_classes=4", "model.input_shape=[4]", "dataset=tensors", "objective=output_sum",
        f"dataset.path={tmp_path / 'x.pt'}", "probes=none", "+probes.lin.layers=[lin]",
        f"+probes.lin.capture=[{','.join(VALUES)},param_grad]", "+probes.pair.layers=[pair]", f"+probes.pair.capture=[{','.join(VALUES)}]",
    )  # fmt: skip
    model = TwiceNet()
    calls, paths = calls_and_paths(model, torch.zeros(1, 4), ["lin", "pair"])
    assert calls == {"lin": 2, "pair": 2} and paths["pair"] == [".0", ".1"]
    want = {
        "lin": {(s, "", k, "") for s in VALUES for k in range(2)},
        "pair": {(s, p, k, "") for s in ("output", "grad_output") for p in paths["pair"]
                 for k in range(2)} | {(s, "", k, "") for s in ("input", "grad_input")
                                       for k in range(2)},
    }  # fmt: skip
    want["lin"] |= {("param_grad", f".{n}", 0, "") for n, _ in model.lin.named_parameters()}
    assert parsed(stored(tmp_path / "twice")) == want
    assert parsed(table_sites(tmp_path / "twice" / "summary.csv")) == want


def test_a_gpt2s_tuple_outputs_and_sae_sites(tmp_path):
    """A tiny GPT-2's blocks return tuples; an SAE on a block adds its latents (stored sparse as
    .index and .value, their statistics as sae.latents) and its error."""
    from tests.hooks.test_sae_sites import an_sae

    model_dir = make_tiny("gpt2", tmp_path / "gpt2", vocab_size=40)
    ids = torch.randint(1, 40, (2, 6), generator=torch.Generator().manual_seed(0))
    torch.save({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, tmp_path / "ids.pt")
    an_sae(tmp_path / "sae")
    layers = ["transformer.h.0", "transformer.h.0.attn", "transformer.h.1.mlp"]
    run_probe(
        tmp_path / "run", "model=hf", f"model.name={model_dir}", "model.task=causal_lm",
        "dataset=tokens", f"dataset.path={tmp_path / 'ids.pt'}", "dataset.batch_size=2",
        "objective=lm_loss", "probes=none", f"+probes.some.layers=[{','.join(layers)}]",
        "+probes.some.capture=[output,grad_output]", "+probes.block.layers=[transformer.h.1]",
        f"+probes.block.sae={{path:{tmp_path / 'sae'}}}",
    )  # fmt: skip
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir)
    calls, paths = calls_and_paths(hf, {"input_ids": ids}, [*layers, "transformer.h.1"])
    assert all(calls[n] == 1 for n in layers) and paths["transformer.h.0.attn"][0] == ".0"
    want = {n: {(s, p, 0, "") for s in ("output", "grad_output") for p in paths[n]} for n in layers}
    got = parsed(stored(tmp_path / "run"))
    first = paths["transformer.h.1"][0]  # the block's hidden states, which the SAE reads
    assert got.pop("transformer.h.1") == {
        ("output", first, 0, ""), ("sae.latents", ".index", 0, ""), ("sae.latents", ".value", 0, ""),
        ("sae.latents", "", 0, ""), ("sae.error", "", 0, ""),
    }  # fmt: skip
    assert got == want


def watched_sites(run_dir: Path) -> tuple[dict, dict, dict]:
    """{layer: site names} of a watch's run.train() table, its train.csv and its /train/sites."""
    with probe.open_run(run_dir) as run:
        table = run.train()
    from_table: dict[str, set[str]] = {}
    for layer, site in table[["layer", "site"]].drop_duplicates().itertuples(False):
        from_table.setdefault(layer, set()).add(site)
    with h5py.File(run_dir / "probe.h5", "r") as f:
        in_file = {layer: {n for n, _ in captured(g)} for layer, g in captured(f["train/sites"])}
    return from_table, table_sites(run_dir / "train.csv"), in_file


def test_a_watched_trainings_sites_in_train_h5_and_train_csv(tmp_path):
    """Value, gradient and parameter sites of a watched training, as the model names its
    parameters; a module called twice with a tuple output."""
    layers = ["layer1", "layer1.conv", "fc"]
    sites = [*VALUES, *PARAM_SITES]
    with one_thread():
        model = cnn()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        train(model, opt, image_batches(2), image_loss,
              {"probes": {"some": {"layers": layers, "capture": sites}}, "out": tmp_path / "w"})  # fmt: skip
    want = {}
    for layer in layers:
        params = [n for n, _ in model.get_submodule(layer).named_parameters()]
        want[layer] = {(s, "", 0, "") for s in VALUES}
        want[layer] |= {(s, f".{p}", 0, "") for s in PARAM_SITES for p in params}
    assert all(parsed(found) == want for found in watched_sites(tmp_path / "w"))

    model = TwiceNet()
    calls, paths = calls_and_paths(model, torch.zeros(1, 4), ["lin", "pair"])
    probes = {"lin": {"layers": ["lin"], "capture": sites},
              "pair": {"layers": ["pair"], "capture": list(VALUES)}}  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with probe.watch(model, probes=probes, optimizer=opt, out=tmp_path / "twice") as w:
        for _ in range(2):
            opt.zero_grad()
            loss = model(torch.randn(3, 4, requires_grad=True)).square().mean()
            loss.backward()
            w.loss(loss)
            opt.step()
    want = {
        "lin": {(s, "", k, "") for s in VALUES for k in range(calls["lin"])},
        "pair": {(s, p, k, "") for s in ("output", "grad_output") for p in paths["pair"]
                 for k in range(calls["pair"])}
        | {(s, "", k, "") for s in ("input", "grad_input") for k in range(calls["pair"])},
    }  # fmt: skip
    want["lin"] |= {
        (s, f".{n}", 0, "") for s in PARAM_SITES for n, _ in model.lin.named_parameters()
    }
    assert all(parsed(found) == want for found in watched_sites(tmp_path / "twice"))


# the ways site names were once split apart by hand; SiteKey.parse does it now
AD_HOC = [
    r"""\.r?split\(\s*["']@["']""",
    r"""\.r?partition\(\s*["']@["']""",
    r"""\.split\(\s*["']\.["']\s*\)\[0\]\.split""",
    r"""\.startswith\(\s*\(?\s*["'](param|grad|sae|unedited|output|input)""",
    r"""\.startswith\(\s*[A-Z_]*SITES""",
    r"""\[len\(\s*["'](output|input)["']\s*\)""",
    r"""\[len\(\s*(item|key)\.(site|family)\s*\)""",
    r"""["']unedited_["']\s*\+""",
    r"""\.partition\(\s*["']\.["']\s*\)""",
]
# model ids (`hf-hub:repo@revision`) and the step scalars' columns (`grad_norm_preclip`), not
# site names
ALLOWED = {("probe/models/hub.py", 0), ("probe/report/train_plots.py", 3)}


def test_nothing_else_splits_a_site_name():
    found = []
    for path in sorted((ROOT / "probe").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "probe/site_keys.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            for n, pattern in enumerate(AD_HOC):
                if re.search(pattern, line) and (rel, n) not in ALLOWED:
                    found.append(f"{rel}:{i}: {line.strip()}")
    assert found == []
