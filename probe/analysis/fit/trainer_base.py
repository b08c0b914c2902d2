"""What the two transcoder trainers share: the per-layer one (transcoder_trainer.py) and the
cross-layer one (clt.py) both build on these pieces, so they train on one schedule.

- the schedule (`ramp`): the learning rate rises linearly over the first `lr_warmup` of the steps
  and falls linearly to 0 over the last `lr_decay`; the penalty's coefficient rises linearly
  from 0 over the first `sparsity_warmup`;
- `ScheduledTrainer`: the step and each feature's dead counter (rows since it last fired; `dead`
  says which AuxK counts dead) as buffers, so a checkpoint's state_dict resumes the schedule and
  AuxK exactly;
- `adam`: the optimizer (torch's fused Adam); `train_step`: one of its steps at the scheduled
  learning rate;
- the activations' straight-through functions (JumpReLU, Step), dense codes (`DenseCodes`: relu,
  jumprelu) and batchtopk's running threshold (`move_threshold`).

The top-k selections and their sparse codes (topk, batchtopk, AuxK's choice among the dead
features) are probe.analysis.fit.sparse_codes'; each trainer computes its own AuxK loss with them
(the per-layer one over its layer's error, the CLT's over the errors of every layer a source
layer writes to).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from probe.analysis.fit.options import FitOptions
from probe.errors import ConfigError

THRESHOLD_MOMENTUM = 0.99  # batchtopk's running threshold


class JumpReLU(torch.autograd.Function):
    """pre * (pre > threshold); the threshold's gradient through a rectangle kernel of width
    `bandwidth` (Rajamanoharan et al. 2024), the pre-activations' the plain one."""

    @staticmethod
    def forward(ctx, pre, threshold, bandwidth):
        ctx.save_for_backward(pre, threshold)
        ctx.bandwidth = bandwidth
        return pre * (pre > threshold)

    @staticmethod
    def backward(ctx, grad):
        pre, threshold = ctx.saved_tensors
        bw = ctx.bandwidth
        kernel = ((pre - threshold).abs() < bw / 2).to(pre.dtype)
        d_threshold = (-(threshold / bw) * kernel * grad).sum(0)
        return (pre > threshold) * grad, d_threshold, None


class Step(torch.autograd.Function):
    """(pre > threshold) as a number; its threshold gradient through the same kernel."""

    @staticmethod
    def forward(ctx, pre, threshold, bandwidth):
        ctx.save_for_backward(pre, threshold)
        ctx.bandwidth = bandwidth
        return (pre > threshold).to(pre.dtype)

    @staticmethod
    def backward(ctx, grad):
        pre, threshold = ctx.saved_tensors
        bw = ctx.bandwidth
        kernel = ((pre - threshold).abs() < bw / 2).to(pre.dtype)
        return torch.zeros_like(pre), (-(1.0 / bw) * kernel * grad).sum(0), None


def check_loss_form(state: dict, form: int, path) -> None:
    """ConfigError where the checkpoint `state` read from `path` was trained under another form of
    the loss than `form` (a checkpoint that names none: form 1): resumed under this one, the fit
    would not be the uninterrupted one its options describe."""
    stored = state.get("loss_form", 1)
    if stored != form:
        raise ConfigError(
            f"--resume: {path} was trained under another form of the loss ({stored}; this "
            f"version's is {form}), so the resumed fit would not be the uninterrupted one: fit "
            "again into another --out"
        )


def ramp(step: int, total: int, warmup: float, decay: float = 0.0) -> float:
    """The schedule's factor at `step` (0-based) of `total`: (step + 1) / w over the first w =
    ceil(warmup x total) steps, (total - step) / d over the last d = ceil(decay x total), else 1."""
    w = math.ceil(warmup * total)
    d = math.ceil(decay * total)
    factor = 1.0
    if step < w:
        factor = (step + 1) / w
    if d and step >= total - d:
        factor = min(factor, (total - step) / d)
    return factor


class DenseCodes:
    """Activations as a (rows, width) tensor (relu, jumprelu, batchtopk)."""

    def __init__(self, acts: torch.Tensor):
        self.acts = acts

    def decode(self, W_dec: torch.Tensor) -> torch.Tensor:
        return self.acts @ W_dec

    def fired(self) -> torch.Tensor:
        """Which features are active in some row (activations are >= 0)."""
        return self.acts.amax(0) > 0


def dense_codes(
    pre: torch.Tensor,
    o: FitOptions,
    decoder_norms: torch.Tensor,
    d_out: int,
    log_threshold: torch.Tensor | None,
) -> tuple[DenseCodes, torch.Tensor]:
    """A relu or jumprelu layer's activations from its pre-activations `pre` and its penalty,
    the same for per-layer and cross-layer fits: relu, each activation x its feature's whole
    decoder norm (`decoder_norms`) / sqrt(d_out), summed over features and averaged over rows;
    jumprelu, (L0 / target - 1)^2 through the straight-through step at exp(log_threshold)."""
    if o.activation == "relu":
        acts = torch.relu(pre)
        return DenseCodes(acts), (acts * decoder_norms).sum(-1).mean() / d_out**0.5
    assert log_threshold is not None  # a jumprelu fit has its thresholds
    threshold = log_threshold.exp()
    acts = JumpReLU.apply(pre, threshold, o.bandwidth)
    l0 = Step.apply(pre, threshold, o.bandwidth).sum(-1).mean()
    return DenseCodes(acts), (l0 / o.target_l0 - 1).pow(2)


def move_threshold(threshold: torch.Tensor, smallest: torch.Tensor) -> None:
    """batchtopk's running threshold (a 0-d tensor or view, < 0 while unset) moved in place to
    a batch's smallest selected activation: set to it the first time, then a running mean of
    momentum THRESHOLD_MOMENTUM."""
    m = smallest.to(threshold.dtype)
    if threshold < 0:
        threshold.copy_(m)
    else:
        threshold.mul_(THRESHOLD_MOMENTUM).add_((1 - THRESHOLD_MOMENTUM) * m)


def spread_scale(rows: torch.Tensor) -> float:
    """The factor that brings `rows`' mean squared distance from their mean to their width
    (each unit of variance 1 on average)."""
    spread = (rows - rows.mean(0)).pow(2).sum(1).mean().clamp_min(1e-12)
    return float((rows.shape[1] / spread).sqrt())


class ScheduledTrainer(nn.Module):
    """The state both trainers keep over `total_steps` steps: the step (a buffer) and each
    feature's rows since it last fired (`since_fired`, of shape `features`), both in the
    state_dict. A subclass computes `loss(x, y)` (noting which features fired in `self._fired`)
    and may move its own state on after each step (`after_step`, calling this one)."""

    step: torch.Tensor
    since_fired: torch.Tensor

    def __init__(self, options: FitOptions, total_steps: int, features: tuple[int, ...]):
        super().__init__()
        self.options, self.total_steps = options, int(total_steps)
        self.register_buffer("step", torch.tensor(0, dtype=torch.long))
        self.register_buffer("since_fired", torch.zeros(features, dtype=torch.long))
        self._fired: torch.Tensor | None = None

    def penalty_coefficient(self) -> float:
        """The penalty's coefficient once warmed up."""
        return self.options.penalty

    def sparsity(self) -> float:
        """The penalty's coefficient at this step (warmed up)."""
        o = self.options
        return self.penalty_coefficient() * ramp(int(self.step), self.total_steps,
                                                 o.sparsity_warmup)  # fmt: skip

    def lr_factor(self) -> float:
        """The learning rate's factor at this step."""
        o = self.options
        return ramp(int(self.step), self.total_steps, o.lr_warmup, o.lr_decay)

    def dead(self) -> torch.Tensor:
        """Which features AuxK counts dead: not fired for more than `dead_rows` rows."""
        return self.since_fired > self.options.dead_rows

    def loss(self, x, y) -> tuple[torch.Tensor, dict]:
        raise NotImplementedError

    @torch.no_grad()
    def after_step(self, rows: int) -> None:
        """The step and the dead counters (`rows` more rows; 0 where a feature fired) moved on."""
        self.step += 1
        self.since_fired += rows
        if self._fired is not None:
            self.since_fired[self._fired] = 0
        self._fired = None


def train_step(model: ScheduledTrainer, opt: torch.optim.Optimizer, x, y) -> dict:
    """One Adam step on a batch of raw (input, output) rows (tensors, or for a cross-layer
    trainer lists of each layer's) at the model's scheduled learning rate (each group's
    `initial_lr` x the schedule's factor); the loss's parts."""
    factor = model.lr_factor()
    for group in opt.param_groups:
        group.setdefault("initial_lr", group["lr"])
        group["lr"] = group["initial_lr"] * factor
    opt.zero_grad(set_to_none=True)
    loss, parts = model.loss(x, y)
    loss.backward()
    opt.step()
    model.after_step(len(x[0]) if isinstance(x, list | tuple) else len(x))
    return parts


def adam(params, lr: float) -> torch.optim.Adam:
    """The fits' optimizer: Adam in torch's fused form (one kernel a parameter; the same update
    as its loop over operations, to float rounding, in fewer passes over memory)."""
    return torch.optim.Adam(params, lr=lr, fused=True)
