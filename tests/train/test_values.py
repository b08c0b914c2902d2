"""Values a watched training records equal the same values taken by hand in the same training:
forward values by plain forward hooks, gradients by Tensor.register_hook, parameter gradients
and updates read around optimizer.step(), the global grad norm by torch's get_total_norm; each
reduced with numpy here. Gradient accumulation merges a step's micro-batches exactly."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

import probe
from probe.stats.running import QUANTILE_REL_ERROR
from probe.testing.trainings import cnn, image_batches, image_loss, one_thread, train

LAYERS = ["conv1", "relu", "layer1.bn", "layer1", "fc"]
SITES = ["output", "input", "grad_output", "param", "param_grad", "param_update"]


def numpy_row(a: np.ndarray) -> dict:
    """train.csv's columns of one value (axis 0: rows) in float64 numpy."""
    a = np.asarray(a, dtype=np.float64)
    flat = a.reshape(len(a), -1)
    return {
        "rows": len(a),
        "n": a.size,
        "mean": a.mean(),
        "std": a.std(),
        "min": a.min(),
        "max": a.max(),
        "abs_mean": np.abs(a).mean(),
        "rms": np.sqrt((a * a).mean()),
        "frac_zero": (a == 0).mean(),
        "l2_mean": np.sqrt((flat * flat).sum(axis=1)).mean(),
        "norm": np.sqrt((a * a).sum()),
        "p50": np.quantile(a.ravel(), 0.5, method="lower"),
        "nan_count": 0,
        "inf_count": 0,
    }


def assert_row(got: pd.Series, a: np.ndarray, what: str) -> None:
    want = numpy_row(a)
    for k in ("rows", "n", "nan_count", "inf_count"):
        assert got[k] == want[k], (what, k)
    for k in ("mean", "std", "min", "max", "abs_mean", "rms", "frac_zero", "l2_mean", "norm"):
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-12, err_msg=f"{what} {k}")
    assert abs(got["p50"] - want["p50"]) <= QUANTILE_REL_ERROR * abs(want["p50"]) + 1e-30, what


class ByHand:
    """Plain hooks and reads around optimizer.step(), registered by this test."""

    def __init__(self, model):
        self.model = model
        self.values: dict[tuple[int, str, str], np.ndarray] = {}
        self.step = 0
        self.handles = []
        for name in LAYERS:  # (an in-place ReLU's input is read before it runs)
            m = model.get_submodule(name)
            self.handles.append(m.register_forward_pre_hook(self._input(name)))
            self.handles.append(m.register_forward_hook(self._forward(name)))

    def _input(self, name):
        def hook(module, args):
            self.values[self.step, name, "input"] = args[0].detach().clone().numpy()

        return hook

    def _forward(self, name):
        def hook(module, args, output):
            step = self.step
            self.values[step, name, "output"] = output.detach().clone().numpy()

            def grad(g, name=name, step=step):
                self.values[step, name, "grad_output"] = g.detach().clone().numpy()

            output.register_hook(grad)

        return hook

    def __call__(self, step, model, optimizer, phase):
        if phase == "before":
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            self.values[step, "", "grad_norm"] = float(torch.nn.utils.get_total_norm(grads))
            for name in LAYERS:
                for pname, p in model.get_submodule(name).named_parameters():
                    self.values[step, name, f"param.{pname}"] = p.detach().clone().numpy()
                    self.values[step, name, f"param_grad.{pname}"] = p.grad.clone().numpy()
                    self.values[step, name, f"norm.{pname}"] = float(p.grad.norm())
        else:
            for name in LAYERS:
                for pname, p in model.get_submodule(name).named_parameters():
                    before = self.values[step, name, f"param.{pname}"]
                    self.values[step, name, f"param_update.{pname}"] = p.detach().numpy() - before
            self.step += 1


@pytest.fixture(params=["host", "device"])
def step_path(request, monkeypatch):
    """The step's statistics taken on the host (the CPU backend's) or on the values' device,
    one copy per step (the torch backend's: the GPU's path, here on the CPU)."""
    from probe.stats import backend

    if request.param == "device":
        monkeypatch.setattr(backend, "_cpu", "torch")
    return request.param


def test_recorded_statistics_equal_hand_computations_in_the_same_training(tmp_path, step_path):
    """3 steps of SGD with momentum: every site of five modules (an in-place ReLU, a BatchNorm
    whose output is added to in place, a block) against hand-taken values reduced in numpy,
    the statistics taken on the host and on the values' device alike."""
    steps = 3
    with one_thread():
        model = cnn()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        hand = ByHand(model)
        probes = {"some": {"layers": LAYERS, "capture": SITES}}
        train(model, opt, image_batches(steps), image_loss,
              {"probes": probes, "out": tmp_path / "run"}, hand=hand)  # fmt: skip
    with probe.open_run(tmp_path / "run") as run:
        table = run.train()
        scalars = run.train_scalars()
    rows = {(r.step, r.layer, r.site): r for _, r in table.iterrows()}
    compared = 0
    for (step, layer, site), value in hand.values.items():
        if not layer or site.startswith("norm."):
            continue
        if site.startswith("param"):
            value = value[None]  # a parameter is one row
        assert_row(rows[step, layer, site], value, f"step {step} {layer} {site}")
        compared += 1
    assert compared == steps * 3 * (len(LAYERS) + 8)  # 8 parameters, layer1's 3 among them
    for step in range(steps):
        np.testing.assert_allclose(
            scalars.loc[step, "grad_norm"], hand.values[step, "", "grad_norm"], rtol=1e-6
        )
        for name, pname in (("conv1", "weight"), ("fc", "bias"), ("layer1.bn", "weight")):
            got = rows[step, name, f"param_grad.{pname}"]["norm"]
            np.testing.assert_allclose(got, hand.values[step, name, f"norm.{pname}"], rtol=1e-6)
    assert list(scalars["lr.0"]) == [0.1] * steps
    # the in-place ReLU's input is the BatchNorm's output before it was rectified
    assert rows[0, "relu", "input"]["min"] < 0 == rows[0, "relu", "output"]["min"]
    units = hand.values[0, "relu", "output"].max(axis=(0, 2, 3)) <= 0
    assert rows[0, "relu", "output"]["dead_frac"] == units.mean()


def test_gradient_accumulation_merges_micro_batches_exactly(tmp_path, step_path):
    """Two micro-batches per step, a loop without optimizer=: a step's statistics are those of
    its two micro-batches' values together, its gradient the accumulated one, its loss their
    mean, its update what the step changed (on the host and on the device alike)."""
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = image_batches(4, size=4)
    outs = []

    def keep(module, args, output):
        outs.append(output.detach().clone().numpy())

    model.fc.register_forward_hook(keep)
    probes = {"fc": {"layers": ["fc"], "capture": ["output", "param_grad", "param_update"]}}
    losses, grads, updates = [], [], []
    with probe.watch(model, probes, out=tmp_path / "run") as w:
        for step in range(2):
            opt.zero_grad()
            micro = []
            for batch in data[2 * step : 2 * step + 2]:
                loss = image_loss(model, batch) / 2
                loss.backward()
                micro.append(loss)
            before = model.fc.weight.detach().clone()
            grads.append(model.fc.weight.grad.clone())
            opt.step()
            updates.append(model.fc.weight.detach() - before)
            w.loss(micro[0])
            w.step(loss=micro[1])
            losses.append((micro[0].item() + micro[1].item()) / 2)
    with probe.open_run(tmp_path / "run") as run:
        table = run.train().set_index(["step", "site"])
        scalars = run.train_scalars()
    for step in range(2):
        both = np.concatenate(outs[2 * step : 2 * step + 2])
        assert_row(table.loc[(step, "output")], both, f"step {step} output")
        assert_row(table.loc[(step, "param_grad.weight")], grads[step].numpy()[None], "grad")
        assert_row(table.loc[(step, "param_update.weight")], updates[step].numpy()[None], "upd")
    np.testing.assert_allclose(scalars["loss"], losses, rtol=1e-6)
    assert "lr.0" not in scalars  # (no optimizer given: no learning rates)


@pytest.mark.parametrize(("every", "recorded"), [("log", [0, 1, 2, 4, 8]), (3, [0, 3, 6, 9])])
def test_every_records_the_steps_it_names(tmp_path, every, recorded):
    """Steps are 0-based optimizer steps; every="log" takes 0, 1, 2, 4, 8, ...; the learning rate
    of a step is the one its update used (a scheduler changes it after the step)."""
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    probes = {"fc": {"layers": ["fc"], "capture": ["output"]}}
    with probe.watch(model, probes, out=tmp_path / "run", optimizer=opt, every=every) as w:
        for batch in image_batches(10, size=2):
            opt.zero_grad()
            image_loss(model, batch).backward()
            opt.step()
            sched.step()
        assert w.step_count == 10
    with probe.open_run(tmp_path / "run") as run:
        assert sorted(run.train()["step"].unique()) == recorded
        scalars = run.train_scalars()
    assert list(scalars["step"]) == recorded
    assert list(scalars["lr.0"]) == [0.5**s for s in recorded]


def test_the_gradients_recorded_are_those_the_optimizer_sees_under_a_grad_scaler(tmp_path):
    """With AMP's GradScaler and clip_grad_norm_ the optimizer steps on unscaled, clipped
    gradients: param_grad and grad_norm are those, grad_norm_preclip the unscaled norm before
    the clip, and the file holds the scale of each step."""
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    probes = {"fc": {"layers": ["fc"], "capture": ["param_grad.weight"]}}
    norms, scales, pre, post = [], [], [], []
    with probe.watch(model, probes, out=tmp_path / "run", optimizer=opt, scaler=scaler):
        for x, y in image_batches(2):
            opt.zero_grad()
            scaler.scale(F.cross_entropy(model(x), y)).backward()
            scaler.unscale_(opt)
            params = list(model.parameters())
            pre.append(float(torch.nn.utils.get_total_norm([p.grad.double() for p in params])))
            torch.nn.utils.clip_grad_norm_(params, 0.01)
            post.append(float(torch.nn.utils.get_total_norm([p.grad.double() for p in params])))
            norms.append(float(model.fc.weight.grad.norm()))
            scales.append(scaler.get_scale())
            scaler.step(opt)
            scaler.update()
    assert min(pre) > 0.1
    with probe.open_run(tmp_path / "run") as run:
        np.testing.assert_allclose(run.train()["norm"], norms, rtol=1e-6)
        scalars = run.train_scalars()
        assert list(scalars["grad_scale"]) == scales
        np.testing.assert_allclose(scalars["grad_norm"], post, rtol=1e-7)  # (float32 norms)
        np.testing.assert_allclose(scalars["grad_norm_preclip"], pre, rtol=1e-6)


def test_a_loop_ending_its_steps_with_w_step_records_the_clipped_gradient(tmp_path):
    """A loop without optimizer= that clips, then w.step(loss=...): grad_norm is the clipped
    gradients' norm, grad_norm_preclip the norm before (measured at the end of the backward:
    nothing handed over)."""
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pre, post, losses = [], [], []
    with probe.watch(model, {"fc": {"layers": ["fc"]}}, out=tmp_path / "run") as w:
        for batch in image_batches(2):
            opt.zero_grad()
            loss = image_loss(model, batch)
            loss.backward()
            params = list(model.parameters())
            pre.append(float(torch.nn.utils.clip_grad_norm_(params, 0.01).double()))
            post.append(float(torch.nn.utils.get_total_norm([p.grad.double() for p in params])))
            opt.step()
            w.step(loss=loss)
            losses.append(float(loss))
    with probe.open_run(tmp_path / "run") as run:
        scalars = run.train_scalars()
    np.testing.assert_allclose(scalars["grad_norm"], post, rtol=1e-7)  # (float32 norms)
    np.testing.assert_allclose(scalars["grad_norm_preclip"], pre, rtol=1e-6)
    assert list(scalars["loss"]) == losses


def test_two_watches_of_one_training_record_at_their_own_steps(tmp_path):
    """Parameters at every 3rd step, activations at every step: two watches, two directories,
    the same values where both record."""
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acts = {"fc": {"layers": ["fc"], "capture": ["output"]}}
    params = {"fc": {"layers": ["fc"], "capture": ["output", "param_update"]}}
    with (
        probe.watch(model, acts, out=tmp_path / "a", optimizer=opt),
        probe.watch(model, params, out=tmp_path / "p", optimizer=opt, every=3),
    ):
        for batch in image_batches(5, size=2):
            opt.zero_grad()
            image_loss(model, batch).backward()
            opt.step()
    with probe.open_run(tmp_path / "a") as a, probe.open_run(tmp_path / "p") as p:
        every, third = a.train(), p.train()
    assert list(every["step"]) == [0, 1, 2, 3, 4]
    assert sorted(third["step"].unique()) == [0, 3]
    mine = third[third["site"] == "output"].reset_index(drop=True)
    pd.testing.assert_frame_equal(mine, every[every["step"] % 3 == 0].reset_index(drop=True))


def test_a_file_written_before_grad_norm_preclip_resumes_without_it(tmp_path, monkeypatch):
    """A training resumed into a file whose scalars lack grad_norm_preclip (written before it
    was added) appends the file's own scalars, the same values at the same steps."""
    from probe.train import watched_run

    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probes = {"fc": {"layers": ["fc"]}}
    batches = image_batches(4)
    old = tuple(c for c in watched_run.SCALAR_COLUMNS if c != "grad_norm_preclip")
    with monkeypatch.context() as m:
        m.setattr(watched_run, "SCALAR_COLUMNS", old)
        with probe.watch(model, probes, out=tmp_path / "run", optimizer=opt) as w:
            for batch in batches[:2]:
                opt.zero_grad()
                image_loss(model, batch).backward()
                opt.step()
            state = w.state_dict()
    w = probe.watch(model, probes, out=tmp_path / "run", optimizer=opt)
    w.load_state_dict(state)
    norms = []
    with w:
        for batch in batches[2:]:
            opt.zero_grad()
            image_loss(model, batch).backward()
            params = list(model.parameters())
            norms.append(float(torch.nn.utils.get_total_norm([p.grad.double() for p in params])))
            opt.step()
    with probe.open_run(tmp_path / "run") as run:
        scalars = run.train_scalars()
    assert list(scalars.columns) == ["step", *old, "lr.0"] and list(scalars.step) == [0, 1, 2, 3]
    np.testing.assert_allclose(scalars.grad_norm[2:], norms, rtol=1e-7)  # (float32 norms)


def test_a_tied_parameter_watched_twice_records_its_update_at_each(tmp_path, step_path):
    """GPT-2's lm_head.weight is its wte.weight: watched under both modules, each row holds
    the one update the step made (the difference is taken once, into the copy kept before)."""
    from probe.testing.trainings import gpt2, token_batches, token_loss

    model = gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    probes = {"tied": {"layers": ["lm_head", "transformer.wte"], "capture": ["param_update"]}}
    updates = []
    with probe.watch(model, probes, out=tmp_path / "run", optimizer=opt):
        for batch in token_batches(2):
            opt.zero_grad()
            token_loss(model, batch).backward()
            before = model.lm_head.weight.detach().clone()
            opt.step()
            updates.append((model.lm_head.weight.detach() - before).numpy()[None])
    with probe.open_run(tmp_path / "run") as run:
        table = run.train().set_index(["step", "layer", "site"])
    for step, update in enumerate(updates):
        for layer in ("lm_head", "transformer.wte"):
            row = table.loc[(step, layer, "param_update.weight")]
            assert_row(row, update, f"step {step} {layer}")
