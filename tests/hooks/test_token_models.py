"""Token models end to end: tiny GPT-2, BERT and Llama saved with save_pretrained, token data with
padding, captures compared with the model's own hidden states, numpy and autograd."""

from __future__ import annotations

import h5py
import numpy as np
import pandas as pd
import pytest
import torch
from omegaconf import open_dict

import probe
from probe.config import EditSpec, ProbeSpec
from probe.data.batches import build_batches
from probe.launch.run import run
from probe.models.build import build_model
from probe.plan import parse
from probe.read.summaries import summarize_file
from probe.testing.compose import make_cfg
from probe.testing.tiny_lms import make_tiny
from tests.helpers import assert_same_arrays, cloned_outputs, run_probe

LAYERS = {"gpt2": "transformer.h", "bert": "bert.encoder.layer", "llama": "model.layers"}
TASKS = {"gpt2": "causal_lm", "bert": "masked_lm", "llama": "causal_lm"}
N, T = 7, 12


def token_batch() -> dict[str, torch.Tensor]:
    """7 sequences of 12 ids in 3..99, two right-padded (pad id 0) and one left-padded."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 100, (N, T), generator=g)
    mask = torch.ones(N, T, dtype=torch.long)
    mask[2, 9:] = 0
    mask[5, 4:] = 0
    mask[6, :3] = 0
    ids[mask == 0] = 0
    return {"input_ids": ids, "attention_mask": mask}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{kind: (model dir, tokens file)} of the three families."""
    root = tmp_path_factory.mktemp("hf")
    path = root / "tokens.pt"
    torch.save(token_batch(), path)
    return {kind: (make_tiny(kind, root / kind), path) for kind in LAYERS}


def model_args(saved, kind: str, *extra: str) -> list[str]:
    directory, path = saved[kind]
    return [
        "model=hf",
        f"model.name={directory}",
        f"model.task={TASKS[kind]}",
        "dataset=tokens",
        f"dataset.path={path}",
        "dataset.batch_size=3",
        *extra,
    ]


SPECS = {"probes": ProbeSpec, "intervene": EditSpec}


def run_with(tmp_path, args: list[str], **groups) -> h5py.File:
    """Run with named probes or edits added to the composed config (the command line can only
    change those the config files hold)."""
    cfg = make_cfg(*args)
    with open_dict(cfg):
        for group, entries in groups.items():
            for name, spec in entries.items():
                cfg[group][name] = SPECS[group](**spec)
    return h5py.File(run(cfg, run_dir=tmp_path).h5_path, "r")


def plain_outputs(args: list[str], names: list[str]) -> dict:
    """What plain hooks see at `names` over the dataset of `args`, on the model they build."""
    cfg = make_cfg(*args)
    model = build_model(parse(cfg).model, cfg.seed)
    inputs = [b.inputs for b in build_batches(parse(cfg).data, parse(cfg).model, cfg.seed)]
    return cloned_outputs(model, names, inputs)


def reference(saved, kind: str, **kwargs):
    """The saved model's own forward over the whole token batch."""
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    cls = AutoModelForMaskedLM if kind == "bert" else AutoModelForCausalLM
    model = cls.from_pretrained(saved[kind][0]).eval()
    with torch.no_grad():
        return model, model(**token_batch(), output_hidden_states=True, **kwargs)


@pytest.mark.parametrize("kind", list(LAYERS))
def test_block_outputs_equal_the_models_hidden_states(tmp_path, saved, kind):
    """Every block output (the residual probe, rows of samples) equals output_hidden_states where
    they coincide (GPT-2's and Llama's last hidden state has the final norm applied); the stored
    logits are each sample's last real token's."""
    args = model_args(saved, kind, "probes=residual", "probes.residual.rows=samples")
    _, f = run_probe(tmp_path, *args)
    _, out = reference(saved, kind)
    blocks = [f"{LAYERS[kind]}.{i}" for i in range(2)]
    coincide = blocks if kind == "bert" else blocks[:-1]
    for i, name in enumerate(coincide):
        got = f[f"layers/{name}/output"][:]
        np.testing.assert_allclose(got, out.hidden_states[i + 1].numpy(), rtol=1e-5, atol=1e-6)
    last = torch.tensor([11, 11, 8, 11, 11, 3, 11])
    logits = out.logits[torch.arange(N), last].numpy()
    np.testing.assert_allclose(f["model/output.logits"][:], logits, rtol=1e-5, atol=1e-5)
    assert f.attrs["num_samples"] == N and f.attrs["complete"]


def test_token_rows_are_the_real_tokens_in_order(tmp_path, saved):
    """rows: tokens holds the (N, T, C) capture's rows at real tokens, and /tokens maps every row
    back to its sample, position and id; statistics count no padding."""
    _, f = run_probe(tmp_path, *model_args(saved, "gpt2", "probes=residual"))
    _, out = reference(saved, "gpt2")
    batch = token_batch()
    mask = batch["attention_mask"].bool()
    want = out.hidden_states[1][mask].numpy()
    np.testing.assert_allclose(f["layers/transformer.h.0/output"][:], want, rtol=1e-5, atol=1e-6)
    samples, positions = np.nonzero(mask.numpy())
    np.testing.assert_array_equal(f["tokens/sample"][:], samples)
    np.testing.assert_array_equal(f["tokens/position"][:], positions)
    np.testing.assert_array_equal(f["tokens/id"][:], batch["input_ids"][mask].numpy())
    assert f.attrs["num_tokens"] == mask.sum()
    row = probe.open_run(tmp_path).summary.set_index("layer").loc["transformer.h.0"]
    assert row["rows"] == mask.sum() and row["n"] == want.size and row["units"] == 32
    np.testing.assert_allclose(row["mean"], want.astype(np.float64).mean(), rtol=1e-6)
    np.testing.assert_allclose(
        row["l2_mean"], np.linalg.norm(want.astype(np.float64), axis=1).mean(), rtol=1e-6
    )
    pd.testing.assert_frame_equal(probe.open_run(tmp_path).tokens().astype("int64"), pd.DataFrame(
        {"sample": samples, "position": positions, "id": batch["input_ids"][mask].numpy()}
    ))  # fmt: skip


def test_token_reductions_equal_numpy_on_the_masked_values(tmp_path, saved):
    """token_mean and last_token skip padding; first_token is each sample's first real token."""
    args = model_args(
        saved,
        "gpt2",
        "probes=residual",
        "probes.residual.layers=[transformer.h.0]",
        "probes.residual.rows=samples",
        "probes.residual.reduce=token_mean",
    )
    extra = {
        "last": {"layers": ["transformer.drop"], "reduce": "last_token"},
        "first": {"layers": ["transformer.wte"], "reduce": "first_token"},
    }
    f = run_with(tmp_path, args, probes=extra)
    model, out = reference(saved, "gpt2")
    batch = token_batch()
    m = batch["attention_mask"].numpy().astype(bool)
    h0 = out.hidden_states[1].numpy().astype(np.float64)
    means = np.stack([h0[i][m[i]].mean(0) for i in range(N)])
    np.testing.assert_allclose(f["layers/transformer.h.0/output"][:], means, rtol=1e-5, atol=1e-6)
    embedded = out.hidden_states[0].numpy()  # token and position embeddings, after dropout
    lasts = np.stack([embedded[i][np.nonzero(m[i])[0][-1]] for i in range(N)])
    np.testing.assert_allclose(f["layers/transformer.drop/output"][:], lasts, rtol=1e-6)
    firsts = [batch["input_ids"][i][np.nonzero(m[i])[0][0]] for i in range(N)]
    embedded = model.transformer.wte(torch.stack(firsts)).detach().numpy()
    np.testing.assert_allclose(f["layers/transformer.wte/output"][:], embedded, rtol=1e-6)


def test_lm_loss_gradients_of_block_outputs_equal_autograd(tmp_path, saved):
    """objective=lm_loss: next-token cross-entropy summed over real positions; the captured
    grad_output of each block equals torch.autograd.grad of HF's own loss times its count."""
    args = model_args(
        saved, "gpt2", "probes=residual", "probes.residual.rows=samples",
        "probes.residual.capture=[output,grad_output]", "objective=lm_loss",
    )  # fmt: skip
    _, f = run_probe(tmp_path, *args)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(saved["gpt2"][0]).eval()
    batch = token_batch()
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    kept = []
    handles = [
        model.transformer.h[i].register_forward_hook(lambda m, a, o: kept.append(o))
        for i in range(2)
    ]
    out = model(**batch, labels=labels)
    for h in handles:
        h.remove()
    counted = int((labels[:, 1:] != -100).sum())
    grads = torch.autograd.grad(out.loss * counted, kept)
    for i, g in enumerate(grads):
        got = f[f"layers/transformer.h.{i}/grad_output"][:]
        np.testing.assert_allclose(got, g.numpy(), rtol=1e-4, atol=1e-7)


def test_per_unit_statistics_of_a_token_layout_are_over_its_last_axis(tmp_path, saved):
    """unit_axis auto puts a block's units on the features: per-unit counts, sums and extremes
    equal numpy's over (N, T) of the (N, T, C) capture; l2_mean is per sample; summarizing the
    file again gives the run's table."""
    args = model_args(saved, "llama", "probes=residual", "probes.residual.rows=samples")
    result, f = run_probe(tmp_path, *args)
    x = f["layers/model.layers.0/output"][:].astype(np.float64)
    units = probe.open_run(tmp_path).units("model.layers.0", "output")
    flat = x.reshape(-1, x.shape[-1])
    assert len(units) == 32
    np.testing.assert_allclose(units["mean"], flat.mean(0), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(units["min"], flat.min(0))
    np.testing.assert_allclose(units["max"], flat.max(0))
    np.testing.assert_allclose(units["frac_positive"], (flat > 0).mean(0))
    row = result.summary.set_index("layer").loc["model.layers.0"]
    np.testing.assert_allclose(row["l2_mean"], np.linalg.norm(x.reshape(N, -1), axis=1).mean())
    again = summarize_file(result.h5_path).table
    pd.testing.assert_frame_equal(again, result.summary, check_exact=False, rtol=1e-9)


def test_stats_only_equals_full_capture(tmp_path, saved):
    """store=stats on token rows: the same statistics as the full run, nothing of the layers."""
    full, _ = run_probe(tmp_path / "full", *model_args(saved, "bert", "probes=attn_mlp"))
    stats, f = run_probe(
        tmp_path / "stats", *model_args(saved, "bert", "probes=attn_mlp", "store=stats")
    )
    assert "layers" not in f and set(full.summary.layer) >= {"bert.encoder.layer.0.output.dense"}
    pd.testing.assert_frame_equal(stats.summary, full.summary, check_exact=False, rtol=1e-9)


def test_model_saved_and_loaded_by_directory_answers_as_the_saved_model(tmp_path, saved):
    """model.name=DIR loads the saved weights: /model/output (all positions) equals its forward."""
    args = model_args(saved, "llama", "probes=residual", "store.model_output=full")
    _, f = run_probe(tmp_path, *args)
    _, out = reference(saved, "llama")
    np.testing.assert_allclose(
        f["model/output.logits"][:], out.logits.numpy(), rtol=1e-5, atol=1e-5
    )


def test_an_edit_on_a_language_model_reports_the_kl_of_its_next_token(tmp_path, saved):
    """Zeroing a block's MLP: effects.csv's kl_mean is KL(clean || edited) of the next-token
    distributions at each sample's last real token, from the stored clean and edited logits."""
    edit = {"cut": {"layers": ["transformer.h.1.mlp"], "op": "zero"}}
    f = run_with(tmp_path, model_args(saved, "gpt2", "probes=residual"), intervene=edit)
    clean = torch.from_numpy(f["model/output_clean.logits"][:]).double().log_softmax(1)
    edited = torch.from_numpy(f["model/output.logits"][:]).double().log_softmax(1)
    kl = (clean.exp() * (clean - edited)).sum(1).mean().item()
    effects = pd.read_csv(tmp_path / "effects.csv")
    assert kl > 0
    np.testing.assert_allclose(effects.kl_mean[0], kl, rtol=1e-5)


def test_stop_and_resume_of_token_rows_gives_the_uninterrupted_file(tmp_path, saved):
    """A SIGINT inside the 3rd forward of a token-row run, its /stats gone as after a SIGKILL,
    then resume=true: every dataset (token rows of padded batches, /tokens, /samples) and the
    table equal an uninterrupted run's."""
    from probe.launch.interrupt import Interrupted
    from probe.testing.models import SignalsItselfLM

    args = [
        "model=custom", "model._target_=probe.testing.models.SignalsItselfLM", "+model.kwargs.vocab=100",
        "dataset=tokens", f"dataset.path={saved['gpt2'][1]}", "dataset.batch_size=2",
        "probes=residual", "probes.residual.capture=[output,grad_output]",
        "objective=lm_loss", "store.flush_seconds=0",
    ]  # fmt: skip
    want = run(make_cfg(*args), run_dir=tmp_path / "reference")
    SignalsItselfLM.at_call = 2
    try:
        with pytest.raises(Interrupted):
            run(make_cfg(*args), run_dir=tmp_path / "run")
    finally:
        SignalsItselfLM.at_call = None
    with h5py.File(tmp_path / "run" / "probe.h5", "r+") as f:
        assert (f.attrs["num_samples"], f.attrs["num_tokens"]) == (6, 12 * 6 - 3 - 8)
        del f["stats"]  # as a SIGKILL leaves it: recomputed batch by batch from the token rows
    got = run(make_cfg(*args, "resume=true"), run_dir=tmp_path / "run")
    pd.testing.assert_frame_equal(got.summary, want.summary, check_exact=True)
    assert_same_arrays(got.h5_path, want.h5_path)


def test_torchrun_stitches_token_rows_into_the_single_process_file(tmp_path, saved):
    """2 processes of torchrun over padded token batches: the stitched file's token rows,
    /tokens (dataset-wide sample numbers) and table equal a single process's."""
    from tests.launch.test_distributed import single_process, torchrun

    args = [
        "model=custom", "model._target_=probe.testing.models.TinyLM", "+model.kwargs.vocab=100",
        "dataset=tokens", f"dataset.path={saved['gpt2'][1]}", "dataset.batch_size=2",
        "probes=residual",
    ]  # fmt: skip
    single_process(tmp_path / "single", *args)
    two = torchrun(tmp_path / "two", *args)
    assert two.returncode == 0, two.stderr + two.stdout
    assert assert_same_arrays(tmp_path / "two" / "probe.h5", tmp_path / "single" / "probe.h5") > 5
    with h5py.File(tmp_path / "two" / "probe.h5") as f:
        assert f.attrs["num_tokens"] == token_batch()["attention_mask"].sum()
    a, b = (pd.read_csv(tmp_path / d / "summary.csv") for d in ("two", "single"))
    pd.testing.assert_frame_equal(a, b, check_exact=False, rtol=1e-12, atol=0)


def test_a_timm_vision_transformer_blocks_equal_plain_hooks_with_per_feature_units(tmp_path):
    """model=timm: the residual stream of a ViT's blocks (rows of samples, (N, T, C)) equals
    what plain hooks see, and its units are the 192 features, not the 5 tokens."""
    args = [
        "model=timm", "model.name=vit_tiny_patch16_224", "+model.kwargs.img_size=32",
        "model.num_classes=10", "model.input_shape=[3,32,32]", "dataset.num_samples=5",
        "dataset.batch_size=2", "probes=residual", "probes.residual.rows=samples",
    ]  # fmt: skip
    result, f = run_probe(tmp_path, *args)
    names = [f"blocks.{i}" for i in range(12)]
    want = plain_outputs(args, names)
    for name in names:
        np.testing.assert_allclose(f[f"layers/{name}/output"][:], want[name], rtol=1e-5, atol=1e-5)
    assert set(result.summary.units) == {192}


def test_torchvision_vit_blocks_probe_averages_tokens_into_features(tmp_path):
    """The shipped blocks probe on torchvision's VisionTransformer: spatial_mean over the unit
    axis auto gives one value per feature, the mean over the tokens of each block's output."""
    args = [
        "model=custom", "model._target_=torchvision.models.VisionTransformer",
        "+model.kwargs.image_size=32", "+model.kwargs.patch_size=8", "+model.kwargs.num_layers=2",
        "+model.kwargs.num_heads=2", "+model.kwargs.hidden_dim=16", "+model.kwargs.mlp_dim=32",
        "+model.kwargs.num_classes=10", "model.input_shape=[3,32,32]", "model.num_classes=10",
        "dataset.num_samples=5", "dataset.batch_size=2", "probes=blocks",
    ]  # fmt: skip
    result, f = run_probe(tmp_path, *args)
    names = ["encoder.layers.encoder_layer_0", "encoder.layers.encoder_layer_1"]
    want = plain_outputs(args, names)
    for name in names:
        got = f[f"layers/{name}/output"][:]
        np.testing.assert_allclose(got, want[name].mean(1), rtol=1e-5, atol=1e-6)
    assert set(result.summary.units) == {16}


def test_random_tokens_are_all_tokens_even_the_pad_id(tmp_path, saved):
    """dataset=random_tokens (vocabulary 3: the pad id 0 is drawn too) on a model with a pad
    token: every id is a token row, in order, equal to the dataset's seeded ids."""
    from probe.data.token_sets import RandomTokens

    directory, _ = saved["gpt2"]
    args = ["model=hf", f"model.name={directory}", "model.task=causal_lm", "dataset=random_tokens",
            "dataset.num_samples=4", "dataset.seq_len=8", "dataset.vocab_size=3", "probes=residual"]  # fmt: skip
    _, f = run_probe(tmp_path, *args)
    ids = RandomTokens(4, 8, 3, 0).input_ids
    assert f.attrs["num_tokens"] == 32 and (ids == 0).any()
    np.testing.assert_array_equal(f["tokens/id"][:], ids.reshape(-1).numpy())
