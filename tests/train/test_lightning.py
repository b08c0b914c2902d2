"""Lightning's Trainer with probe's ProbeCallback writes the file that probe.watch writes on the
same training run by hand (same model, seed and batches): the same /train rows and scalars and
the same train.csv, bit for bit; the chosen statistics reach the trainer's logger (a
CSVLogger's metrics.csv) at the recorded steps."""

from __future__ import annotations

import h5py
import numpy as np
import pandas as pd
import pytest
import torch

import probe
from probe.testing.trainings import (
    EVERY_SITE,
    assert_bitwise_equal,
    cnn,
    image_batches,
    image_loss,
    one_thread,
    state_of,
)

L = pytest.importorskip("lightning")
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

from probe.integrations.lightning import ProbeCallback  # noqa: E402

PROBES = {
    "convs": {"layers": ["net.*"], "types": ["Conv2d", "Linear"], "capture": EVERY_SITE},
    "blocks": {"layers": ["net.layer1", "net.layer2"], "capture": ["output", "grad_output"]},
}
STEPS, EVERY = 5, 2


class LitCNN(L.LightningModule):
    """probe.testing.trainings' small CNN (in `self.net`) as a LightningModule."""

    def __init__(self):
        super().__init__()
        self.net = cnn()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return image_loss(self, batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def by_hand(out, accumulate):
    """The loop Lightning runs: `accumulate` micro-batches a step, each loss divided by it."""
    model = LitCNN()
    opt = model.configure_optimizers()
    batches = image_batches(STEPS * accumulate)
    with probe.watch(model, PROBES, out=out, every=EVERY, optimizer=opt) as w:
        for step in range(STEPS):
            opt.zero_grad()
            for i in range(step * accumulate, (step + 1) * accumulate):
                loss = model.training_step(batches[i], i)
                (loss / accumulate).backward()
                w.loss(loss)
            opt.step()
    return state_of(model, opt)


def by_lightning(out, logs, accumulate):
    model = LitCNN()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=STEPS, accumulate_grad_batches=accumulate,
        logger=CSVLogger(logs, name="csv"), enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ProbeCallback(PROBES, out=out, every=EVERY, log_stats=["abs_mean", "norm"])],
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(image_batches(STEPS * accumulate), batch_size=None)
    trainer.fit(model, loader)
    return state_of(model, trainer.optimizers[0])


@pytest.mark.parametrize("accumulate", [1, 2])
def test_lightning_callback_writes_the_hand_loops_file(tmp_path, accumulate):
    with one_thread():
        torch.manual_seed(0)
        hand = by_hand(tmp_path / "hand", accumulate)
        torch.manual_seed(0)
        lit = by_lightning(tmp_path / "lit", tmp_path / "logs", accumulate)
    assert_bitwise_equal(lit, hand)  # the same training, so the same file means something
    a, b = pd.read_csv(tmp_path / "lit" / "train.csv"), pd.read_csv(tmp_path / "hand" / "train.csv")
    pd.testing.assert_frame_equal(a, b)
    # 4 modules' values and gradients (conv1's input needs no gradient), 3 convs' weight and
    # fc's weight and bias in 3 param sites, 2 blocks' output and grad_output
    sites = 4 * 4 - 1 + 5 * 3 + 2 * 2
    assert sorted(set(a.step)) == [0, 2, 4] and len(a) == 3 * sites
    assert set(a.loc[a.site == "output", "rows"]) == {8 * accumulate}  # the step's micro-batches
    with (
        h5py.File(tmp_path / "lit" / "probe.h5") as f,
        h5py.File(tmp_path / "hand" / "probe.h5") as g,
    ):
        assert f.attrs["complete"]
        for name in ("train/step", "train/scalars"):
            np.testing.assert_array_equal(f[name][:], g[name][:])
        held = []
        g["train/sites"].visititems(
            lambda n, d: held.append(n) if isinstance(d, h5py.Dataset) else None
        )
        assert len(held) == sites
        for name in held:
            np.testing.assert_array_equal(
                f["train/sites"][name][:], g["train/sites"][name][:], name
            )
    scalars = probe.open_run(tmp_path / "lit").train_scalars()
    assert list(scalars.columns[:5]) == [
        "step",
        "loss",
        "grad_norm",
        "grad_norm_preclip",
        "grad_scale",
    ]
    assert scalars["lr.0"].tolist() == [0.05] * 3 and not scalars["loss"].isna().any()
    # the logger's metrics: abs_mean and norm of each recorded site at the watch's steps
    logged = pd.read_csv(next((tmp_path / "logs").rglob("metrics.csv")))
    column = "probe/net.layer1/output/abs_mean"
    got = logged.dropna(subset=[column]).set_index("step")[column]
    want = a[(a.layer == "net.layer1") & (a.site == "output")].set_index("step")["abs_mean"]
    pd.testing.assert_series_equal(got, want, check_names=False)
    assert "probe/net.fc/param_grad.weight/norm" in logged.columns


def test_a_resumed_lightning_training_keeps_the_watchs_state(tmp_path):
    """Lightning restores the callback's state from its checkpoint before the training starts:
    the resumed watch appends from the checkpoint's step and counts the samples the edits have
    seen (rows_seen) as the uninterrupted training does."""

    edits = {
        "scale": {"layers": ["net.layer1"], "site": "grad_output", "op": "scale", "factor": 0.5}
    }

    def fit(out, ckpt=None, save=None):
        cb = ProbeCallback(PROBES, out=out, every=EVERY, edits=edits)
        saving = (
            [] if save is None else [ModelCheckpoint(save, every_n_train_steps=3, save_top_k=-1)]
        )
        trainer = L.Trainer(
            accelerator="cpu", devices=1, max_steps=STEPS, logger=False,
            enable_checkpointing=save is not None, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[cb, *saving],
        )  # fmt: skip
        loader = torch.utils.data.DataLoader(image_batches(STEPS), batch_size=None)
        trainer.fit(LitCNN(), loader, ckpt_path=ckpt)
        return cb

    with one_thread():
        torch.manual_seed(0)
        whole = fit(tmp_path / "whole", save=tmp_path / "ckpt")  # (a checkpoint after step 3)
        (checkpoint,) = (tmp_path / "ckpt").glob("*step=3.ckpt")
        resumed = fit(tmp_path / "whole", ckpt=checkpoint)
    assert whole.watch.watcher.rows_seen == 8 * STEPS
    assert resumed.watch.watcher.rows_seen == whole.watch.watcher.rows_seen
    cut = pd.read_csv(tmp_path / "whole" / "train.csv")
    assert (
        sorted(set(cut.step)) == [0, 2, 4] and not cut.duplicated(["step", "layer", "site"]).any()
    )


def test_lightning_gradients_are_the_clipped_ones(tmp_path):
    """With gradient_clip_val clipping every step: param_grad and grad_norm are the gradients
    the optimizer stepped on (after the clip), grad_norm_preclip the total norm before it, as
    an unwatched loop clipping with torch.nn.utils.clip_grad_norm_ reads them."""
    clip, steps = 0.02, 3
    probes = {"conv1": {"layers": ["net.conv1"], "capture": ["param_grad"]}}
    batches = image_batches(steps)
    with one_thread():
        torch.manual_seed(0)
        model = LitCNN()
        opt = model.configure_optimizers()
        seen = []
        for batch in batches:
            opt.zero_grad()
            model.training_step(batch, 0).backward()
            params = list(model.parameters())
            pre = float(torch.nn.utils.get_total_norm([p.grad.double() for p in params]))
            torch.nn.utils.clip_grad_norm_(params, clip)
            post = float(torch.nn.utils.get_total_norm([p.grad.double() for p in params]))
            seen.append((pre, post, float(model.net.conv1.weight.grad.double().norm())))
            opt.step()
        hand = state_of(model, opt)
        torch.manual_seed(0)
        lit = LitCNN()
        trainer = L.Trainer(
            accelerator="cpu", devices=1, max_steps=steps, gradient_clip_val=clip, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[ProbeCallback(probes, out=tmp_path / "w")],
        )  # fmt: skip
        trainer.fit(lit, torch.utils.data.DataLoader(batches, batch_size=None))
    assert_bitwise_equal(state_of(lit, trainer.optimizers[0]), hand)
    scalars = probe.open_run(tmp_path / "w").train_scalars()
    table = pd.read_csv(tmp_path / "w" / "train.csv")
    grads = table[table.site == "param_grad.weight"].norm.tolist()
    pre, post, conv1 = zip(*seen, strict=True)
    assert min(pre) > 10 * clip  # (every step clipped)
    # (float32 norms per gradient, their squares summed in float64: probe.train.grad_norms)
    np.testing.assert_allclose(scalars.grad_norm_preclip, pre, rtol=1e-7)
    np.testing.assert_allclose(scalars.grad_norm, post, rtol=1e-7)
    np.testing.assert_allclose(grads, conv1, rtol=1e-12)


class ManualCNN(LitCNN):
    """Manual optimization: the module clips before its optimizer's step and zeroes the
    gradients after it."""

    def __init__(self, clip):
        super().__init__()
        self.automatic_optimization, self.clip = False, clip

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = image_loss(self, batch)
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")
        opt.step()
        opt.zero_grad()  # (after the step: the gradients are gone at on_train_batch_end)
        return loss


def test_lightning_manual_optimization_records_the_gradients_the_module_clipped(tmp_path):
    clip, steps = 0.02, 2
    batches = image_batches(steps)
    with one_thread():
        torch.manual_seed(0)
        model = LitCNN()
        opt = model.configure_optimizers()
        post = []
        for batch in batches:
            opt.zero_grad()
            model.training_step(batch, 0).backward()
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), clip)
            post.append(float(model.net.conv1.weight.grad.double().norm()))
            opt.step()
        torch.manual_seed(0)
        lit = ManualCNN(clip)
        trainer = L.Trainer(
            accelerator="cpu", devices=1, max_steps=steps, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[ProbeCallback({"c": {"layers": ["net.conv1"], "capture": ["param_grad"]}},
                                     out=tmp_path / "w")],
        )  # fmt: skip
        trainer.fit(lit, torch.utils.data.DataLoader(batches, batch_size=None))
    assert_bitwise_equal(state_of(lit, trainer.optimizers[0]), state_of(model, opt))
    table = pd.read_csv(tmp_path / "w" / "train.csv")
    np.testing.assert_allclose(table.norm, post, rtol=1e-12)
