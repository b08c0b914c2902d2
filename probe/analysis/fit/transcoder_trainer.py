"""The transcoder trainer: the parameters a fit learns and one optimizer step of its loss.

Plain torch (Adam), the trainers the field uses now:

- rows: inputs centred on and scaled by the first batch's mean and spread (each unit has variance
  1 on average), outputs scaled the same way (not centred: b_dec learns their mean); the factors
  are folded into the saved weights, so the files compute on the model's own units. Scaling by the
  spread about the mean (not the raw norm) keeps a layer whose rows share a large mean from having
  its variance, and so its loss, shrunk next to the penalty.
- loss = mse (over rows and units of the scaled outputs: about the batch's FVU) + the penalty +
  AuxK, by activation:
  - relu: `sparsity` x sum over features of activation x decoder row norm / sqrt(d_out) (each
    feature's contribution to the output as a share of the output rows' RMS norm: one coefficient
    fits every layer's width and scale), averaged over rows; decoder rows free.
  - jumprelu: `sparsity` x (L0 / l0_target - 1)^2, L0 the batch's mean count of active features
    through a straight-through step (dictionary_learning's target-L0 JumpReLU; a rectangle kernel
    of `bandwidth` for the thresholds' gradient only, as Gemma Scope's; thresholds learnt as logs
    from `threshold`, 0.001 as Gemma Scope's). The encoder learns through the reconstruction
    alone, so L0 can fall short of the target where the features' own ReLU counts are fewer.
  - topk: the k largest pre-activations of each row (ReLU'd), decoded from their indices (an
    embedding bag: k decoder rows a row, not a dense product over every feature). The
    pre-activations are computed without a graph; only the chosen ones carry gradients, through
    backward passes written out in probe.analysis.fit.sparse_codes (the dense formula's
    gradients, without autograd's scatters into zeros).
  - batchtopk: the k x rows largest pre-activations of the whole batch (ReLU'd; chosen and
    decoded as topk's, a row holding however many of them fall in it); a global threshold (the
    running mean, momentum trainer_base.THRESHOLD_MOMENTUM, of the smallest selected activation
    of each batch) replaces the batch at inference: the saved transcoder is a JumpReLU with that
    threshold for every feature.
  - AuxK (topk and batchtopk; Gao et al. 2024): the `aux_k` largest pre-activations among the
    dead features (not fired for `dead_rows` rows; the top-k taken over those columns only)
    reconstruct the residual error y - y_hat;
    `aux_coefficient` x min(dead / aux_k, 1) x its squared error over the error's variance.
  The penalty's coefficient rises linearly from 0 over the first `sparsity_warmup` of the steps.
- the learning rate rises linearly over the first `lr_warmup` of the steps and falls linearly to 0
  over the last `lr_decay`.
- decoder rows free for every activation, as sparsify's transcoders: on the planted problem at 10
  passes (640 steps) topk's held-out FVU was 0.34 with unit rows, 0.08 with free rows and 0.05
  with free rows from 0 (docs/bench/transcoders.md); jumprelu's (1,280 steps) 0.25 with unit
  rows tied to the encoder, 0.034 with free rows from 0 (docs/bench/fit_planted.md).
- init: relu: decoder rows random directions of norm 0.1, W_enc = W_dec.T (when d_in = d_out,
  else random with the same column norms); topk, batchtopk and jumprelu
  (FitOptions.decoder_from_zero): W_dec 0 and W_enc uniform in +-1/sqrt(d_in) (torch's nn.Linear
  init; sparsify's transcoder init). b_enc 0, b_dec the scaled outputs' mean over the first
  batch, W_skip 0, jumprelu thresholds `threshold`.

Everything that changes while training (step, dead counters, batchtopk's threshold) is a buffer,
so a checkpoint's state_dict resumes the fit exactly.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from probe.analysis.fit.options import FitOptions
from probe.analysis.fit.sparse_codes import (
    SparseCodes,
    selected_preactivations,
    top_among,
    top_batch,
    top_rows,
)
from probe.analysis.fit.trainer_base import (
    DenseCodes,
    ScheduledTrainer,
    dense_codes,
    move_threshold,
    spread_scale,
    train_step,
)
from probe.models.transcoder import Transcoder

__all__ = ["LOSS_FORM", "TrainingTranscoder", "train_step"]

# the form of the loss a layer's checkpoint was trained under: raised when a change to this
# trainer makes a resumed fit differ from an uninterrupted one with the same options
LOSS_FORM = 1


class TrainingTranscoder(ScheduledTrainer):
    """The parameters a fit learns, on scaled rows ((x - x_mean) * x_scale -> y * y_scale), and
    the state of its schedule over `total_steps` steps."""

    x_scale: torch.Tensor  # buffers (registered in __init__)
    y_scale: torch.Tensor
    x_mean: torch.Tensor
    batch_threshold: torch.Tensor

    def __init__(self, d_in: int, d_out: int, options: FitOptions, seed: int,
                 total_steps: int = 1):  # fmt: skip
        d_tc = options.feature_width(d_in)
        super().__init__(options, total_steps, (d_tc,))
        g = torch.Generator().manual_seed(seed)
        if options.decoder_from_zero:
            W_dec = torch.zeros(d_tc, d_out)
            W_enc = (torch.rand(d_in, d_tc, generator=g) * 2 - 1) / d_in**0.5
        else:
            norm = 0.1  # relu
            W_dec = torch.randn(d_tc, d_out, generator=g)
            W_dec = W_dec / W_dec.norm(dim=1, keepdim=True) * norm
            if d_in == d_out:
                W_enc = W_dec.T.clone()
            else:
                W_enc = torch.randn(d_in, d_tc, generator=g)
                W_enc = W_enc / W_enc.norm(dim=0, keepdim=True) * norm
        self.W_enc, self.W_dec = nn.Parameter(W_enc), nn.Parameter(W_dec)
        self.b_enc, self.b_dec = nn.Parameter(torch.zeros(d_tc)), nn.Parameter(torch.zeros(d_out))
        self.log_threshold = (
            nn.Parameter(torch.full((d_tc,), math.log(options.threshold)))
            if options.activation == "jumprelu" else None
        )  # fmt: skip
        self.W_skip = nn.Parameter(torch.zeros(d_out, d_in)) if options.skip else None
        self.register_buffer("x_scale", torch.tensor(1.0))
        self.register_buffer("y_scale", torch.tensor(1.0))
        self.register_buffer("x_mean", torch.zeros(d_in))
        self.register_buffer("batch_threshold", torch.tensor(-1.0))  # batchtopk; < 0: unset
        self._smallest: torch.Tensor | None = None

    def start(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Scales and the input's mean from a first batch of raw rows; b_dec at the scaled
        outputs' mean."""
        with torch.no_grad():
            self.x_scale.fill_(spread_scale(x))
            self.y_scale.fill_(spread_scale(y))
            self.x_mean.copy_(x.mean(0) * self.x_scale)
            self.b_dec.copy_((y * self.y_scale).mean(0))

    @property
    def width(self) -> int:
        return self.W_dec.shape[0]

    @property
    def aux_k(self) -> int:
        return self.options.aux_k or max(1, self.W_dec.shape[1] // 2)

    def encode(
        self, xs: torch.Tensor
    ) -> tuple[torch.Tensor, SparseCodes | DenseCodes, torch.Tensor]:
        """(pre-activations, activations, penalty before its coefficient) of scaled rows. topk
        and batchtopk: the pre-activations are computed without a graph and only the chosen
        ones carry gradients (probe.analysis.fit.sparse_codes)."""
        o = self.options
        xc = xs - self.x_mean
        if o.activation in ("topk", "batchtopk"):
            with torch.no_grad():
                pre = torch.addmm(self.b_enc, xc, self.W_enc)
            chosen = top_rows(pre, o.k) if o.activation == "topk" else top_batch(pre, o.k)
            values = selected_preactivations(xc, self.W_enc, self.b_enc, pre, chosen)
            return pre, SparseCodes(torch.relu(values), chosen), pre.new_zeros(())
        pre = xc @ self.W_enc + self.b_enc
        norms = self.W_dec.norm(dim=1)
        codes, penalty = dense_codes(pre, o, norms, self.W_dec.shape[1], self.log_threshold)
        return pre, codes, penalty

    def forward(
        self, xs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, SparseCodes | DenseCodes, torch.Tensor]:
        """(prediction, pre-activations, activations, penalty) on scaled rows."""
        pre, acts, penalty = self.encode(xs)
        out = acts.decode(self.W_dec) + self.b_dec
        if self.W_skip is not None:
            out = out + xs @ self.W_skip.T
        return out, pre, acts, penalty

    def auxk(self, xs: torch.Tensor, pre: torch.Tensor, error: torch.Tensor) -> torch.Tensor:
        """AuxK's loss before its coefficient: the dead features' top aux_k (ReLU'd) of the
        scaled rows `xs` (`pre` their pre-activations, without a graph) predict `error`
        (detached), squared error over the error's variance x min(dead / aux_k, 1). With at
        most aux_k dead features every one is taken (no top-k to compute)."""
        dead = self.dead()
        n = int(dead.sum())
        if n == 0:
            return pre.new_zeros(())
        chosen = top_among(pre, dead.nonzero().squeeze(1), self.aux_k)
        values = selected_preactivations(xs - self.x_mean, self.W_enc, self.b_enc, pre, chosen)
        fit = SparseCodes(torch.relu(values), chosen).decode(self.W_dec)
        variance = (error - error.mean(0)).pow(2).sum().clamp_min(1e-12)
        return min(n / self.aux_k, 1.0) * (fit - error).pow(2).sum() / variance

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The training loss on raw rows at this step and its parts (mse, penalty, auxk, the
        batch's fvu)."""
        o = self.options
        xs, ys = x * self.x_scale, y * self.y_scale
        pred, pre, acts, penalty = self(xs)
        mse = (pred - ys).pow(2).mean()
        loss = mse + self.sparsity() * penalty
        aux = pre.new_zeros(())
        if o.activation in ("topk", "batchtopk") and o.aux_coefficient > 0:
            aux = self.auxk(xs, pre, (ys - pred).detach())
            loss = loss + o.aux_coefficient * aux
        with torch.no_grad():
            var = (ys - ys.mean(0)).pow(2).mean().clamp_min(1e-12)
            self._fired = acts.fired()
            self._smallest = None
            if isinstance(acts, SparseCodes) and o.activation == "batchtopk":
                self._smallest = acts.smallest()
        return loss, {"mse": float(mse.detach()), "penalty": float(penalty.detach()),
                      "auxk": float(aux.detach()),
                      "fvu": float(mse.detach() / var)}  # fmt: skip

    @torch.no_grad()
    def after_step(self, rows: int) -> None:
        """The step, dead counters (`rows` more rows) and batchtopk's threshold moved on."""
        super().after_step(rows)
        if self._smallest is not None:
            move_threshold(self.batch_threshold, self._smallest)
        self._smallest = None

    @torch.no_grad()
    def transcoder(self, layer: int) -> Transcoder:
        """The learnt transcoder on the model's units (scales and the input's mean folded into
        the weights; batchtopk as a JumpReLU of its threshold)."""
        a, c = float(self.x_scale), float(self.y_scale)
        o = self.options
        threshold = None
        if self.log_threshold is not None:
            threshold = self.log_threshold.exp()
        elif o.activation == "batchtopk":
            threshold = torch.full_like(self.b_enc, max(float(self.batch_threshold), 0.0))
        activation = "jumprelu" if o.activation == "batchtopk" else o.activation
        return Transcoder(
            self.W_enc * a, self.b_enc - self.x_mean @ self.W_enc, self.W_dec / c,
            self.b_dec / c, layer=layer, activation=activation, threshold=threshold,
            k=o.k if o.activation == "topk" else None,
            W_skip=self.W_skip * (a / c) if self.W_skip is not None else None,
        )  # fmt: skip
