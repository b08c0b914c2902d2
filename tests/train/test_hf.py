"""transformers' Trainer with probe's ProbeCallback writes the file that probe.watch writes on the
same training run by hand (a tiny GPT-2, AdamW, the Trainer's gradient clipping, the same
batches in order): the same /train rows and scalars and the same train.csv; the chosen
statistics reach every report_to integration through the Trainer's log (read here by a
callback's on_log, where TensorBoard's, W&B's and MLflow's callbacks read them)."""

from __future__ import annotations

import h5py
import numpy as np
import pandas as pd
import pytest
import torch
from transformers import GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import probe
from probe.errors import ConfigError
from probe.integrations.hf import ProbeCallback
from probe.testing.tiny_lms import tiny_config
from probe.testing.trainings import assert_bitwise_equal, one_thread, state_of

PROBES = {
    "blocks": {"layers": ["transformer.h.*"], "types": ["GPT2Block"],
               "capture": ["output", "grad_output"]},
    "mlp": {"layers": ["transformer.h.0.mlp.c_fc"], "capture": ["output", "param_grad", "param_update"]},
}  # fmt: skip
STEPS, EVERY, ROWS, LR = 4, 2, 4, 1e-3


def gpt2() -> GPT2LMHeadModel:
    """The tests' 2-layer GPT-2 without dropout (the Trainer and the loop draw random numbers
    differently; the file's equality is the point here)."""
    config = tiny_config("gpt2", 40)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).train()


def samples() -> list[dict]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 40, (STEPS * ROWS, 6), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def by_hand(out):
    """The Trainer's step: forward with labels, backward, clip to max_grad_norm (the clip's
    norm handed over, as the callback hands over the Trainer's), step."""
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    data = samples()
    with probe.watch(model, PROBES, out=out, every=EVERY, optimizer=opt) as w:
        for step in range(STEPS):
            batch = {k: torch.stack([s[k] for s in data[step * ROWS : (step + 1) * ROWS]])
                     for k in ("input_ids", "labels")}  # fmt: skip
            model.zero_grad()
            loss = model(**batch).loss
            loss.backward()
            w.loss(loss)
            w.clipped(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
            opt.step()
    return state_of(model, opt)


class Logs(TrainerCallback):
    """What a report_to integration's callback gets."""

    def __init__(self):
        self.seen = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.seen.append((state.global_step, dict(logs)))


def trainer_for(out, model, opt, **callback):
    args = TrainingArguments(
        output_dir=str(out / "trainer"), use_cpu=True, report_to=[], max_steps=STEPS,
        per_device_train_batch_size=ROWS, train_sampling_strategy="sequential",
        lr_scheduler_type="constant", max_grad_norm=1.0, logging_steps=1, save_strategy="no",
        disable_tqdm=True, seed=0,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=samples(), optimizers=(opt, None))
    # the model's own mean loss, as the loop's (not the Trainer's sum over its token count)
    trainer.model_accepts_loss_kwargs = False
    return trainer


def by_trainer(out, logs: Logs):
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    trainer = trainer_for(out, model, opt)
    trainer.add_callback(logs)
    ProbeCallback(PROBES, out=out / "watch", every=EVERY, log_stats=["abs_mean"]).attach(trainer)
    trainer.train()
    return state_of(model, opt)


def test_hf_trainer_callback_writes_the_hand_loops_file(tmp_path):
    logs = Logs()
    with one_thread():
        hand = by_hand(tmp_path / "hand")
        hf = by_trainer(tmp_path, logs)
    assert_bitwise_equal(hf, hand)  # the same training, so the same file means something
    a = pd.read_csv(tmp_path / "watch" / "train.csv")
    b = pd.read_csv(tmp_path / "hand" / "train.csv")
    pd.testing.assert_frame_equal(a, b)
    # 2 blocks x (output, grad_output); c_fc's output and its weight's and bias's grad and update
    assert sorted(set(a.step)) == [0, 2] and len(a) == 2 * (2 * 2 + 1 + 2 * 2)
    with (
        h5py.File(tmp_path / "watch" / "probe.h5") as f,
        h5py.File(tmp_path / "hand" / "probe.h5") as g,
    ):
        assert f.attrs["complete"]
        np.testing.assert_array_equal(f["train/step"][:], g["train/step"][:])
        np.testing.assert_array_equal(f["train/scalars"][:], g["train/scalars"][:])
        for layer in ("transformer.h.0", "transformer.h.1"):
            for site in ("output", "grad_output"):
                name = f"train/sites/{layer}/{site}"
                np.testing.assert_array_equal(f[name][:], g[name][:])
    scalars = probe.open_run(tmp_path / "watch").train_scalars()
    assert scalars["lr.0"].tolist() == [LR, LR] and not scalars["loss"].isna().any()
    # the statistics went with the Trainer's log of each recorded step (global step = the
    # optimizer steps done: the watch's step + 1, where the Trainer logs that step's loss)
    sent = [(s, v) for s, v in logs.seen if "probe/transformer.h.1/output/abs_mean" in v]
    assert all("loss" in v and "grad_norm" in v for _, v in sent)
    assert [s for s, _ in sent] == [1, 3]
    want = a[(a.layer == "transformer.h.1") & (a.site == "output")]["abs_mean"].tolist()
    assert [v["probe/transformer.h.1/output/abs_mean"] for _, v in sent] == want


def test_hf_log_stats_need_the_trainer(tmp_path):
    model = gpt2()
    trainer = trainer_for(tmp_path, model, torch.optim.AdamW(model.parameters(), lr=LR))
    trainer.add_callback(ProbeCallback(PROBES, out=tmp_path / "w", log_stats=["abs_mean"]))
    with pytest.raises(ConfigError, match=r"cb\.attach\(trainer\)"):
        trainer.train()
    with pytest.raises(ConfigError, match="log_stats names 'abs'; choose from"):
        ProbeCallback(PROBES, out=tmp_path / "w", log_stats=["abs"])
    with pytest.raises(ConfigError, match="ProbeCallback got optimizer"):
        ProbeCallback(PROBES, out=tmp_path / "w", optimizer=None)


def llama():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_config("llama", 40)).train()


class Grads(TrainerCallback):
    """An unwatched training's gradients as the optimizer steps on them (the Trainer's
    on_pre_optimizer_step comes after its clip)."""

    def __init__(self, model):
        self.model, self.seen = model, []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        p = self.model.model.layers[0].mlp.up_proj.weight
        grads = [q.grad.double() for q in self.model.parameters() if q.grad is not None]
        total = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
        self.seen.append((float(p.grad.double().norm()), total))


def llama_trainer(out, model, logging_steps=1):
    args = TrainingArguments(
        output_dir=str(out / "trainer"), use_cpu=True, report_to=[], max_steps=STEPS,
        per_device_train_batch_size=2, gradient_accumulation_steps=2,
        train_sampling_strategy="sequential", learning_rate=1e-3, warmup_steps=2,
        max_grad_norm=0.5, logging_steps=logging_steps, save_strategy="no", seed=0,
    )  # fmt: skip
    return Trainer(model=model, args=args, train_dataset=samples())


def test_hf_trainer_keeps_its_logs_and_its_loss_and_clipped_gradient(tmp_path, capsys):
    """Gradient accumulation 2 (the Trainer passes num_items_in_batch, so each micro-batch's
    loss is a partial sum), clipping active: train.csv's loss and grad_norm_preclip are the
    Trainer's logged loss and grad_norm, grad_norm and param_grad the clipped gradient; the
    Trainer's own logs stay, with the statistics, and the console does not print them."""
    with one_thread():
        plain = llama()
        grads = Grads(plain)
        trainer = llama_trainer(tmp_path / "plain", plain)
        trainer.add_callback(grads)
        trainer.train()
        model = llama()
        watched = llama_trainer(tmp_path, model)
        probes = {"up": {"layers": ["model.layers.0.mlp.up_proj"], "capture": ["param_grad"]}}
        ProbeCallback(probes, out=tmp_path / "w", log_stats=["norm"]).attach(watched)
        watched.train()
    assert_bitwise_equal(state_of(model, watched.optimizer), state_of(plain, trainer.optimizer))
    printed = capsys.readouterr()
    assert "probe/" not in printed.out + printed.err
    history = [h for h in watched.state.log_history if "loss" in h and "train_loss" not in h]
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    assert all({"loss", "grad_norm", "learning_rate"} <= set(h) for h in history)
    key = "probe/model.layers.0.mlp.up_proj/param_grad.weight/norm"
    run = probe.open_run(tmp_path / "w")
    scalars = run.train_scalars()
    table = pd.read_csv(tmp_path / "w" / "train.csv")
    rows = table[table.site == "param_grad.weight"]
    np.testing.assert_allclose(rows.norm, [g for g, _ in grads.seen], rtol=1e-12)
    assert [h[key] for h in history] == rows.norm.tolist()
    # (float32 norms per gradient, their squares summed in float64: probe.train.grad_norms)
    np.testing.assert_allclose(scalars.grad_norm, [t for _, t in grads.seen], rtol=1e-7)
    np.testing.assert_allclose(scalars.grad_norm, 0.5, rtol=1e-6)  # clipped
    # the Trainer logs the pre-clip norm as grad_norm: the value its clip returned, handed over
    np.testing.assert_array_equal(scalars.grad_norm_preclip, [h["grad_norm"] for h in history])
    assert (scalars.grad_norm_preclip > 0.5).all()
    np.testing.assert_allclose(scalars.loss, [h["loss"] for h in plain_losses(trainer)], rtol=1e-6)
    np.testing.assert_allclose(scalars.loss, [h["loss"] for h in history], rtol=1e-6)


def plain_losses(trainer):
    return [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]


NORM_KEY = "probe/model.layers.0.mlp.up_proj/param_grad.weight/norm"


def logged_and_recorded(out, logging_steps: int) -> tuple[list[dict], list[float]]:
    """A tiny Llama trained under the Trainer with log_stats=["norm"] of one param_grad: (the
    Trainer's logs holding the statistic, train.csv's values of it)."""
    with one_thread():
        trainer = llama_trainer(out, llama(), logging_steps=logging_steps)
        probes = {"up": {"layers": ["model.layers.0.mlp.up_proj"], "capture": ["param_grad"]}}
        ProbeCallback(probes, out=out / "w", log_stats=["norm"]).attach(trainer)
        trainer.train()
    table = pd.read_csv(out / "w" / "train.csv")
    norms = table[table.site == "param_grad.weight"].norm.tolist()
    return [h for h in trainer.state.log_history if NORM_KEY in h], norms


def test_hf_statistics_wait_for_the_trainers_next_log(tmp_path):
    """logging_steps=2: each recorded step's statistics go with the Trainer's next log, the
    latest recorded step's (its values), beside the Trainer's loss."""
    logged, norms = logged_and_recorded(tmp_path, logging_steps=2)
    assert [h["step"] for h in logged] == [2, 4] and all("loss" in h for h in logged)
    assert [h[NORM_KEY] for h in logged] == [norms[1], norms[3]]


def test_hf_statistics_of_a_step_still_on_its_way_go_with_its_own_log(tmp_path, monkeypatch):
    """On a GPU a recorded step's statistics reach the host a step later; the Trainer's log of
    that step waits for them (here every copy counts as not done until something waits), so
    each log holds its own step's values, as train.csv does."""
    from probe.stats import backend, torch_backend
    from probe.train import step_stats

    monkeypatch.setattr(backend, "_cpu", "torch")  # (the path a GPU's values take)
    monkeypatch.setattr(torch_backend, "_reduction", "fused")
    monkeypatch.setattr(step_stats.Settled, "ready", lambda self: False)
    logged, norms = logged_and_recorded(tmp_path, logging_steps=1)
    assert [h["step"] for h in logged] == [1, 2, 3, 4]
    assert [h[NORM_KEY] for h in logged] == norms
