"""The global gradient norms of a watched training (probe.train.grad_norms): how many times a
recorded step measures them (the one norm function counted) under gradient accumulation 2, with
and without clipping, in a plain loop, under transformers' Trainer and under Lightning, none at
unrecorded steps; and their values: grad_norm the clipped gradients' norm, grad_norm_preclip the
norm clip_grad_norm_ returned (the Trainer's logged grad_norm)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

import probe
from probe.testing.trainings import cnn, image_batches, image_loss, one_thread
from probe.train import grad_norms
from probe.train.ranks import RankMerge
from probe.train.step_hooks import StepRecord

ACCUMULATE, STEPS, EVERY = 2, 6, 2  # recorded steps 0, 2, 4
FC = {"fc": {"layers": ["fc"], "capture": ["param_grad"]}}


class Counted:
    """Counts the norm function's calls by the step of the watch `watch()` returns."""

    def __init__(self, monkeypatch, watch):
        self.watch, self.steps = watch, []
        real = grad_norms.global_norm

        def counted(grads):
            self.steps.append(self.watch().watcher.step)
            return real(grads)

        monkeypatch.setattr(grad_norms, "global_norm", counted)

    def per_step(self, steps: int) -> list[int]:
        return [self.steps.count(s) for s in range(steps)]


def total(params) -> float:
    """The float64 norm of every gradient together (the reference)."""
    return float(torch.nn.utils.get_total_norm([p.grad.double() for p in params]))


def loop(tmp_path, monkeypatch, clip=None, hand_over=False, every=EVERY, steps=STEPS,
         clip_from=0):  # fmt: skip
    """A plain loop of `steps` optimizer steps over ACCUMULATE micro-batches each, clipping to
    `clip` from step `clip_from` (and handing the clip's norm over with `hand_over`); the norm
    calls per step, the file's scalars, and the float64 norms before and after any clip and
    what clip_grad_norm_ returned, per step."""
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = image_batches(steps * ACCUMULATE)
    w = probe.watch(model, FC, out=tmp_path / "run", optimizer=opt, every=every)
    count = Counted(monkeypatch, lambda: w)
    pre, post, returned = [], [], []
    with one_thread(), w:
        for step in range(steps):
            opt.zero_grad()
            for batch in batches[step * ACCUMULATE : (step + 1) * ACCUMULATE]:
                (image_loss(model, batch) / ACCUMULATE).backward()
            params = list(model.parameters())
            pre.append(total(params))
            if clip is not None and step >= clip_from:
                norm = torch.nn.utils.clip_grad_norm_(params, clip)
                returned.append(float(norm))
                if hand_over:
                    w.clipped(norm)
            post.append(total(params))
            opt.step()
    scalars = probe.open_run(tmp_path / "run").train_scalars().set_index("step")
    return count.per_step(steps), scalars, np.array(pre), np.array(post), returned


def test_a_plain_loop_without_clipping_measures_once_a_recorded_step(tmp_path, monkeypatch):
    """The first recorded step measures at the end of each backward (the watch cannot know yet
    whether the loop changes the gradients after it); from then on one norm serves both."""
    counts, scalars, pre, post, _ = loop(tmp_path, monkeypatch)
    assert counts == [2, 0, 1, 0, 1, 0]
    np.testing.assert_array_equal(scalars.grad_norm, scalars.grad_norm_preclip)
    np.testing.assert_allclose(scalars.grad_norm, post[::EVERY], rtol=1e-7)
    np.testing.assert_array_equal(pre, post)


def test_a_plain_loop_clipping_by_hand_measures_at_each_backward(tmp_path, monkeypatch):
    """Clipped with nothing handed over: the norm at the end of each backward (the last one's
    is grad_norm_preclip), and grad_norm at the step."""
    counts, scalars, pre, post, returned = loop(tmp_path, monkeypatch, clip=0.01)
    assert counts == [3, 0, 3, 0, 3, 0]
    assert (pre > 10 * 0.01).all()  # (every step clipped)
    np.testing.assert_allclose(scalars.grad_norm_preclip, pre[::EVERY], rtol=1e-7)
    np.testing.assert_allclose(scalars.grad_norm_preclip, returned[::EVERY], rtol=1e-6)
    np.testing.assert_allclose(scalars.grad_norm, post[::EVERY], rtol=1e-7)


def test_a_clip_norm_handed_over_is_grad_norm_preclip(tmp_path, monkeypatch):
    """w.clipped(clip_grad_norm_(...)): grad_norm_preclip is the very value the clip returned,
    and after the first recorded step the watch measures only grad_norm."""
    counts, scalars, pre, post, returned = loop(tmp_path, monkeypatch, clip=0.01, hand_over=True)
    assert counts == [3, 0, 1, 0, 1, 0]
    np.testing.assert_array_equal(scalars.grad_norm_preclip, returned[::EVERY])
    np.testing.assert_allclose(scalars.grad_norm_preclip, pre[::EVERY], rtol=1e-6)
    np.testing.assert_allclose(scalars.grad_norm, post[::EVERY], rtol=1e-7)


def test_a_clip_switched_on_later_costs_one_steps_preclip(tmp_path, monkeypatch, caplog):
    """A loop that clips from step 2 on, nothing handed over: having learned that nothing
    changed the gradients, the watch stopped measuring at the end of each backward, so step 2
    has no grad_norm_preclip (said once); from step 3 on it measures there again."""
    with caplog.at_level(logging.WARNING, logger="probe"):
        counts, scalars, pre, post, _ = loop(tmp_path, monkeypatch, clip=0.01, every=1, steps=5,
                                             clip_from=2)  # fmt: skip
    assert counts == [2, 1, 1, 3, 3]
    preclip = scalars.grad_norm_preclip.to_numpy()
    assert np.isnan(preclip[2]) and not np.isnan(preclip[[0, 1, 3, 4]]).any()
    np.testing.assert_allclose(preclip[[0, 1, 3, 4]], pre[[0, 1, 3, 4]], rtol=1e-7)
    np.testing.assert_allclose(scalars.grad_norm, post, rtol=1e-7)
    said = [r.getMessage() for r in caplog.records if "grad_norm_preclip" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("step 2:") and "w.clipped(norm)" in said[0]


def test_a_norm_handed_over_after_the_optimizer_step_is_not_the_next_steps(tmp_path, caplog):
    """w.clipped after opt.step() would give the next step a norm of none of its gradients:
    said once, and the next step's grad_norm_preclip is its own."""
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pre = []
    with (caplog.at_level(logging.WARNING, logger="probe"),
          probe.watch(model, FC, out=tmp_path / "run", optimizer=opt) as w):  # fmt: skip
        for batch in image_batches(3):
            opt.zero_grad()
            image_loss(model, batch).backward()
            pre.append(total(model.parameters()))
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
            opt.step()
            w.clipped(norm)  # (too late: the step has ended)
    scalars = probe.open_run(tmp_path / "run").train_scalars()
    np.testing.assert_allclose(scalars.grad_norm_preclip, pre, rtol=1e-7)
    said = [r.getMessage() for r in caplog.records if "w.clipped" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("step 1:")


def test_global_norm_is_exact_to_float32_rounding_on_large_cpu_gradients():
    """Rows of 1024 values on the CPU (torch's float32 norm kernel accumulates one long sum
    there): float32, bfloat16 and float64 tensors of 4M, 1000 and 3 values against float64."""
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(2048, 2048, generator=g), torch.randn(1000, generator=g) * 1e-3,
             torch.randn(3, generator=g, dtype=torch.float64),
             torch.randn(77, 5, generator=g).to(torch.bfloat16)]  # fmt: skip
    norm = grad_norms.global_norm(grads)
    assert norm.dtype == torch.float64 and norm.dim() == 0
    want = torch.stack([g.double().square().sum() for g in grads]).sum().sqrt()
    np.testing.assert_allclose(float(norm), float(want), rtol=1e-8)
    # a sparse gradient (nn.Embedding(sparse=True)): its dense values' norm (1 and 2 + 2)
    sparse = torch.sparse_coo_tensor([[0, 3, 3]], [1.0, 2.0, 2.0], (5,))
    np.testing.assert_allclose(float(grad_norms.global_norm([sparse])), np.sqrt(17), rtol=1e-7)


def test_a_handed_over_norm_is_the_trainings_across_sharded_ranks():
    """Under FSDP each rank's measured norm is its shard's (the ranks' squares add up); a norm a
    clip returned is the training's already: rank 0's is kept."""
    merge = RankMerge.__new__(RankMerge)
    merge.rank, merge.world, merge.sharded = 0, 2, True
    record = StepRecord(0, {}, {}, {"grad_norm": 3.0, "grad_norm_preclip": 7.0}, [],
                        frozenset({"grad_norm_preclip"}))  # fmt: skip
    parts = [({}, [], {"grad_norm": 3.0, "grad_norm_preclip": 7.0}),
             ({}, [], {"grad_norm": 4.0, "grad_norm_preclip": 7.0})]  # fmt: skip
    merged = merge._merge(record, parts)
    assert merged.scalars == {"grad_norm": 5.0, "grad_norm_preclip": 7.0}


# -- transformers' Trainer ----------------------------------------------------------------------


def hf_training(tmp_path, monkeypatch, attach: bool, max_grad_norm: float):
    """A tiny Llama, 4 steps of 2 micro-batches, every 2nd step recorded."""
    pytest.importorskip("transformers")
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    from probe.integrations.hf import ProbeCallback
    from probe.testing.tiny_lms import tiny_config

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 40, (16, 6), generator=g)
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config("llama", 40)).train()
    args = TrainingArguments(
        output_dir=str(tmp_path / "trainer"), use_cpu=True, report_to=[], max_steps=4,
        per_device_train_batch_size=2, gradient_accumulation_steps=ACCUMULATE,
        train_sampling_strategy="sequential", learning_rate=1e-3, max_grad_norm=max_grad_norm,
        logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True,
    )  # fmt: skip
    data = [{"input_ids": row, "labels": row} for row in ids]
    up = {"up": {"layers": ["model.layers.0.mlp.up_proj"], "capture": ["param_grad"]}}
    callback = ProbeCallback(up, out=tmp_path / "w", every=EVERY)
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[] if attach else [callback])  # fmt: skip
    if attach:
        callback.attach(trainer)
    count = Counted(monkeypatch, lambda: callback.watch)
    with one_thread():
        trainer.train()
    assert "clip_grad_norm_" not in vars(trainer.accelerator)  # (given back)
    logged = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    scalars = probe.open_run(tmp_path / "w").train_scalars().set_index("step")
    return count.per_step(4), scalars, np.array(logged)


@pytest.mark.parametrize("max_grad_norm", [0.5, 0.0])
def test_the_trainer_attached_hands_its_clip_norm_over(tmp_path, monkeypatch, max_grad_norm):
    """cb.attach(trainer): grad_norm_preclip is the Trainer's logged grad_norm itself (its
    accelerator.clip_grad_norm_'s value, clipping or not), grad_norm one measurement."""
    counts, scalars, logged = hf_training(tmp_path, monkeypatch, True, max_grad_norm)
    assert counts == [1, 0, 1, 0]
    np.testing.assert_array_equal(scalars.grad_norm_preclip, logged[::EVERY])
    if max_grad_norm:
        assert (logged > max_grad_norm).all()  # (every step clipped)
        np.testing.assert_allclose(scalars.grad_norm, max_grad_norm, rtol=1e-6)
    else:
        np.testing.assert_allclose(scalars.grad_norm, logged[::EVERY], rtol=1e-6)


@pytest.mark.parametrize("max_grad_norm", [0.5, 0.0])
def test_the_trainer_unattached_measures_at_the_last_backward(tmp_path, monkeypatch,
                                                              max_grad_norm):  # fmt: skip
    """Trainer(callbacks=[cb]): grad_norm_preclip is measured at the end of the step's last
    backward (accelerate's sync_gradients says which), grad_norm at the step: 2 a step."""
    counts, scalars, logged = hf_training(tmp_path, monkeypatch, False, max_grad_norm)
    assert counts == [2, 0, 2, 0]
    np.testing.assert_allclose(scalars.grad_norm_preclip, logged[::EVERY], rtol=1e-6)
    want = max_grad_norm if max_grad_norm else logged[::EVERY]
    np.testing.assert_allclose(scalars.grad_norm, want, rtol=1e-6)


# -- Lightning -----------------------------------------------------------------------------------


@pytest.mark.parametrize("clip", [None, 0.02])
def test_lightning_measures_once_or_twice_a_recorded_step(tmp_path, monkeypatch, clip):
    """accumulate_grad_batches=2: the norm in on_before_optimizer_step (before the clip), and
    again after the step only where gradient_clip_val clipped; the values a hand loop's
    float64 norms before and after clip_grad_norm_ are."""
    L = pytest.importorskip("lightning")
    from probe.integrations.lightning import ProbeCallback

    class Lit(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = cnn()

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            return image_loss(self, batch)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    steps, batches = 4, image_batches(4 * ACCUMULATE)
    with one_thread():
        torch.manual_seed(0)
        hand = Lit()
        opt = hand.configure_optimizers()
        pre, post = [], []
        for step in range(steps):
            opt.zero_grad()
            for i in range(step * ACCUMULATE, (step + 1) * ACCUMULATE):
                (hand.training_step(batches[i], i) / ACCUMULATE).backward()
            pre.append(total(hand.parameters()))
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(list(hand.parameters()), clip)
            post.append(total(hand.parameters()))
            opt.step()
        torch.manual_seed(0)
        lit = Lit()
        callback = ProbeCallback({"c": {"layers": ["net.conv1"], "capture": ["param_grad"]}},
                                 out=tmp_path / "w", every=EVERY)  # fmt: skip
        count = Counted(monkeypatch, lambda: callback.watch)
        trainer = L.Trainer(
            accelerator="cpu", devices=1, max_steps=steps, accumulate_grad_batches=ACCUMULATE,
            gradient_clip_val=clip, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
        )  # fmt: skip
        trainer.fit(lit, torch.utils.data.DataLoader(batches, batch_size=None))
    assert count.per_step(steps) == ([1, 0, 1, 0] if clip is None else [2, 0, 2, 0])
    scalars = probe.open_run(tmp_path / "w").train_scalars()
    np.testing.assert_allclose(scalars.grad_norm_preclip, pre[::EVERY], rtol=1e-7)
    np.testing.assert_allclose(scalars.grad_norm, post[::EVERY], rtol=1e-7)
    if clip is None:
        np.testing.assert_array_equal(scalars.grad_norm, scalars.grad_norm_preclip)
    else:
        assert min(pre) > 10 * clip
