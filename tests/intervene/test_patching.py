"""Activation patching and steering on a tiny GPT-2: every value equals the same replacement done
with plain forward hooks on the model's own forward."""

from __future__ import annotations

import h5py
import numpy as np
import pandas as pd
import pytest
import torch
from omegaconf import open_dict

from probe.config import EditSpec
from probe.errors import ConfigError, DataError
from probe.launch.run import run
from probe.testing.compose import make_cfg
from probe.testing.tiny_lms import make_tiny
from tests.helpers import hf

N, T = 5, 6


def base_args(lm) -> list[str]:
    model, path, _ = lm
    return [
        "model=hf", f"model.name={model}", "model.task=causal_lm", "dataset=pairs",
        f"dataset.path={path}", "dataset.batch_size=2", "probes=residual",
        "probes.residual.layers=[transformer.h.0]", "probes.residual.rows=samples",
    ]  # fmt: skip


def run_edits(tmp_path, lm, edits: dict, metrics=("logit_diff", "kl"), *args):
    cfg = make_cfg(*base_args(lm), *args)
    with open_dict(cfg):
        for name, spec in edits.items():
            cfg.intervene[name] = EditSpec(**spec)
        cfg.intervene.metrics = list(metrics)
    result = run(cfg, run_dir=tmp_path)
    return result, h5py.File(result.h5_path, "r")


def last_logits(model, ids, hooks=()) -> torch.Tensor:
    """The logits at the last position of a plain forward with `hooks` (module, forward hook)."""
    handles = [m.register_forward_hook(h) for m, h in hooks]
    try:
        with torch.no_grad():
            return model(input_ids=ids).logits[:, -1].double()
    finally:
        for h in handles:
            h.remove()


def logit_diff(logits, pairs):
    rows = torch.arange(len(logits))
    return (logits[rows, pairs["answer"]] - logits[rows, pairs["wrong"]]).numpy()


def recorded(model, module, ids) -> torch.Tensor:
    seen = []
    last_logits(model, ids, [(module, lambda m, a, o: seen.append(o.clone()))])
    return seen[0]


def test_a_patch_from_the_pair_equals_plain_hooks(tmp_path, lm):
    """Denoising: the corrupt run with h.0's output at position 2 taken from the clean run; the
    per-sample target, source and edited logit differences and the probe on the patched site."""
    _, _, pairs = lm
    edit = {"layers": ["transformer.h.0"], "op": "patch", "source": "pair", "positions": [2]}
    result, f = run_edits(tmp_path, lm, {"p": edit})
    model = hf(lm)
    block = model.transformer.h[0]
    clean_h = recorded(model, block, pairs["clean_ids"])

    def patch(m, a, o):
        o = o.clone()
        o[:, 2] = clean_h[:, 2]
        return o

    edited = last_logits(model, pairs["corrupt_ids"], [(block, patch)])
    target = last_logits(model, pairs["corrupt_ids"])
    source = last_logits(model, pairs["clean_ids"])
    want = np.stack([logit_diff(x, pairs) for x in (target, source, edited)], 1)
    np.testing.assert_allclose(f["effects/logit_diff"][:], want, rtol=1e-5, atol=1e-5)
    captured = f["layers/transformer.h.0/output"][:]
    corrupt_h = recorded(model, block, pairs["corrupt_ids"]).numpy()
    np.testing.assert_allclose(captured[:, 2], clean_h[:, 2].numpy(), rtol=1e-5, atol=1e-6)
    others = [0, 1, 3, 4, 5]  # the probe records the patched value: the rest is the corrupt run's
    np.testing.assert_allclose(captured[:, others], corrupt_h[:, others], rtol=1e-5, atol=1e-6)
    effects = pd.read_csv(tmp_path / "effects.csv").set_index("metric")
    t, s, e = want.mean(0)
    np.testing.assert_allclose(
        effects.loc["logit_diff", "normalized"], (e - t) / (s - t), rtol=1e-6
    )
    assert effects.loc["kl", "target"] == 0 and effects.loc["logit_diff", "n"] == N


def test_the_last_block_at_the_last_position_restores_the_source(tmp_path, lm):
    """Patching GPT-2's last block output at the last token gives back the clean answer:
    normalized = 1 for every metric read there."""
    edit = {"layers": ["transformer.h.1"], "op": "patch", "source": "pair", "positions": [-1]}
    run_edits(tmp_path, lm, {"p": edit}, ("logit_diff", "answer_prob", "kl", "output_change"))
    effects = pd.read_csv(tmp_path / "effects.csv").set_index("metric")
    np.testing.assert_allclose(effects.normalized, 1.0, rtol=1e-5)


def test_a_patch_from_an_earlier_run_equals_one_from_the_pair(tmp_path, lm):
    """source: PATH reads the clean run's captured rows by sample: the same values as pair."""
    capture = ["probes.residual.layers=[transformer.h.1]"]
    first = run(make_cfg(*base_args(lm), *capture), run_dir=tmp_path / "clean")
    edit = {"layers": ["transformer.h.1"], "op": "patch", "positions": [2, -1]}
    _, a = run_edits(tmp_path / "pair", lm, {"p": {**edit, "source": "pair"}})
    _, b = run_edits(tmp_path / "path", lm, {"p": {**edit, "source": str(first.run_dir)}})
    np.testing.assert_array_equal(a["effects/logit_diff"][:, 2], b["effects/logit_diff"][:, 2])
    np.testing.assert_array_equal(
        a["layers/transformer.h.0/output"][:], b["layers/transformer.h.0/output"][:]
    )


def test_a_head_patch_on_the_output_projection_input_equals_plain_hooks(tmp_path, lm):
    """heads: [1] of attn.c_proj's input (2 heads of 16 features) from the clean run."""
    _, _, pairs = lm
    edit = {"layers": ["transformer.h.1.attn.c_proj"], "site": "input", "op": "patch",
            "source": "pair", "heads": [1]}  # fmt: skip
    _, f = run_edits(tmp_path, lm, {"p": edit})
    model = hf(lm)
    proj = model.transformer.h[1].attn.c_proj
    seen = []
    handle = proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].clone()))
    last_logits(model, pairs["clean_ids"])
    handle.remove()

    def patch(m, args):
        x = args[0].clone()
        x[..., 16:] = seen[0][..., 16:]
        return (x,)

    handle = proj.register_forward_pre_hook(patch)
    edited = last_logits(model, pairs["corrupt_ids"])
    handle.remove()
    np.testing.assert_allclose(
        f["effects/logit_diff"][:, 2], logit_diff(edited, pairs), rtol=1e-5, atol=1e-5
    )


def test_steering_with_a_file_and_with_a_mean_difference_equals_plain_hooks(tmp_path, lm):
    """op: add with a (C,) vector at the last position, and with mean_diff of two runs: the
    vector is numpy's difference of the runs' mean residual rows."""
    _, _, pairs = lm
    model = hf(lm)
    block = model.transformer.h[0]
    vector = torch.linspace(-1, 1, 32)
    torch.save(vector, tmp_path / "v.pt")
    edit = {"layers": ["transformer.h.0"], "op": "add", "vector": str(tmp_path / "v.pt"),
            "factor": 3.0, "positions": [-1]}  # fmt: skip
    _, f = run_edits(tmp_path / "file", lm, {"s": edit}, ("output_change",), "dataset.batch_size=5")

    def steer(v):
        def hook(m, a, o):
            o = o.clone()
            o[:, -1] += 3.0 * v
            return o

        return hook

    clean = last_logits(model, pairs["clean_ids"])
    edited = last_logits(model, pairs["clean_ids"], [(block, steer(vector))])
    got = f["effects/output_change"][:, 2]
    np.testing.assert_allclose(got, (edited - clean).abs().mean(1).numpy(), rtol=1e-5)
    plus = run(make_cfg(*base_args(lm)), run_dir=tmp_path / "plus")
    minus = run(make_cfg(*base_args(lm), "dataset.num_samples=2"), run_dir=tmp_path / "minus")
    with h5py.File(plus.h5_path) as a, h5py.File(minus.h5_path) as b:
        rows = [x["layers/transformer.h.0/output"][:].astype(np.float64) for x in (a, b)]
    diff = rows[0].mean((0, 1)) - rows[1].mean((0, 1))  # over samples and positions
    edit = {**edit, "vector": "mean_diff", "plus": str(plus.run_dir), "minus": str(minus.run_dir)}
    _, g = run_edits(tmp_path / "diff", lm, {"s": edit}, ("output_change",))
    edited = last_logits(
        model, pairs["clean_ids"], [(block, steer(torch.from_numpy(diff).float()))]
    )
    np.testing.assert_allclose(
        g["effects/output_change"][:, 2], (edited - clean).abs().mean(1).numpy(), rtol=1e-4
    )


@pytest.mark.parametrize(
    ("edit", "error", "words"),
    [
        ({"op": "patch"}, ConfigError, ["op=patch needs a source", "pair"]),
        (
            {"op": "patch", "source": "pair", "positions": [9]},
            ConfigError,
            ["position 9", "6 tokens"],
        ),
        ({"op": "patch", "source": "pair", "heads": [0]}, ConfigError, ["heads", "site: input"]),
        ({"op": "patch", "source": "/nowhere/run"}, DataError, ["/nowhere/run", "run directory"]),
    ],
)
def test_bad_patches_are_named(tmp_path, lm, edit, error, words):
    with pytest.raises(error) as e:
        run_edits(tmp_path, lm, {"p": {"layers": ["transformer.h.0"], **edit}})
    for w in words:
        assert w in str(e.value)


def test_a_source_run_with_other_shapes_or_fewer_samples_names_both(tmp_path, lm):
    capture = ["probes.residual.layers=[transformer.h.1]"]
    short = run(make_cfg(*base_args(lm), *capture, "dataset.num_samples=2"), run_dir=tmp_path / "s")
    by_token = [*capture, "probes.residual.rows=tokens"]
    tokens = run(make_cfg(*base_args(lm), *by_token), run_dir=tmp_path / "t")
    edit = {"layers": ["transformer.h.1"], "op": "patch"}
    with pytest.raises(DataError, match="holds 2 samples"):
        run_edits(tmp_path / "a", lm, {"p": {**edit, "source": str(short.run_dir)}})
    with pytest.raises(DataError, match="rows: samples"):
        run_edits(tmp_path / "b", lm, {"p": {**edit, "source": str(tokens.run_dir)}})
    with pytest.raises(DataError, match="holds no layers/transformer.h.0/output"):
        run_edits(
            tmp_path / "c",
            lm,
            {"p": {**edit, "layers": ["transformer.h.0"], "source": str(short.run_dir)}},
        )


FAMILIES = {
    "gpt2": ("transformer.h", "attn.c_proj"),
    "bert": ("bert.encoder.layer", "attention.output.dense"),
    "llama": ("model.layers", "self_attn.o_proj"),
}


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_patches_of_blocks_units_and_heads_equal_plain_hooks_in_each_family(tmp_path, lm, kind):
    """On tiny GPT-2, BERT and Llama: block 0's output at position 2 and units [0, 5] from the
    clean run, and head 1 of block 1's attention output projection input, in one edited run:
    the logit difference equals the same replacements done with plain hooks."""
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    _, path, pairs = lm
    directory = lm[0] if kind == "gpt2" else make_tiny(kind, tmp_path / kind, vocab_size=50)
    blocks, proj = FAMILIES[kind]
    edits = {
        "block": {"layers": [f"{blocks}.0"], "op": "patch", "source": "pair",
                  "positions": [2], "units": [0, 5]},
        "head": {"layers": [f"{blocks}.1.{proj}"], "site": "input", "op": "patch",
                 "source": "pair", "heads": [1]},
    }  # fmt: skip
    task = "masked_lm" if kind == "bert" else "causal_lm"
    args = [f"model.name={directory}", f"model.task={task}", "probes.residual.layers=[@blocks]"]
    _, f = run_edits(tmp_path / "run", lm, edits, ("logit_diff",), *args)
    cls = AutoModelForMaskedLM if kind == "bert" else AutoModelForCausalLM
    model = cls.from_pretrained(directory).eval()
    block, projection = (
        model.get_submodule(f"{blocks}.0"),
        model.get_submodule(f"{blocks}.1.{proj}"),
    )
    heads = model.config.num_attention_heads
    seen = {}
    handles = [
        block.register_forward_hook(lambda m, a, o: seen.__setitem__("block", first(o).clone())),
        projection.register_forward_pre_hook(lambda m, a: seen.__setitem__("head", a[0].clone())),
    ]
    last_logits(model, pairs["clean_ids"])
    for h in handles:
        h.remove()
    width = seen["head"].shape[-1] // heads

    def patch_block(m, a, o):
        x = first(o).clone()
        x[:, 2, [0, 5]] = seen["block"][:, 2, [0, 5]]
        return x if isinstance(o, torch.Tensor) else (x, *o[1:])

    def patch_head(m, a):
        x = a[0].clone()
        x[..., width : 2 * width] = seen["head"][..., width : 2 * width]
        return (x, *a[1:])

    handles = [
        block.register_forward_hook(patch_block),
        projection.register_forward_pre_hook(patch_head),
    ]
    edited = last_logits(model, pairs["corrupt_ids"])
    for h in handles:
        h.remove()
    np.testing.assert_allclose(
        f["effects/logit_diff"][:, 2], logit_diff(edited, pairs), rtol=1e-5, atol=1e-5
    )


def first(output):
    return output if isinstance(output, torch.Tensor) else output[0]


def test_a_steering_vector_per_position_equals_a_plain_hook(tmp_path, lm):
    """A (T, C) vector adds each position's row, at every position."""
    _, _, pairs = lm
    vector = torch.randn(6, 32, generator=torch.Generator().manual_seed(5))
    torch.save(vector, tmp_path / "v.pt")
    edit = {"layers": ["transformer.h.1"], "op": "add", "vector": str(tmp_path / "v.pt")}
    _, f = run_edits(tmp_path / "run", lm, {"s": edit}, ("output_change",))
    model = hf(lm)
    clean = last_logits(model, pairs["clean_ids"])
    edited = last_logits(
        model, pairs["clean_ids"], [(model.transformer.h[1], lambda m, a, o: o + vector)]
    )
    want = (edited - clean).abs().mean(1).numpy()
    np.testing.assert_allclose(f["effects/output_change"][:, 2], want, rtol=1e-5)


def test_a_patch_without_a_source_exits_2_with_its_message(tmp_path, lm, cli_in_process):
    out = cli_in_process(
        *base_args(lm), "intervene=edit", "intervene.edit.layers=[transformer.h.0]",
        "intervene.edit.op=patch", f"hydra.run.dir={tmp_path}",
    )  # fmt: skip
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "op=patch needs a source" in out.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "probe.h5").exists()
