"""What a watched step moves to the host, counted through the one function that moves it
(probe.hooks.device.copy_to_host), on the path a GPU's values take (here on the CPU: the torch
backend's): one copy per recorded step whatever the sites and micro-batches, none at the others;
a few numbers per site (the quantile sketch stays where it was summed); and no read of a value
in the step's path (`aten._local_scalar_dense`: .item(), float(), a .cpu() of a scalar)."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import probe
from probe.testing.trainings import cnn, image_batches, image_loss
from probe.train import step_stats

PROBES = {"all": {"layers": ["conv1", "relu", "layer1", "fc"],
                  "capture": ["output", "grad_output", "param", "param_grad", "param_update"]}}  # fmt: skip


@pytest.fixture
def device_path(monkeypatch):
    """The torch backend's path, with the reduction a GPU takes (the fused one)."""
    from probe.stats import backend, torch_backend

    monkeypatch.setattr(backend, "_cpu", "torch")
    monkeypatch.setattr(torch_backend, "_reduction", "fused")


@pytest.fixture
def copies(monkeypatch):
    """Each call of the step path's one transfer: the size of what it moved."""
    made: list[int] = []
    real = step_stats.copy_to_host

    def counted(t):
        made.append(t.numel() * t.element_size())
        return real(t)

    monkeypatch.setattr(step_stats, "copy_to_host", counted)
    return made


class Reads(TorchDispatchMode):
    """Counts the operations that read a tensor's value into Python."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def test_one_copy_per_recorded_step_and_none_at_the_others(tmp_path, device_path, copies):
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = image_batches(8, size=4)
    made = []
    with probe.watch(model, PROBES, out=tmp_path / "run", optimizer=opt, every=2):
        for step in range(4):
            opt.zero_grad()
            for batch in data[2 * step : 2 * step + 2]:
                (image_loss(model, batch) / 2).backward()
            opt.step()
            made.append(len(copies))
    assert made == [1, 1, 2, 2]  # steps 0 and 2 recorded: one copy each
    with probe.open_run(tmp_path / "run") as run:
        table = run.train()
    sites = table[table.step == 0]
    assert len(sites) == 4 * 2 + 6 * 3  # (4 layers' output and grad_output; 6 parameters x 3)
    per_site = copies[0] / len(sites)
    # what a site's statistics are without its 65536-bucket sketch (8 bytes each): a head of
    # scalars, its units' rows, three quantiles; here under 4 KiB a site, where the sketch
    # alone was 512 KiB
    assert per_site < 4096, per_site


def test_the_step_path_reads_no_value_into_python(tmp_path, device_path):
    """The hooks and the step's end on the device path make no `.item()` (on a GPU each is a
    wait for the device): every number a recorded step needs comes back with its one copy."""
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = image_batches(4, size=4)
    probes = {"all": {"layers": ["conv1", "relu", "fc"],
                      "capture": ["output", "grad_output", "param", "param_grad"]}}  # fmt: skip
    with probe.watch(model, probes, out=tmp_path / "run", optimizer=opt) as w:
        for step in range(2):
            with Reads() as reads:  # forward, backward and step: the watch's hooks in each
                opt.zero_grad()
                loss = image_loss(model, data[step])
                loss.backward()
                w.loss(loss)
                opt.step()
            # plain SGD reads nothing; what the watch needs comes back with the step's copy
            assert reads.reads == 0, (step, reads.reads)


def _train_with_nan_at_step_1(out, clip_value=None):
    """4 steps of the small CNN, the second step's batch holding a NaN; train.csv and the log."""
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = image_batches(4, size=4)
    data[1][0][0, 0, 0, 0] = float("nan")
    with probe.watch(model, PROBES, out=out, optimizer=opt) as w:
        for batch in data:
            opt.zero_grad()
            loss = image_loss(model, batch)
            loss.backward()
            w.loss(loss)
            opt.step()
    with probe.open_run(out) as run:
        return run.train(), run.train_scalars(), (out / "probe.log").read_text()


def test_a_copy_read_a_step_later_writes_the_same_file(tmp_path, device_path, monkeypatch):
    """On a GPU a step's copy is read at a later step's end (or at the close): the records keep
    their order and values, and a NaN is said with the step that held it, not the one that read
    it. Here every copy counts as not done until the watch closes."""
    table, scalars, log = _train_with_nan_at_step_1(tmp_path / "at_once")
    monkeypatch.setattr(step_stats.Settled, "ready", lambda self: False)
    later, later_scalars, later_log = _train_with_nan_at_step_1(tmp_path / "later")
    pd.testing.assert_frame_equal(later, table)
    pd.testing.assert_frame_equal(later_scalars, scalars)
    assert sorted(table.step.unique()) == [0, 1, 2, 3]
    said, said_at_once = (
        [line.split("] ")[-1] for line in text.splitlines() if "NaN" in line]
        for text in (later_log, log)
    )
    assert "step 1:" in said[0] and "of the training" in said[0], said  # (the input's NaN)
    assert said == said_at_once


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_watched_step_on_a_gpu_makes_no_synchronising_call(tmp_path):
    """On a GPU a recorded step's hooks, norms, loss and end make no synchronising call (CUDA's
    sync debug mode raises on each), and every recorded step's rows still reach the file."""
    model = cnn().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, foreach=True)
    data = [(x.cuda(), y.cuda()) for x, y in image_batches(4, size=4)]
    with probe.watch(model, PROBES, out=tmp_path / "gpu", optimizer=opt) as w:
        for step, batch in enumerate(data):
            if step:  # (the first step makes the index tensors it keeps)
                torch.cuda.set_sync_debug_mode("error")
            try:
                opt.zero_grad()
                loss = image_loss(model, batch)
                loss.backward()
                w.loss(loss)
                opt.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    with probe.open_run(tmp_path / "gpu") as run:
        table = run.train()
    assert sorted(table.step.unique()) == [0, 1, 2, 3]
    assert len(table[table.step == 3]) == 4 * 2 + 6 * 3


def test_a_checkpoint_waits_for_the_steps_still_on_their_way(tmp_path, device_path, monkeypatch):
    """`w.state_dict()` (a checkpoint) writes the steps whose copy is still under way before it
    flushes: the file holds every step the checkpoint has seen, so a resume from it loses none."""
    monkeypatch.setattr(step_stats.Settled, "ready", lambda self: False)
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with probe.watch(model, PROBES, out=tmp_path, optimizer=opt, flush_every=100) as w:
        for batch in image_batches(3, size=4):
            opt.zero_grad()
            image_loss(model, batch).backward()
            opt.step()
        state = w.state_dict()
        written = pd.read_csv(tmp_path / "train.csv")
    assert state["step"] == 3
    assert sorted(written.step.unique()) == [0, 1, 2]


def test_parameter_sites_reduced_in_chunks_give_the_same_statistics(tmp_path, device_path,
                                                                   monkeypatch):  # fmt: skip
    """A step's parameter sites are reduced together in chunks of at most batched.CHUNK values
    (a tensor above it alone, by the fused reduction): a small CHUNK, which splits the small
    CNN's parameters into several chunks and sends its larger ones alone, gives the statistics
    of one chunk for all."""
    from probe.stats import batched

    def trained(out):
        model = cnn()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        with probe.watch(model, PROBES, out=out, optimizer=opt):
            for batch in image_batches(2, size=4):
                opt.zero_grad()
                image_loss(model, batch).backward()
                opt.step()
        with probe.open_run(out) as run:
            return run.train()

    whole = trained(tmp_path / "whole")
    monkeypatch.setattr(batched, "CHUNK", 100)
    chunked = trained(tmp_path / "chunked")
    assert any(p.numel() > 100 for p in cnn().parameters())  # (some go alone)
    pd.testing.assert_frame_equal(chunked, whole, check_exact=False, rtol=1e-9)
