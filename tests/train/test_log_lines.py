"""probe.log of a watched training reads at a real model's size: what each asked site became is
said once, its modules folded into index ranges in natural order, every line short, and a
resume says what it kept and cut instead of saying the names again. watch.yaml names the
sites as train.csv does."""

from __future__ import annotations

import copy
import random
import re

import pandas as pd
import torch
import yaml

import probe
from probe.testing.trainings import deep_llama, one_thread, token_batches, token_loss
from probe.train.log_lines import LINE_NAMES, fold, natural

RANGE = re.compile(r"\{[^}]*\}|\d+-\d+")


def expand(folded: str) -> list[str]:
    """The names a folded name stands for, read back by hand: `a.0-2.b` -> a.0.b, a.1.b, a.2.b;
    `a.{0-1,5}` -> a.0, a.1, a.5."""
    found = RANGE.search(folded)
    if found is None:
        return [folded]
    numbers = []
    for run in found.group().strip("{}").split(","):
        lo, _, hi = run.partition("-")
        numbers += range(int(lo), int(hi or lo) + 1)
    head, tail = folded[: found.start()], folded[found.end() :]
    return [name for n in numbers for name in expand(f"{head}{n}{tail}")]


def test_folded_names_stand_for_exactly_the_names_in_natural_order():
    rng = random.Random(5)
    grid = [f"model.layers.{i}.mlp.experts.{j}" for i in range(12) for j in range(4)]
    extra = ["model.embed_tokens", "lm_head", "model.layers.3.self_attn", "layer1.0", "layer2.1"]
    for trial in range(20):
        names = rng.sample(grid, rng.randint(1, len(grid))) + rng.sample(extra, trial % 5)
        folded = fold(sorted(names))  # string order in: 0, 1, 10, 11, 2, ...
        assert sorted(n for f in folded for n in expand(f)) == sorted(names)
        assert folded == sorted(folded, key=natural)
    assert fold(sorted(grid)) == ["model.layers.0-11.mlp.experts.0-3"]
    assert fold([f"model.layers.{i}" for i in (10, 2, 0, 1, 3, 11)]) == ["model.layers.{0-3,10-11}"]


def _train(model, opt, probes, out, batches, state=None, keep_at=None):
    """Train over `batches`, watched into `out` (resumed from `state`); the checkpoint after
    `keep_at` steps."""
    w = probe.watch(model, probes, out=out, optimizer=opt)
    if state is not None:
        w.load_state_dict(state["watch"])
    kept = None
    with w:
        for i, batch in enumerate(batches):
            opt.zero_grad()
            loss = token_loss(model, batch)
            loss.backward()
            w.loss(loss)
            opt.step()
            if i + 1 == keep_at:
                kept = {"model": copy.deepcopy(model.state_dict()),
                        "optimizer": copy.deepcopy(opt.state_dict()), "watch": w.state_dict()}  # fmt: skip
    return kept


def test_a_30_block_models_site_names_are_said_once_and_a_resume_says_what_it_cut(tmp_path):
    """Each block's attention returns a tuple, so `output` is recorded as `output.0`: the log
    says so in one short line, which expands to the layers train.csv holds under `output.0`.
    4 steps, a checkpoint after 2, then the training resumed from it: the resumed watch cuts
    the steps 2-3 the file holds past the checkpoint, says so, and does not say the names
    again."""
    probes = {"attn": {"layers": ["model.layers.*.self_attn"], "capture": ["output"]},
              "blocks": {"layers": ["@blocks"], "capture": ["output"]}}  # fmt: skip
    model = deep_llama(width=8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = token_batches(4)
    with one_thread():
        state = _train(model, opt, probes, tmp_path, batches, keep_at=2)
        before = pd.read_csv(tmp_path / "train.csv")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        _train(model, opt, probes, tmp_path, batches[2:], state=state)

    lines = (tmp_path / "probe.log").read_text().splitlines()
    assert max(len(line) for line in lines) < LINE_NAMES + 150
    named = [line for line in lines if "names a run gives them" in line]
    assert len(named) == 1  # once, not again after the resume
    folded, became = named[0].split("(docs/format.md#names): ")[1].split(": ")
    assert folded == "model.layers.0-29.self_attn" and became == "output -> output.0"
    table = pd.read_csv(tmp_path / "train.csv")
    assert sorted(expand(folded)) == sorted(set(table.layer[table.site == "output.0"]))
    assert set(table.site) == {"output", "output.0"}

    (resumed,) = [line for line in lines if "resuming the training" in line]
    cut = sorted(set(before.step[before.step >= 2]))
    assert cut == [2, 3]
    assert resumed.endswith(
        "resuming the training at step 2: kept 2 recorded steps (0, 1); "
        f"cut steps {cut[0]}, {cut[1]}, recorded after the checkpoint was taken"
    )
    assert sorted(set(table.step)) == [0, 1, 2, 3]  # every step once
    # watch.yaml names each module's sites as train.csv does, after the resume too
    modules = yaml.safe_load((tmp_path / "watch.yaml").read_text())["modules"]
    held = table.groupby("layer")["site"].apply(lambda s: sorted(set(s))).to_dict()
    assert {layer: sorted(sites) for layer, sites in modules.items()} == held
