"""Steps and forwards counted whichever module the loop calls: a LightningModule with no
`forward` whose training_step calls self.encoder and self.decoder, and a loop calling a causal
LM's `model.model` and `model.lm_head`, each write the file the same training writes when it
calls the model itself (train.csv equal, rows and noise-edit samples counted once per
micro-batch, call counts per forward)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn

import probe
from probe.testing.trainings import assert_bitwise_equal, one_thread, state_of

L = pytest.importorskip("lightning")
from probe.integrations.lightning import ProbeCallback  # noqa: E402

EDITS = {"noise": {"layers": ["encoder.0"], "site": "grad_output", "op": "noise", "std": 0.1}}
AE_PROBES = {"all": {"layers": ["encoder.*", "decoder.*"], "types": ["Linear"],
                     "capture": ["output", "grad_output", "param_grad"]}}  # fmt: skip
STEPS = 4


class AutoEncoder(L.LightningModule):
    """Lightning's autoencoder example's style: no forward, training_step calls the parts."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(nn.Linear(12, 6), nn.ReLU(), nn.Linear(6, 3))
        self.decoder = nn.Sequential(nn.Linear(3, 6), nn.ReLU(), nn.Linear(6, 12))

    def reconstruct(self, x):
        return self.decoder(self.encoder(x))

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self.reconstruct(batch), batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class WithForward(AutoEncoder):
    """The same training, through the module's own forward."""

    def forward(self, x):
        return self.reconstruct(x)

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self(batch), batch)


def fit(cls, out, accumulate):
    model = cls()
    cb = ProbeCallback(AE_PROBES, out=out, edits=EDITS)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=STEPS, accumulate_grad_batches=accumulate,
        gradient_clip_val=0.05, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[cb],
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(5, 12, generator=g) for _ in range(STEPS * accumulate)]
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=None))
    return state_of(model, trainer.optimizers[0]), cb.watch.watcher.rows_seen


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_lightning_module_without_forward_is_watched_as_one_with(tmp_path, accumulate):
    with one_thread():
        parts, rows_parts = fit(AutoEncoder, tmp_path / "parts", accumulate)
        whole, rows_whole = fit(WithForward, tmp_path / "whole", accumulate)
    assert_bitwise_equal(parts, whole)
    a, b = (pd.read_csv(tmp_path / d / "train.csv") for d in ("parts", "whole"))
    pd.testing.assert_frame_equal(a, b)
    assert rows_parts == rows_whole == 5 * STEPS * accumulate  # each micro-batch's rows once
    assert sorted(set(a.step)) == list(range(STEPS))
    assert set(a.loc[a.site == "output", "rows"]) == {5 * accumulate}
    # the clip acted, and both read the gradient after it (the same file says so)
    scalars = probe.open_run(tmp_path / "parts").train_scalars()
    assert (scalars["grad_norm_preclip"] > scalars["grad_norm"]).all()
    np.testing.assert_allclose(scalars["grad_norm"], 0.05, rtol=1e-5)


LM_PROBES = {
    "mlps": {"layers": ["model.layers.*.mlp"], "capture": ["output", "grad_output"]},
    "head": {"layers": ["lm_head"], "capture": ["output", "param_grad"]},
}


def lm_loss(logits, ids):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def lm_training(out, parts: bool, accumulate: int = 2):
    from transformers import LlamaForCausalLM

    from probe.testing.tiny_lms import tiny_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config("llama", 40)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(3, 40, (3, 7), generator=g) for _ in range(STEPS * accumulate)]
    with probe.watch(model, LM_PROBES, out=out, optimizer=opt, edits=None) as w:
        for step in range(STEPS):
            opt.zero_grad()
            for ids in batches[step * accumulate : (step + 1) * accumulate]:
                if parts:  # the loop calls the body and the head itself
                    logits = model.lm_head(model.model(input_ids=ids).last_hidden_state)
                else:
                    logits = model(input_ids=ids).logits
                loss = lm_loss(logits, ids)
                (loss / accumulate).backward()
                w.loss(loss)
            opt.step()
    return state_of(model, opt), w.watcher.rows_seen


def test_a_loop_calling_model_model_and_lm_head_is_watched_as_model(tmp_path):
    with one_thread():
        parts, _ = lm_training(tmp_path / "parts", parts=True)
        whole, _ = lm_training(tmp_path / "whole", parts=False)
    assert_bitwise_equal(parts, whole)
    a, b = (pd.read_csv(tmp_path / d / "train.csv") for d in ("parts", "whole"))
    pd.testing.assert_frame_equal(a, b)
    # every site once per step (no `output@1`: the head's call belongs to the body's forward),
    # the step's two micro-batches merged
    assert not a.site.str.contains("@").any()
    assert set(a.loc[a.layer == "lm_head"].site) == {"output", "param_grad.weight"}
    assert set(a.loc[a.site == "output", "rows"]) == {6}
    assert len(a) == STEPS * len(b) // STEPS


def test_a_loop_training_modules_the_probes_do_not_select_is_named(tmp_path):
    """Gradients without a watched module's forward: the probes select modules the loop does
    not call (no torch.compile in sight, so the message does not blame it)."""
    from probe.errors import ConfigError

    model = nn.ModuleDict({"a": nn.Linear(3, 3), "b": nn.Linear(3, 1)})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probes = {"a": {"layers": ["a"], "capture": ["output"]}}
    from torch._dynamo.utils import counters

    counters.clear()  # (other tests of this process may have compiled)
    with (
        pytest.raises(ConfigError, match="none of the watched modules") as e,
        probe.watch(model, probes, out=tmp_path / "w", optimizer=opt),
    ):
        model["b"](torch.randn(2, 3)).sum().backward()
        opt.step()
    assert "compile" not in str(e.value)


def test_a_tuple_output_is_named_as_a_run_names_it_and_the_log_says_so(tmp_path):
    """An attention module returns (output, weights): asked for `output`, the watch records
    `output.0` as a run does (format.md's names) and probe.log names what `output` became."""
    from transformers import LlamaForCausalLM

    from probe.testing.tiny_lms import tiny_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config("llama", 40)).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probes = {"attn": {"layers": ["model.layers.0.self_attn"], "capture": ["output"]}}
    ids = torch.randint(3, 40, (2, 5), generator=torch.Generator().manual_seed(1))
    with probe.watch(model, probes, out=tmp_path / "w", optimizer=opt):
        for _ in range(2):
            opt.zero_grad()
            out = model(input_ids=ids)
            lm_loss(out.logits, ids).backward()
            opt.step()
    with probe.capture(model, probes) as cap:  # what a run of the same module records
        model(input_ids=ids)
    got = pd.read_csv(tmp_path / "w" / "train.csv")
    names = sorted(set(got.site))
    assert names[0] == "output.0"
    assert names == sorted(site for _, site in cap)
    log = (tmp_path / "w" / "probe.log").read_text()
    assert f"model.layers.0.self_attn: output -> {', '.join(names)}" in log
    assert log.count("output -> ") == 1  # said once, at the first step that recorded them
    settings = (tmp_path / "w" / "watch.yaml").read_text()  # watch.yaml names them so too
    assert yaml.safe_load(settings)["modules"] == {"model.layers.0.self_attn": names}
    with probe.open_run(tmp_path / "w") as run:  # as the file's own copy of the settings
        assert run.attrs["config"] == settings
