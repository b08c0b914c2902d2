"""The fit's sparse codes (probe.analysis.fit.sparse_codes): the chosen pre-activations and their
decoding have the gradients autograd gives the dense formula (x @ W_enc + b_enc, kept at the
chosen (row, feature) pairs and 0 elsewhere, times W_dec), in both backward forms; batchtopk's
selection is torch.topk's over the whole batch; the trainer's step on the sparse form equals the
dense hand computation; the fit's fused Adam is Adam's loop to float rounding."""

from __future__ import annotations

import pytest
import torch

from probe.analysis.fit import sparse_codes
from probe.analysis.fit.options import FitOptions
from probe.analysis.fit.sparse_codes import Selection, decode, selected_preactivations, top_batch
from probe.analysis.fit.trainer_base import adam
from probe.analysis.fit.transcoder_trainer import TrainingTranscoder, train_step


def _selections(pre: torch.Tensor, k: int) -> dict[str, Selection]:
    """A per-row top-k and a whole-batch top-k of `pre` (rows of 0 and of many pairs)."""
    width = pre.shape[1]
    per_row = Selection.per_row(torch.topk(pre, k, dim=1).indices, width)
    flat = pre.flatten().topk(k * pre.shape[0]).indices
    return {"per_row": per_row, "flat": Selection.flat(flat, (pre.shape[0], width))}


@pytest.mark.parametrize("form", ["dense", "sparse"])
@pytest.mark.parametrize("kind", ["per_row", "flat"])
def test_sparse_codes_have_the_dense_formulas_gradients(form, kind, monkeypatch):
    """Gradients of a loss through selected_preactivations -> ReLU -> decode in x, W_enc,
    b_enc and W_dec equal autograd's through the dense formula to 1e-12 (float64), and
    torch.autograd.gradcheck's finite differences."""
    monkeypatch.setattr(sparse_codes, "DENSE_SHARE", 0.0 if form == "dense" else 2.0)
    g = torch.Generator().manual_seed(0)
    rows, d_in, width, d_out, k = 9, 5, 12, 4, 3
    x = torch.randn(rows, d_in, generator=g, dtype=torch.double, requires_grad=True)
    W_enc = torch.randn(d_in, width, generator=g, dtype=torch.double, requires_grad=True)
    b_enc = torch.randn(width, generator=g, dtype=torch.double, requires_grad=True)
    W_dec = torch.randn(width, d_out, generator=g, dtype=torch.double, requires_grad=True)
    target = torch.randn(rows, d_out, generator=g, dtype=torch.double)
    with torch.no_grad():
        pre = x @ W_enc + b_enc
    sel = _selections(pre, k)[kind]
    if kind == "flat":
        counts = torch.bincount(sel.rows, minlength=rows)
        assert counts.min() != counts.max()  # rows of different counts (and maybe none)
    assert sel.dense_backward == (form == "dense")

    def sparse(x, W_enc, b_enc, W_dec):
        with torch.no_grad():
            pre = x @ W_enc + b_enc
        values = torch.relu(selected_preactivations(x, W_enc, b_enc, pre, sel))
        return decode(values, sel, W_dec)

    def dense(x, W_enc, b_enc, W_dec):
        keep = torch.zeros(rows * width, dtype=torch.bool)
        keep[sel.flat_indices] = True
        acts = torch.relu(x @ W_enc + b_enc) * keep.view(rows, width)
        return acts @ W_dec

    inputs = (x, W_enc, b_enc, W_dec)
    got = torch.autograd.grad((sparse(*inputs) - target).pow(2).sum(), inputs)
    want = torch.autograd.grad((dense(*inputs) - target).pow(2).sum(), inputs)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sparse(*inputs), dense(*inputs), rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(sparse, inputs)


def test_batchtopk_selection_is_torch_topk_over_the_batch():
    """top_batch chooses the pairs of torch.topk over the flattened batch: through the sampled
    threshold on random rows, and through the full top-k where too few entries pass that
    threshold (every sampled entry above every other)."""
    g = torch.Generator().manual_seed(2)
    pre = torch.randn(300, 64, generator=g)
    rigged = torch.randn(300, 64, generator=g)
    rigged.view(-1)[::8] += 100  # the sampled entries (0, 8, 16, ...)
    for rows, k in ((pre, 8), (rigged, 8), (pre, 64)):
        want = rows.flatten().topk(min(k * len(rows), rows.numel())).indices.sort().values
        got = top_batch(rows, k)
        assert torch.equal(got.flat_indices, want)
        assert torch.equal(got.rows * 64 + got.features, want)


def test_the_sparse_backward_step_equals_the_dense_hand_step():
    """At width 512 and k 2 (under DENSE_SHARE: the sparse backward), three topk train_steps
    equal Adam on the dense formula (top-k of x @ W_enc + b_enc, ReLU'd, times W_dec) to 1e-6."""
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(64, 8, generator=g), torch.randn(64, 6, generator=g)) for _ in range(3)]
    options = FitOptions(activation="topk", width=512, k=2, lr=1e-2, lr_warmup=0, lr_decay=0,
                         aux_coefficient=0)  # fmt: skip
    model = TrainingTranscoder(8, 6, options, seed=0, total_steps=3)
    model.start(*batches[0])
    assert sparse_codes.DENSE_SHARE > 2 / 512
    hand = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    hand_opt = torch.optim.Adam(list(hand.values()), lr=1e-2)
    for x, y in batches:
        xs, ys = x * model.x_scale - model.x_mean, y * model.y_scale
        pre = xs @ hand["W_enc"] + hand["b_enc"]
        top = pre.topk(2, dim=1)
        acts = torch.zeros_like(pre).scatter(1, top.indices, top.values.clamp_min(0))
        loss = (acts @ hand["W_dec"] + hand["b_dec"] - ys).pow(2).mean()
        hand_opt.zero_grad()
        loss.backward()
        hand_opt.step()
        train_step(model, opt, x, y)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p, hand[n], rtol=1e-5, atol=1e-6)


def test_the_fits_fused_adam_is_adams_loop():
    """adam() (torch's fused Adam) moves a batchtopk transcoder as Adam's loop over operations
    does, over ten steps, to 1e-6."""
    g = torch.Generator().manual_seed(6)
    batches = [
        (torch.randn(64, 8, generator=g), torch.randn(64, 6, generator=g)) for _ in range(10)
    ]
    options = FitOptions(activation="batchtopk", width=32, k=4, lr=1e-2)
    models = [TrainingTranscoder(8, 6, options, seed=0, total_steps=10) for _ in range(2)]
    fused, loop = adam(models[0].parameters(), 1e-2), torch.optim.Adam(models[1].parameters(), 1e-2)
    assert fused.defaults["fused"] and not loop.defaults["fused"]
    for model, opt in zip(models, (fused, loop), strict=True):
        model.start(*batches[0])
        for x, y in batches:
            train_step(model, opt, x, y)
    for (n, a), b in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=n)
