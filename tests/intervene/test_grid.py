"""Patching grids on a tiny GPT-2: every cell equals a hand loop of plain hooks (one forward per
cell), stacked cells equal single ones, causal tracing and resume included."""

from __future__ import annotations

import h5py
import numpy as np
import pandas as pd
import pytest
import torch
from omegaconf import open_dict

from probe.config import METRICS, EditSpec
from probe.errors import ConfigError
from probe.launch.interrupt import Interrupted
from probe.launch.run import run
from probe.testing.compose import make_cfg
from tests.helpers import hf

N, T = 5, 6


def grid_args(lm, *extra) -> list[str]:
    model, path, _ = lm
    return [
        "model=hf", f"model.name={model}", "model.task=causal_lm", "dataset=pairs",
        f"dataset.path={path}", "dataset.batch_size=2", "probes=none", "intervene=patch_grid",
        f"intervene.metrics=[{','.join(METRICS)}]", *extra,
    ]  # fmt: skip


def run_grid(tmp_path, lm, *extra, edits=None, **options):
    cfg = make_cfg(*grid_args(lm, *extra))
    with open_dict(cfg):
        for name, spec in (edits or {}).items():
            cfg.intervene[name] = EditSpec(**spec)
        for key, value in options.items():
            cfg.intervene[key] = value
    run(cfg, run_dir=tmp_path)
    return h5py.File(tmp_path / "probe.h5", "r"), pd.read_csv(tmp_path / "patching.csv")


def hooked(module, site: str, fn):
    """A function that registers a plain hook calling fn on the module's output (or first
    input), keeping what fn returns (None: the value as it is)."""
    if site == "output":
        return lambda: module.register_forward_hook(lambda m, a, o: fn(o))
    return lambda: module.register_forward_pre_hook(
        lambda m, a: None if (x := fn(a[0])) is None else (x,)
    )


def hand_loop(model, cells, source_ids, target_ids, pairs, site="output", before=()):
    """(cells, N) logit differences and KLs at the last position: one forward per cell, a plain
    hook replacing the cell's slice of the module's output (or input) with the source's."""
    modules = dict(model.named_modules())

    def forward(ids, hooks=(), edited=True):
        handles = [h() for h in [*(before if edited else []), *hooks]]
        try:
            with torch.no_grad():
                return model(input_ids=ids).logits[:, -1].double()
        finally:
            for h in handles:
                h.remove()

    seen = {}

    def keep(layer):
        return hooked(modules[layer], site, lambda x: seen.__setitem__(layer, x.clone()))

    keep = [keep(layer) for layer in {c[0] for c in cells}]
    clean_source = forward(source_ids, keep, edited=False)  # the source, its sites recorded
    target = forward(target_ids)
    rows = torch.arange(len(target_ids))

    def diff(x):
        return (x[rows, pairs["answer"]] - x[rows, pairs["wrong"]]).numpy()

    def kl(x):
        p, q = target.log_softmax(1), x.log_softmax(1)
        return (p.exp() * (p - q)).sum(1).numpy()

    measures = {
        "logit_diff": diff,
        "kl": kl,
        "answer_logprob": lambda x: x.log_softmax(1)[rows, pairs["answer"]].numpy(),
        "answer_prob": lambda x: x.softmax(1)[rows, pairs["answer"]].numpy(),
        "output_change": lambda x: (x - target).abs().mean(1).numpy(),
    }
    out = {name: [] for name in measures}
    for layer, position, head in cells:
        src = seen[layer]

        def patch(x, src=src, position=position, head=head):
            x = x.clone()
            pos = slice(None) if position is None else position
            feat = slice(None) if head is None else slice(16 * head, 16 * (head + 1))
            x[:, pos, feat] = src[:, pos, feat]
            return x

        hook = hooked(modules[layer], site, patch)
        edited = forward(target_ids, [hook])
        for name, measure in measures.items():
            out[name].append(measure(edited))
    base = {name: (m(target), m(clean_source)) for name, m in measures.items()}
    return {k: np.stack(v, 1) for k, v in out.items()}, base


@pytest.mark.parametrize(
    ("extra", "site", "cells"),
    [
        ([], "output", [(f"transformer.h.{i}", p, None) for i in range(2) for p in range(T)]),
        (
            [
                "intervene.grid.layers=[@blocks.attn.c_proj]",
                "intervene.grid.site=input",
                "intervene.grid.over=[layer,head]",
            ],
            "input",
            [(f"transformer.h.{i}.attn.c_proj", None, h) for i in range(2) for h in range(2)],
        ),
        (
            [
                "intervene.grid.layers=[transformer.h.1.attn.c_proj]",
                "intervene.grid.site=input",
                "intervene.grid.over=[layer,position,head]",
                "intervene.grid.positions=[2,-1]",
            ],
            "input",
            [("transformer.h.1.attn.c_proj", p, h) for p in (2, 5) for h in range(2)],
        ),
    ],
    ids=["layer-position", "layer-head", "layer-position-head"],
)
def test_every_cell_equals_a_hand_loop(tmp_path, lm, extra, site, cells):
    _, _, pairs = lm
    f, table = run_grid(tmp_path, lm, *extra)
    want, base = hand_loop(hf(lm), cells, pairs["clean_ids"], pairs["corrupt_ids"], pairs, site)
    for metric in METRICS:
        np.testing.assert_allclose(f[f"patching/{metric}"][:], want[metric], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(f[f"patching/{metric}_target"][:], base[metric][0], atol=1e-6)
        np.testing.assert_allclose(f[f"patching/{metric}_source"][:], base[metric][1], atol=1e-6)
        rows = table[table.metric == metric]
        np.testing.assert_allclose(rows.value, want[metric].mean(0), rtol=1e-5, atol=1e-6)
    assert len(table) == len(METRICS) * len(cells) and (table.n == N).all()


def test_the_last_block_at_the_last_position_is_normalized_one(tmp_path, lm):
    _, table = run_grid(tmp_path, lm)
    cell = table[(table.layer == "transformer.h.1") & (table.position == T - 1)]
    np.testing.assert_allclose(cell.normalized, 1.0, rtol=1e-5)
    assert (tmp_path / "patching.png").stat().st_size > 0


def test_stacked_cells_equal_one_cell_per_forward(tmp_path, lm):
    f, _ = run_grid(tmp_path / "one", lm)
    g, _ = run_grid(tmp_path / "three", lm, "intervene.grid.stack=3")
    np.testing.assert_allclose(
        g["patching/logit_diff"][:], f["patching/logit_diff"][:], rtol=1e-5, atol=1e-7
    )


def test_causal_tracing_noise_on_the_embeddings_and_a_grid_from_clean(tmp_path, lm):
    """ROME's causal tracing: noise on the token embeddings of the clean input, each block's
    output at each position restored from the unedited run: a hand loop with the same noise."""
    _, _, pairs = lm
    noise = {"layers": ["transformer.wte"], "op": "noise", "std": 0.5, "seed": 7}
    f, _ = run_grid(
        tmp_path, lm, "intervene.grid.source=clean", "intervene.grid.direction=noise",
        "dataset.batch_size=5", edits={"noise": noise},
    )  # fmt: skip
    model = hf(lm)
    from probe.intervene.edits import _noise

    add = _noise(0.5, 7, "noise", "transformer.wte")
    wte = model.transformer.wte
    before = [lambda: wte.register_forward_hook(lambda m, a, o: add(o, 0, "output", None))]
    cells = [(f"transformer.h.{i}", p, None) for i in range(2) for p in range(T)]
    want, base = hand_loop(
        model, cells, pairs["clean_ids"], pairs["clean_ids"], pairs, before=before
    )
    np.testing.assert_allclose(
        f["patching/logit_diff"][:], want["logit_diff"], rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(f["patching/logit_diff_target"][:], base["logit_diff"][0], atol=1e-6)


def test_an_interrupted_grid_resumes_to_the_same_file(tmp_path, lm):
    """A SIGINT inside the 2nd batch's cells (14 forwards a batch: source, target, 12 cells),
    then resume=true: /patching and patching.csv equal an uninterrupted grid's."""
    from probe.testing.models import SIGNAL_AT

    model = ["model=custom", "model._target_=probe.testing.models.signalling_lm",
             f"+model.kwargs.path={lm[0]}"]  # fmt: skip
    args = [*grid_args(lm)[3:], *model]
    run(make_cfg(*args), run_dir=tmp_path / "whole")
    SIGNAL_AT[0] = 20
    try:
        with pytest.raises(Interrupted):
            run(make_cfg(*args), run_dir=tmp_path / "part")
    finally:
        SIGNAL_AT[0] = None
    with h5py.File(tmp_path / "part" / "probe.h5") as f:
        assert f.attrs["num_samples"] == 4 and not f.attrs["complete"]
    run(make_cfg(*args, "resume=true"), run_dir=tmp_path / "part")
    for name in ("patching/logit_diff", "patching/kl_source", "patching/logit_diff_target"):
        with (
            h5py.File(tmp_path / "part" / "probe.h5") as f,
            h5py.File(tmp_path / "whole" / "probe.h5") as g,
        ):
            np.testing.assert_array_equal(f[name][:], g[name][:])
    a, b = (pd.read_csv(tmp_path / d / "patching.csv") for d in ("part", "whole"))
    pd.testing.assert_frame_equal(a, b)


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["intervene.grid.positions=[9]"], ["positions", "[9]", "6 positions"]),
        (["intervene.grid.over=[position]"], ["over", "layer"]),
        (["intervene.grid.over=[layer,head]"], ["heads", "site: input"]),
        (["intervene.grid.positions=[]"], ["selects no cell"]),
    ],
)
def test_bad_grids_are_named(tmp_path, lm, extra, words):
    with pytest.raises(ConfigError) as e:
        run_grid(tmp_path, lm, *extra)
    for w in words:
        assert w in str(e.value)


def test_a_sweep_of_grids_gathers_its_patching_tables(tmp_path, lm):
    """-m over direction: one grid per job; probe.read.summaries of the sweep writes one
    patching.csv with the run and the override beside each job's rows."""
    import subprocess
    import sys

    from tests.helpers import ROOT, cli

    args = [a for a in grid_args(lm) if not a.startswith("intervene.metrics")]
    out = cli(
        "-m", *args, "intervene.metrics=[kl]", "intervene.grid.direction=denoise,noise",
        "intervene.grid.positions=[2]", f"hydra.sweep.dir={tmp_path}",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    done = subprocess.run(
        [sys.executable, "-m", "probe.summarize", str(tmp_path)],
        capture_output=True, text=True, env={"PYTHONPATH": str(ROOT)}, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    table = pd.read_csv(tmp_path / "patching.csv")
    for job, direction in (("0", "denoise"), ("1", "noise")):
        own = pd.read_csv(tmp_path / job / "patching.csv")
        mine = table[table["intervene.grid.direction"] == direction][own.columns]
        pd.testing.assert_frame_equal(mine.reset_index(drop=True), own)
        assert set(table[table.run == int(job)]["intervene.grid.direction"]) == {direction}
