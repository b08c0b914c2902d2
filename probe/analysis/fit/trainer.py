"""The transcoder trainer: the parameters a fit learns and one optimizer step of its loss.

The trainer is plain torch (Adam):

- inputs and outputs are scaled so their mean squared norm is their width (factors from the first
  batch, folded into the saved weights: the files compute on the model's own units);
- loss = mean squared error of the MLP output (over rows and units) + the sparsity penalty:
  relu: `sparsity` x the features' activations times their decoder rows' norms (summed over
  features, averaged over rows; decoder rows free); jumprelu: `sparsity` x L0, the count of
  active features, with a straight-through estimator (a rectangle kernel of `bandwidth` for the
  threshold's gradient, thresholds learnt as logs, as Gemma Scope and SAELens train); topk: none
  (k features per row); jumprelu and topk keep decoder rows at unit norm after each step;
- init: decoder rows random, W_enc = W_dec.T (when d_in = d_out), b_enc 0, b_dec the outputs'
  mean, W_skip 0, thresholds `threshold`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from probe.analysis.fit.options import FitOptions
from probe.models.transcoder import Transcoder


class _JumpReLU(torch.autograd.Function):
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


class _Step(torch.autograd.Function):
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


class TrainingTranscoder(nn.Module):
    """The parameters a fit learns, on scaled rows (x * x_scale -> y * y_scale)."""

    x_scale: torch.Tensor  # buffers (registered in __init__)
    y_scale: torch.Tensor

    def __init__(self, d_in: int, d_out: int, options: FitOptions, seed: int):
        super().__init__()
        self.options = options
        d_tc = options.width or 8 * d_in
        g = torch.Generator().manual_seed(seed)
        W_dec = torch.randn(d_tc, d_out, generator=g)
        W_dec = (
            W_dec / W_dec.norm(dim=1, keepdim=True) * (0.1 if options.activation == "relu" else 1)
        )
        W_enc = (
            W_dec.T.clone() if d_in == d_out else torch.randn(d_in, d_tc, generator=g) / d_in**0.5
        )
        self.W_enc, self.W_dec = nn.Parameter(W_enc), nn.Parameter(W_dec)
        self.b_enc, self.b_dec = nn.Parameter(torch.zeros(d_tc)), nn.Parameter(torch.zeros(d_out))
        self.log_threshold = (
            nn.Parameter(torch.full((d_tc,), math.log(options.threshold)))
            if options.activation == "jumprelu" else None
        )  # fmt: skip
        self.W_skip = nn.Parameter(torch.zeros(d_out, d_in)) if options.skip else None
        self.register_buffer("x_scale", torch.tensor(1.0))
        self.register_buffer("y_scale", torch.tensor(1.0))

    def start(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Scales from a first batch of raw rows; b_dec at the scaled outputs' mean."""
        with torch.no_grad():
            self.x_scale.fill_((x.shape[1] / x.pow(2).sum(1).mean().clamp_min(1e-12)).sqrt())
            self.y_scale.fill_((y.shape[1] / y.pow(2).sum(1).mean().clamp_min(1e-12)).sqrt())
            self.b_dec.copy_((y * self.y_scale).mean(0))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(prediction, activations, penalty) on scaled rows."""
        pre = x @ self.W_enc + self.b_enc
        o = self.options
        if o.activation == "relu":
            acts = torch.relu(pre)
            penalty = (acts * self.W_dec.norm(dim=1)).sum(-1).mean()
        elif o.activation == "jumprelu":
            assert self.log_threshold is not None  # a jumprelu fit has its thresholds
            threshold = self.log_threshold.exp()
            acts = _JumpReLU.apply(pre, threshold, o.bandwidth)
            penalty = _Step.apply(pre, threshold, o.bandwidth).sum(-1).mean()
        else:
            top = torch.topk(pre, o.k, dim=-1)
            acts = torch.zeros_like(pre).scatter(-1, top.indices, torch.relu(top.values))
            penalty = pre.new_zeros(())
        out = acts @ self.W_dec + self.b_dec
        if self.W_skip is not None:
            out = out + x @ self.W_skip.T
        return out, acts, penalty

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The training loss on raw rows and its parts (mse, penalty, the batch's fvu)."""
        xs, ys = x * self.x_scale, y * self.y_scale
        pred, _, penalty = self(xs)
        mse = (pred - ys).pow(2).mean()
        loss = mse + self.options.penalty * penalty
        with torch.no_grad():
            var = (ys - ys.mean(0)).pow(2).mean().clamp_min(1e-12)
        mse, penalty = mse.detach(), penalty.detach()
        return loss, {"mse": float(mse), "penalty": float(penalty), "fvu": float(mse / var)}

    @torch.no_grad()
    def after_step(self) -> None:
        """Unit decoder rows for jumprelu and topk (their penalty does not hold norms down)."""
        if self.options.activation != "relu":
            self.W_dec.div_(self.W_dec.norm(dim=1, keepdim=True).clamp_min(1e-12))

    @torch.no_grad()
    def transcoder(self, layer: int) -> Transcoder:
        """The learnt transcoder on the model's units (scales folded into the weights)."""
        a, c = float(self.x_scale), float(self.y_scale)
        o = self.options
        return Transcoder(
            self.W_enc * a, self.b_enc.clone(), self.W_dec / c, self.b_dec / c, layer=layer,
            activation=o.activation,
            threshold=self.log_threshold.exp() if self.log_threshold is not None else None,
            k=o.k if o.activation == "topk" else None,
            W_skip=self.W_skip * (a / c) if self.W_skip is not None else None,
        )  # fmt: skip


def train_step(model: TrainingTranscoder, opt: torch.optim.Optimizer, x, y) -> dict:
    """One Adam step on a batch of raw (input, output) rows; the loss's parts."""
    opt.zero_grad(set_to_none=True)
    loss, parts = model.loss(x, y)
    loss.backward()
    opt.step()
    model.after_step()
    return parts
