"""Sparse autoencoders as sites of a layer (a probe's `sae`): latents equal SAELens's encode
written in numpy, the error term leaves a spliced model exact, the loss change equals plain
hooks', the FVU equals float64 numpy (not the mean-removed formula); bad SAEs exit 2 by name."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

import probe
from probe.testing.tiny_lms import make_tiny
from tests.helpers import run_probe
from tests.models.test_sae_loading import reference, write_sae

WIDTH, LATENTS, K = 32, 64, 6


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    """A tiny GPT-2 (width 32, vocabulary 40) and right-padded ids with a mask."""
    root = tmp_path_factory.mktemp("sae_lm")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 40, (10, 12), generator=g)
    lengths = torch.randint(5, 13, (10,), generator=g)
    mask = (torch.arange(12)[None] < lengths[:, None]).long()
    torch.save({"input_ids": ids * mask, "attention_mask": mask}, root / "ids.pt")
    return make_tiny("gpt2", root / "gpt2", vocab_size=40), root / "ids.pt", ids, mask


def sae_tensors(arch: str, seed: int = 0, offset: float = 0.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    found = {
        "W_enc": torch.randn(WIDTH, LATENTS, generator=g) * 0.3,
        "b_enc": torch.randn(LATENTS, generator=g) * 0.1,
        "W_dec": torch.randn(LATENTS, WIDTH, generator=g) * 0.1,
        "b_dec": torch.randn(WIDTH, generator=g) * 0.1 + offset,
    }
    if arch == "jumprelu":
        found["threshold"] = torch.rand(LATENTS, generator=g) * 0.3
    return found


def an_sae(folder, arch="standard", **kw):
    tensors = sae_tensors(arch, **kw)
    write_sae(
        folder, arch, tensors, d_in=WIDTH, d_sae=LATENTS, **({"k": K} if arch == "topk" else {})
    )
    return tensors


def run_lm(lm, run_dir, *args):
    model, ids_path, _, _ = lm
    return run_probe(run_dir, "model=hf", f"model.name={model}", "model.task=causal_lm",
                     "dataset=tokens", f"dataset.path={ids_path}", "dataset.batch_size=4",
                     "probes=none", "+probes.block.layers=[transformer.h.0]", *args)  # fmt: skip


def output_key(f) -> str:
    return "output" if "layers/transformer.h.0/output" in f else "output.0"


def latents_of(run_dir) -> np.ndarray:
    with probe.open_run(run_dir) as run:
        return run.array("transformer.h.0", "sae.latents")[:]


@pytest.mark.parametrize("stored", ["sparse", "dense"])
@pytest.mark.parametrize("arch", ["standard", "topk", "jumprelu"])
def test_latents_equal_numpy_encode(lm, tmp_path, arch, stored):
    """Stored sparse (slots of active latents, read back dense) or dense float16."""
    tensors = an_sae(tmp_path / "sae", arch)
    dense = "true" if stored == "dense" else "false"
    _, f = run_lm(
        lm, tmp_path / "run", f"+probes.block.sae={{path:{tmp_path / 'sae'},dense:{dense}}}"
    )
    with f:
        x = f[f"layers/transformer.h.0/{output_key(f)}"][:]
        error = f["layers/transformer.h.0/sae.error"][:]
        names = set(f["layers/transformer.h.0"])
    latents = latents_of(tmp_path / "run")
    z, rebuilt = reference(tensors, x, arch, k=K)
    if stored == "dense":
        assert "sae.latents" in names and "sae.latents.index" not in names
        np.testing.assert_allclose(latents, z.astype(np.float16), rtol=1e-3, atol=1e-3)
    else:
        assert "sae.latents" not in names and {"sae.latents.index", "sae.latents.value"} <= names
        np.testing.assert_allclose(latents, z, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(error, x - rebuilt, rtol=1e-4, atol=1e-5)
    if arch == "topk":
        assert ((latents > 0).sum(-1) <= K).all() and ((latents > 0).sum(-1) == K).any()
    if arch == "jumprelu":
        pre = (x - tensors["b_dec"].numpy()) @ tensors["W_enc"].numpy() + tensors["b_enc"].numpy()
        assert (latents[pre <= tensors["threshold"].numpy()] == 0).all()
    table = pd.read_csv(tmp_path / "run" / "sae.csv").iloc[0]
    _, _, _, mask = lm
    real = mask.bool().numpy()
    assert table["rows"] == real.sum() and table["truncated_rows"] == 0
    assert table["l0"] == pytest.approx((z[real] > 0).sum(-1).mean())
    assert table["dead_latents"] == int(((z[real] > 0).sum(0) == 0).sum())


def test_rows_with_more_active_latents_than_slots_keep_their_largest(lm, tmp_path):
    """sae.max_active=3 on a standard SAE: each stored row holds its 3 largest latents (slots
    sorted, -1 and 0 where fewer are active); sae.csv counts the real rows that had more."""
    tensors = an_sae(tmp_path / "sae")
    _, f = run_lm(lm, tmp_path / "run", f"+probes.block.sae={{path:{tmp_path / 'sae'},max_active:3}}",
                  "+probes.block.rows=tokens")  # fmt: skip
    with f:
        x = f[f"layers/transformer.h.0/{output_key(f)}"][:]
        index = f["layers/transformer.h.0/sae.latents.index"][:]
        value = f["layers/transformer.h.0/sae.latents.value"][:]
    z, _ = reference(tensors, x, "standard")
    assert index.shape == (len(z), 3) and index.dtype == np.int32
    want = np.sort(z, axis=1)[:, ::-1][:, :3]
    np.testing.assert_allclose(value, np.where(want > 0, want, 0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.take_along_axis(z, np.maximum(index, 0), 1)[index >= 0],
                               value[index >= 0], rtol=1e-6)  # fmt: skip
    assert (index[want <= 0] == -1).all()
    table = pd.read_csv(tmp_path / "run" / "sae.csv").iloc[0]
    assert table["slots"] == 3 and table["truncated_rows"] == int(((z > 0).sum(1) > 3).sum()) > 0


def test_error_term_leaves_the_model_exact(lm, tmp_path):
    an_sae(tmp_path / "sae")
    splice = f"+probes.block.sae={{path:{tmp_path / 'sae'},splice:true,error_term:true}}"
    _, spliced = run_lm(lm, tmp_path / "spliced", splice, "store.model_output=full")
    _, plain = run_lm(lm, tmp_path / "plain", "store.model_output=full")
    with spliced, plain:
        key = next(k for k in spliced["model"] if "logits" in k or k == "output")
        np.testing.assert_allclose(
            spliced[f"model/{key}"][:], plain[f"model/{key}"][:], rtol=1e-5, atol=1e-5
        )


def test_the_loss_change_equals_plain_hooks(lm, tmp_path):
    """ce_clean, ce_spliced and ce_zero of sae.csv against forwards with a plain hook that puts
    the reconstruction (or zeros) in place of the block's output."""
    from transformers import AutoModelForCausalLM

    from probe.models.sae import load_sae

    an_sae(tmp_path / "sae")
    run_lm(lm, tmp_path / "run", f"+probes.block.sae={{path:{tmp_path / 'sae'},splice:true}}")[
        1
    ].close()
    table = pd.read_csv(tmp_path / "run" / "sae.csv").iloc[0]
    model_dir, _, ids, mask = lm
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    sae = load_sae(tmp_path / "sae")
    ids = ids * mask

    def loss(replace):
        def hook(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            new = replace(hidden)
            return (new, *output[1:]) if isinstance(output, tuple) else new

        handle = model.transformer.h[0].register_forward_hook(hook) if replace else None
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits.double()
        if handle:
            handle.remove()
        ce = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, 40), ids[:, 1:].reshape(-1), reduction="none"
        )
        keep = mask[:, 1:].reshape(-1).bool()
        return float(ce[keep].mean())

    clean = loss(None)
    assert table["ce_clean"] == pytest.approx(clean, rel=1e-5)
    assert table["ce_spliced"] == pytest.approx(loss(lambda h: sae.decode(sae.encode(h))), rel=1e-5)
    assert table["ce_zero"] == pytest.approx(loss(torch.zeros_like), rel=1e-5)
    want = (table["ce_zero"] - table["ce_spliced"]) / (table["ce_zero"] - table["ce_clean"])
    assert table["ce_loss_recovered"] == pytest.approx(want)


def test_fvu_is_against_the_mean_of_x_not_of_the_error(lm, tmp_path):
    """An SAE whose reconstruction is offset (b_dec + 3): its error has a large mean, which the
    mean-removed formula (var(x - x_hat) / var(x)) leaves out and SAELens's does not."""
    an_sae(tmp_path / "sae", offset=3.0)
    _, f = run_lm(lm, tmp_path / "run", f"+probes.block.sae={tmp_path / 'sae'}")
    with f:
        x = f[f"layers/transformer.h.0/{output_key(f)}"][:].astype(np.float64)
        error = f["layers/transformer.h.0/sae.error"][:].astype(np.float64)
    real = lm[3].bool().numpy()
    x, error = x[real], error[real]
    fvu = (error**2).sum() / ((x - x.mean(0)) ** 2).sum()
    mean_removed = ((error - error.mean(0)) ** 2).sum() / ((x - x.mean(0)) ** 2).sum()
    got = pd.read_csv(tmp_path / "run" / "sae.csv").iloc[0]["fvu"]
    assert got == pytest.approx(fvu, rel=1e-5)
    assert abs(got - mean_removed) > 0.5 * fvu


def test_bad_saes_exit_2_by_name(lm, tmp_path, cli_in_process):
    model, ids_path, _, _ = lm
    base = ["model=hf", f"model.name={model}", "model.task=causal_lm", "dataset=tokens",
            f"dataset.path={ids_path}", "probes=none", "+probes.block.layers=[transformer.h.0]"]  # fmt: skip
    (tmp_path / "empty").mkdir()
    narrow = tmp_path / "narrow"
    write_sae(narrow)  # d_in 16, for a layer 32 wide
    unknown = tmp_path / "unknown"
    an_sae(unknown)
    (unknown / "cfg.json").write_text(
        (unknown / "cfg.json").read_text().replace('"standard"', '"gated"')
    )
    slots = f"{{path:{narrow},max_active:-1}}"
    cases = [(tmp_path / "empty", ["cfg.json"]), (narrow, ["d_in=16", "32 wide"]),
             (unknown, ["gated", "standard"]), (slots, ["max_active=-1", ">= 0"])]  # fmt: skip
    for i, (folder, words) in enumerate(cases):
        out = cli_in_process(
            *base, f"+probes.block.sae={folder}", f"hydra.run.dir={tmp_path / f'run{i}'}"
        )
        assert out.returncode == 2, out.stderr[-2000:]
        message = out.stderr.strip().splitlines()[-1]
        assert all(w in message for w in words), message


def test_latent_examples_and_frequency(lm, tmp_path):
    """stats.topk on the latents: each latent's examples are its largest values; per-latent
    statistics count its active rows."""
    an_sae(tmp_path / "sae")
    _, f = run_lm(lm, tmp_path / "run", f"+probes.block.sae={tmp_path / 'sae'}", "stats.topk=3",
                  "+probes.block.rows=tokens")  # fmt: skip
    f.close()
    with probe.open_run(tmp_path / "run") as run:
        latents = run.array("transformer.h.0", "sae.latents")[:]
        table = run.topk("transformer.h.0", "sae.latents", unit=[0, 5])
        units = run.units("transformer.h.0", "sae.latents")
    for u in (0, 5):
        want = np.sort(latents[:, u])[::-1][:3]
        np.testing.assert_allclose(table[table["unit"] == u]["value"], want, rtol=1e-6)
    frac = (latents > 0).mean(0)
    column = next(c for c in ("frac_positive", "active_frac", "positive_frac") if c in units)
    np.testing.assert_allclose(units[column].to_numpy(), frac, rtol=1e-9)


@pytest.mark.cuda
def test_sae_sites_on_the_gpu_equal_the_cpus(lm, tmp_path, monkeypatch):
    """Encoded where the output lives (TF32 off): the GPU run's latents, error and report are
    the CPU run's."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    an_sae(tmp_path / "sae", "topk")
    splice = f"+probes.block.sae={{path:{tmp_path / 'sae'},splice:true}}"
    _, gpu = run_lm(lm, tmp_path / "gpu", splice, "device=cuda")
    _, cpu = run_lm(lm, tmp_path / "cpu", splice)
    with gpu, cpu:
        a, b = (f["layers/transformer.h.0/sae.error"][:] for f in (gpu, cpu))
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg="sae.error")
    a, b = (latents_of(tmp_path / d) for d in ("gpu", "cpu"))
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg="sae.latents")
    a, b = (pd.read_csv(tmp_path / d / "sae.csv").iloc[0] for d in ("gpu", "cpu"))
    for column in ("rows", "l0", "fvu", "ce_clean", "ce_spliced", "ce_zero"):
        assert a[column] == pytest.approx(b[column], rel=1e-4), column


def test_statistics_at_close_from_sparse_rows_equal_the_runs(lm, tmp_path):
    """stats.during=close recomputes the latents' statistics from their stored slots: the same
    per-latent table as statistics taken while running (the slots hold every active latent)."""
    an_sae(tmp_path / "sae", "topk")
    sae = f"+probes.block.sae={tmp_path / 'sae'}"
    tables = []
    for during in ("run", "close"):
        run_lm(lm, tmp_path / during, sae, "+probes.block.rows=tokens", f"stats.during={during}")[
            1
        ].close()
        with probe.open_run(tmp_path / during) as run:
            tables.append(run.units("transformer.h.0", "sae.latents"))
    pd.testing.assert_frame_equal(tables[0], tables[1], check_exact=False, rtol=1e-6)


def test_conv_channel_latents_resume_to_the_uninterrupted_run(tmp_path):
    """An SAE over a conv layer's channels (unit axis 1: slots stored as (N, slots, H, W)),
    read back dense equal to numpy's encode of the stored maps; a run interrupted in its
    third batch and resumed stores the uninterrupted run's slots and statistics."""
    from probe.launch.run import run
    from probe.testing.compose import make_cfg
    from tests.helpers import run_interrupted

    g = torch.Generator().manual_seed(1)
    tensors = {"W_enc": torch.randn(4, 16, generator=g), "b_enc": torch.randn(16, generator=g) * 0.1,
               "W_dec": torch.randn(16, 4, generator=g) * 0.1, "b_dec": torch.zeros(4)}  # fmt: skip
    write_sae(tmp_path / "sae", "standard", tensors, d_in=4, d_sae=16)
    args = ["model=custom", "model._target_=probe.testing.models.SignalsItself",
            "model.input_shape=[3,8,8]", "model.num_classes=10", "dataset.num_samples=12",
            "dataset.batch_size=3", "probes=none", "+probes.c.layers=[conv]",
            f"+probes.c.sae={{path:{tmp_path / 'sae'},max_active:5}}", "stats.topk=2"]  # fmt: skip
    run(make_cfg(*args), run_dir=tmp_path / "reference")
    run_interrupted(tmp_path / "run", 2, *args)
    run(make_cfg(*args, "resume=true"), run_dir=tmp_path / "run")
    got = {}
    for name in ("reference", "run"):
        with probe.open_run(tmp_path / name) as r:
            maps = r.array("conv", "output")[:]
            got[name] = (r.array("conv", "sae.latents")[:], r.units("conv", "sae.latents"),
                         r.topk("conv", "sae.latents", unit=[0, 3]))  # fmt: skip
            assert r.array("conv", "sae.latents.index").shape == (12, 5, 8, 8)
    z, _ = reference(tensors, np.moveaxis(maps, 1, -1), "standard")
    kept = np.sort(z, axis=-1)[..., -5:][..., :1]  # rows with more than 5 active keep the 5 largest
    want = np.where(z >= kept, z, 0.0)
    assert ((z > 0).sum(-1) > 5).any()  # (some rows were cut)
    np.testing.assert_allclose(got["reference"][0], np.moveaxis(want, -1, 1), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got["run"][0], got["reference"][0])
    pd.testing.assert_frame_equal(got["run"][1], got["reference"][1])
    pd.testing.assert_frame_equal(got["run"][2], got["reference"][2])


def test_sparse_latents_index_like_an_array(lm, tmp_path):
    """run.array of slots: rows, a reversed slice, a row list and a unit read as numpy would."""
    an_sae(tmp_path / "sae")
    run_lm(
        lm, tmp_path / "run", f"+probes.block.sae={tmp_path / 'sae'}", "+probes.block.rows=tokens"
    )[1].close()
    with probe.open_run(tmp_path / "run") as run:
        lazy = run.array("transformer.h.0", "sae.latents")
        whole = lazy[:]
        assert lazy.shape == whole.shape == (len(whole), LATENTS) and lazy.dtype == np.float32
        for key in (
            3,
            -1,
            slice(2, 9),
            slice(None, None, -2),
            [0, 4, 5],
            (slice(1, 4), 7),
            (2, 7),
            (..., 7),
        ):
            np.testing.assert_array_equal(lazy[key], whole[key], err_msg=str(key))


def test_a_spliced_sae_beside_gradient_sites_is_refused(lm, tmp_path, cli_in_process):
    an_sae(tmp_path / "sae")
    model, ids_path, _, _ = lm
    out = cli_in_process(
        "model=hf", f"model.name={model}", "model.task=causal_lm", "dataset=tokens",
        f"dataset.path={ids_path}", "probes=none", "+probes.block.layers=[transformer.h.0]",
        f"+probes.block.sae={{path:{tmp_path / 'sae'},splice:true}}", "objective=lm_loss",
        "+probes.block.capture=[output,grad_output]", f"hydra.run.dir={tmp_path / 'run'}",
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    message = out.stderr.strip().splitlines()[-1]
    assert all(w in message for w in ("sae.splice=true", "grad_output", "transformer.h.0")), message
