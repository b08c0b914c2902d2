"""Feature cards: the examples they show are the run's, highlighted where they are; cards follow
the asked order within the budget; images carry their thumbnails; SAE latents the tokens their
decoder direction promotes."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import torch

import probe
from tests.helpers import ROOT, image_folder, run_probe
from tests.hooks.test_sae_sites import an_sae, lm, run_lm  # noqa: F401  (the fixture)


def cards_of(page: str) -> list[str]:
    return re.findall(r'<div class="card">(.*?)</div>', page, flags=re.S)


def test_latent_cards_show_their_examples_in_order(lm, tmp_path):  # noqa: F811
    tensors = an_sae(tmp_path / "sae")
    _, f = run_lm(lm, tmp_path / "run", f"+probes.block.sae={tmp_path / 'sae'}", "+probes.block.rows=tokens",
                  "stats.topk=3", "stats.topk_quantiles=2")  # fmt: skip
    f.close()
    out = subprocess.run(
        [sys.executable, "-m", "probe.analyze", str(tmp_path / "run"), "topk", "--layer",
         "transformer.h.0", "--site", "sae.latents", "--cards", "5", "--order", "max"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    page = (tmp_path / "run" / "cards_transformer.h.0_sae.latents.html").read_text()
    cards = cards_of(page)
    assert len(cards) == 5
    with probe.open_run(tmp_path / "run") as run:
        units = run.units("transformer.h.0", "sae.latents")
        latents = run.array("transformer.h.0", "sae.latents")[:]
        ids = run.file["tokens/id"][: run.num_tokens]
    order = units[units["frac_positive"] > 0].sort_values("max", ascending=False, kind="stable")
    for card, unit in zip(cards, order["unit"][:5], strict=True):
        assert card.startswith(f"<h4>unit {unit}:")
        top = np.argsort(-latents[:, unit], kind="stable")[:3]
        marked = re.findall(r"<mark>(.*?)</mark>", card)[:3]
        assert marked == [f"&lt;{ids[i]}&gt;" for i in top]  # the examples' own tokens
        assert "histogram" in card and "promotes:" in card
    model_dir = lm[0]
    from transformers import AutoModelForCausalLM

    unembed = AutoModelForCausalLM.from_pretrained(model_dir).get_output_embeddings().weight
    with np.load(tmp_path / "run" / "sae_tokens.npz") as saved:
        want = torch.topk(tensors["W_dec"] @ unembed.detach().T, 10, dim=1)
        np.testing.assert_array_equal(saved["transformer.h.0/ids"], want.indices.numpy())


def test_image_cards_carry_thumbnails(tmp_path):
    root = image_folder(tmp_path / "images", size=8)
    _, f = run_probe(tmp_path / "run", "model=custom", "model._target_=probe.testing.models.TinyNet",
                     "model.input_shape=[3,8,8]", "model.num_classes=10", "dataset=imagefolder",
                     f"dataset.root={root}", "dataset.resize=8", "dataset.crop=8", "dataset.batch_size=2",
                     "probes=all_convs", "stats.topk=2")  # fmt: skip
    f.close()
    with probe.open_run(tmp_path / "run") as run:
        from probe.report.cards import cards_html

        page = cards_html(run, "conv", "output", units=[0, 1])
        maps = run.array("conv", "output")[:]
        paths = [
            p.decode() if isinstance(p, bytes) else str(p) for p in run.file["samples/path"][:]
        ]
    cards = cards_of(page)
    assert len(cards) == 2
    for card, unit in zip(cards, (0, 1), strict=True):
        names = re.findall(r'<img alt="([^"]+)" title', card)
        flat = maps[:, unit].reshape(-1)  # (the brute force: value desc, row asc)
        best = np.lexsort((np.arange(flat.size), -flat))[:2] // (maps.shape[2] * maps.shape[3])
        assert names == [paths[i] for i in best]


def test_a_cards_histogram_reads_the_units_own_column(lm, tmp_path):  # noqa: F811
    """Per-sample token rows (N, T, units): the histogram's values are the unit's, along the
    unit axis; latents in slots give the unit's active values without a dense read."""
    from probe.report.cards import _stored_column

    an_sae(tmp_path / "sae")
    run_lm(lm, tmp_path / "run", f"+probes.block.sae={tmp_path / 'sae'}")[1].close()
    with probe.open_run(tmp_path / "run") as run:
        error = run.array("transformer.h.0", "sae.error")[:]
        latents = run.array("transformer.h.0", "sae.latents")[:]
        assert error.ndim == 3 and latents.ndim == 3
        got = _stored_column(run, "transformer.h.0", "sae.error", 5)
        np.testing.assert_array_equal(got, error[..., 5].reshape(-1).astype(np.float64))
        got = _stored_column(run, "transformer.h.0", "sae.latents", 5)
        want = latents[..., 5][latents[..., 5] > 0]
        np.testing.assert_allclose(np.sort(got), np.sort(want.astype(np.float64)), rtol=1e-6)
    out = subprocess.run(
        [sys.executable, "-m", "probe.analyze", str(tmp_path / "run"), "topk", "--layer",
         "transformer.h.0", "--site", "sae.latents", "--units", "3", "64"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 2 and "--units 64" in out.stderr and "0 to 63" in out.stderr, (
        out.stderr
    )
