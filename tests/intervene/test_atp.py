"""Attribution patching beside the exact grid: exact where the model is linear in the patched
site, equal to a hand-written (source - target) x autograd gradient on a tiny GPT-2, and the QK
fix's attention probabilities equal to those of the exact patched forward."""

from __future__ import annotations

import logging

import h5py
import numpy as np
import pandas as pd
import torch

from tests.helpers import hf, run_probe


def grid_args(model, path, *extra):
    return ["model=hf", f"model.name={model}", "model.task=causal_lm", "dataset=pairs",
            f"dataset.path={path}", "dataset.batch_size=2", "probes=none", "intervene=patch_grid",
            *extra]  # fmt: skip


def test_atp_is_exact_on_a_model_linear_in_the_patched_site(tmp_path, lm):
    _, path, _ = lm
    args = ["model=custom", "model._target_=probe.testing.models.LinearLM", "dataset=pairs",
            f"dataset.path={path}", "dataset.batch_size=2", "probes=none", "intervene=patch_grid",
            "intervene.grid.method=[exact,atp]"]  # fmt: skip
    _, f = run_probe(tmp_path, *args)
    exact, atp = f["patching/logit_diff"][:], f["patching/logit_diff_atp"][:]
    assert np.abs(exact - f["patching/logit_diff_target"][:][:, None]).max() > 1e-3  # cells act
    np.testing.assert_allclose(atp, exact, rtol=1e-5, atol=1e-5)
    agreed = pd.read_csv(tmp_path / "patching_agreement.csv")
    assert agreed.spearman.min() > 0.999 and agreed.top10_recall.min() == 1.0


def test_atp_cells_equal_source_minus_target_times_the_autograd_gradient(tmp_path, lm):
    """Block outputs at every position: per sample, sum over the cell's position of (clean -
    corrupt) x d(logit_diff at the last position)/d(block output) on the corrupt run."""
    model_dir, path, pairs = lm
    _, f = run_probe(tmp_path, *grid_args(model_dir, path, "intervene.grid.method=atp"))
    model = hf(lm)
    blocks = list(model.transformer.h)
    seen = {}
    hooks = [b.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(i, o[0] if isinstance(o, tuple) else o))
             for i, b in enumerate(blocks)]  # fmt: skip
    with torch.no_grad():
        model(input_ids=pairs["clean_ids"])
    clean = {i: v.clone() for i, v in seen.items()}
    logits = model(input_ids=pairs["corrupt_ids"]).logits[:, -1]
    for h in hooks:
        h.remove()
    rows = torch.arange(len(logits))
    metric = logits[rows, pairs["answer"]] - logits[rows, pairs["wrong"]]
    grads = torch.autograd.grad(metric.sum(), [seen[i] for i in range(len(blocks))])
    cells = []
    for i, g in enumerate(grads):
        delta = ((clean[i] - seen[i]).detach() * g).sum(-1)  # (N, T): each position's cell
        cells.append(metric.detach()[:, None] + delta)
    want = torch.cat(cells, 1).double().numpy()  # cells in layer, then position order
    np.testing.assert_allclose(f["patching/logit_diff_atp"][:], want, rtol=1e-5, atol=1e-6)
    table = pd.read_csv(tmp_path / "patching.csv")
    assert set(table.method) == {"atp"} and "patching/logit_diff" not in f  # no exact cell ran


def test_the_qk_fix_recomputes_the_patched_keys_attention_exactly(tmp_path, lm):
    """The exact grid's patched forward of a key cell has the attention probabilities that
    atp_star recomputes from the target's queries and keys with that key patched."""
    from probe.intervene import attention

    model_dir, path, pairs = lm
    args = grid_args(model_dir, path, "intervene.grid.layers=[@attn]", "intervene.grid.site=key",
                     "intervene.grid.over=[layer,position,head]",
                     "intervene.grid.method=[exact,atp,atp_star]")  # fmt: skip
    _, f = run_probe(tmp_path, *args)
    table = pd.read_csv(tmp_path / "patching.csv")
    assert set(table.method) == {"exact", "atp", "atp_star"}
    # by hand: the probabilities of layer 0 head 1 with the key at position 2 from the clean run
    model = hf(lm)
    kept, source = {}, {}
    attn = model.transformer.h[0].attn
    recorded = {}
    attention.register()
    model.set_attn_implementation(attention.NAME)

    class Keep:
        mode = None

        def before(self, name, q, k):
            if self.mode == "patch":
                k = k.clone()
                k[:, 1, 2] = recorded["key"][:, 1, 2]
            return q, k

        def after(self, name, q, k, w, mask, scaling):
            if self.mode == "record":
                recorded["key"] = k.detach().clone()
            elif self.mode == "target":
                kept.update(query=q.detach(), key=k.detach(), weights=w.detach(), mask=mask,
                            scaling=scaling)  # fmt: skip
            elif self.mode == "patch":
                source["weights"] = w.detach()

    keeper = Keep()
    attention._handlers[id(attn)] = (keeper, "transformer.h.0.attn")
    try:
        for mode, ids in (
            ("record", "clean_ids"),
            ("target", "corrupt_ids"),
            ("patch", "corrupt_ids"),
        ):
            keeper.mode = mode
            with torch.no_grad():
                model(input_ids=pairs[ids])
    finally:
        attention._handlers.pop(id(attn))
    at = torch.full((len(pairs["clean_ids"]),), 2)
    recomputed = attention.patched_pattern(kept, recorded["key"], "key", 1, at)
    groups = kept["query"].shape[1] // kept["key"].shape[1]
    np.testing.assert_allclose(
        recomputed.numpy(), source["weights"][:, 1 * groups : 2 * groups].double().numpy(),
        rtol=1e-5, atol=1e-7,
    )  # fmt: skip


def test_atp_on_an_input_without_gradient_is_a_named_error(tmp_path, lm, cli_in_process):
    model_dir, path, _ = lm
    out = cli_in_process(*grid_args(model_dir, path, "intervene.grid.layers=[transformer.wte]",
                                    "intervene.grid.site=input", "intervene.grid.over=[layer]",
                                    "intervene.grid.method=atp"), f"hydra.run.dir={tmp_path}")  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    assert (
        "method atp needs the gradient of 'transformer.wte''s input, which has none" in out.stderr
    )


def test_a_grid_over_a_block_and_its_children_says_so_first(tmp_path, lm, caplog):
    caplog.set_level(logging.WARNING, logger="probe")
    model_dir, path, _ = lm
    run_probe(tmp_path, *grid_args(model_dir, path, "intervene.grid.layers=[transformer.h.*]",
                                   "intervene.grid.over=[layer]", "intervene.grid.method=atp"))  # fmt: skip
    line = next(m for m in caplog.messages if "select" in m and "@blocks" in m)
    assert "select 26 modules, 24 of them inside another selected one" in line
    with h5py.File(tmp_path / "probe.h5") as f:
        assert f["patching/logit_diff_atp"].shape[1] == 26
