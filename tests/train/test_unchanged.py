"""Watching changes nothing: a training watched at every step, at every site, ends with the
weights, buffers and optimizer state of the same training unwatched, bit for bit, with the same
losses; with a probe batch evaluated on the way too (flags, buffers and random states put back).
"""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from probe.testing.trainings import (
    EVERY_SITE,
    assert_bitwise_equal,
    cnn,
    gpt2,
    image_batches,
    image_loss,
    one_thread,
    state_of,
    token_batches,
    token_loss,
    train,
)

STEPS = 20
CASES = {
    "cnn-sgd": (cnn, lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                image_batches, image_loss),
    "gpt2-adamw": (gpt2, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
                   token_batches, token_loss),
}  # fmt: skip


@pytest.mark.parametrize("probe_batch", [False, True], ids=["plain", "probe_batch"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_watched_training_ends_bitwise_equal_to_the_unwatched_one(tmp_path, case, probe_batch):
    """20 steps; every module, every site, every step; the file holds 20 steps of them."""
    make, optimizer, batches, loss_fn = CASES[case]
    data = batches(STEPS)
    with one_thread():
        model = make()
        opt = optimizer(model)
        plain_losses = train(model, opt, data, loss_fn)
        plain = state_of(model, opt)

        model = make()
        opt = optimizer(model)
        watch = {
            "probes": {"all": {"layers": ["*"], "capture": EVERY_SITE}},
            "out": tmp_path / "run",
            "every": 1,
        }
        if probe_batch:
            extra = batches(1, seed=7)[0]
            watch.update(probe_batch=extra, probe_every=7)
            # (a run stores rows of samples: the position ids wpe takes have no batch axis)
            watch["probes"]["all"]["exclude"] = ["transformer.wpe"]
        watched_losses = train(model, opt, data, loss_fn, watch)
        assert watched_losses == plain_losses
        assert_bitwise_equal(state_of(model, opt), plain)

    table = pd.read_csv(tmp_path / "run" / "train.csv")
    assert sorted(table["step"].unique()) == list(range(STEPS))
    sites = {s.split(".")[0].split("@")[0] for s in table["site"]}
    assert sites == set(EVERY_SITE)
    if probe_batch:
        runs = sorted(int(p.name) for p in (tmp_path / "run" / "probe_batch").iterdir())
        assert runs == [0, 7, 14]
