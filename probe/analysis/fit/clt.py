"""A cross-layer transcoder fitted to a run's captures (`python -m probe.fit RUN --kind clt`).

The run stores, per block, the MLP's input (`mlp_in`) or its norm's input (`resid_mid`) and the
MLP's output as token rows (`probes=mlp_io`); rows of one token are the same row index in every
site. A CLT needs every block 0..n-1. Rows are read in contiguous blocks of `BLOCK_ROWS` from
every site at once (shuffled by block and within a block: memory holds one block of 2 x n sites),
held-out samples (probe.analysis.fit.fit_sites.held_out) never train, and rows of position 0 and of
special tokens (fit_sites.left_out) neither train nor count in fit.csv unless `keep_special`, as for
per-layer fits; fit.csv's `left_out_rows` says how many there were.

The trainer (plain torch, the per-layer fits' fused Adam and schedule and dead counters:
probe.analysis.fit.trainer_base), on rows centred on and scaled by each site's first batch's mean
and spread (inputs centred and scaled, outputs scaled: b_dec learns their mean; the factors and
means are folded into the written weights):

- a feature of layer l reads layer l's input and writes to every layer l' >= l:
  out_l' = sum over l <= l' of acts_l @ W_dec[l][:, l' - l] + b_dec[l'];
- loss = sum over output layers of the mean squared error (over rows and units of the scaled
  outputs: about the sum of the layers' FVUs) + the penalty + AuxK, by activation:
  - jumprelu: `sparsity` x the sum over encoder layers l of (L0_l / l0_target - 1)^2, L0_l the
    batch's mean count of layer l's active features (the per-layer trainer's target-L0 penalty
    for each encoder layer: every layer's features steer to the same target, `l0_target`, else
    `k`; a straight-through step with a rectangle kernel of `bandwidth` for the thresholds'
    gradient, thresholds learnt as logs); decoders free;
  - relu: `sparsity` x the sum over features of activation x the norm of its whole decoder (every
    layer it writes to) / sqrt(d_out), averaged over rows: the per-layer trainer's penalty (a
    feature's writes as a share of an output row's RMS norm) with its coefficient; decoders free;
  - topk: k features of each layer a row; batchtopk: the k x rows largest pre-activations of each
    layer's batch, with a per-layer threshold (the running mean of each batch's smallest selected
    activation) that replaces the batch at inference: written as a JumpReLU CLT of that
    threshold for every feature of the layer; decoders free;
  - AuxK (topk and batchtopk): the features of layer l not fired for `dead_rows` rows (counted per
    feature) take each row's `aux_k` largest pre-activations among them and fit, through their
    whole decoders, the detached errors of every layer they write to (l..n-1, side by side):
    `aux_coefficient` x min(dead / aux_k, 1) x squared error over the errors' variance, summed
    over source layers;
  the penalty's coefficient warms up over `sparsity_warmup` of the steps; the learning rate rises
  over the first `lr_warmup` of the steps and falls to 0 over the last `lr_decay`;
- init: topk, batchtopk and jumprelu: W_dec 0 and W_enc uniform in +-1/sqrt(d_in), decoders
  free (as the per-layer trainer: FitOptions.decoder_from_zero); relu: each feature's whole
  decoder (all its slots) random at norm 0.1, and W_enc[l]'s columns the feature's first slot
  made unit norm (d_in = d_out; else random, of norm about 1); b_enc 0, b_dec[l] at the scaled
  outputs' mean, thresholds `threshold`.
- the peak learning rate (clt_learning_rate): `lr`, else CLT_LR[activation] x sqrt(LR_WIDTH /
  width), by measurement on the planted problem (docs/bench/fit_planted.md).

fit.csv holds one row per layer over the held-out rows: `fvu` of that layer's output (everything
written into it), `l0` and `dead` of that layer's features; and the loss measures of the
per-layer fit (probe.analysis.fit.losses: ce_clean, ce_spliced, ce_zero, ce_recovered, kl) over
the held-out samples (held_out.csv) with that layer's MLP output replaced by everything the CLT
writes into it, plus a row `all` with every layer replaced at once (`losses=False`: left out).
The CLT is written in circuit-tracer 0.5's CLT layout (probe.models.clt_files.save_cross_layer).

The fit is checkpointed every `checkpoint_every` steps (`checkpoint.pt` in `out`: the trainer with
its step, dead counters and thresholds, Adam's state with its scheduled learning rate, the epoch
and how many of its batches trained, the curve), so a fit cut short continues with `resume` and
gives the uninterrupted fit's files bit for bit.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch import nn

from probe.analysis.fit.fit_sites import LayerSites, find_sites, held_out, left_out, left_out_rows
from probe.analysis.fit.options import LR_WIDTH, FitOptions
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
    adam,
    check_loss_form,
    dense_codes,
    move_threshold,
    spread_scale,
    train_step,
)
from probe.errors import ConfigError, DataError
from probe.models.cross_layer_transcoder import CrossLayerTranscoder

log = logging.getLogger("probe.fit")
BLOCK_ROWS = 8192  # rows read from every site at once
CHECKPOINT = "checkpoint.pt"  # the fit so far, in its --out
# the form of the loss a checkpoint was trained under: raised when a change to the trainer makes
# a resumed fit differ from an uninterrupted one with the same options (2: relu and jumprelu
# take the per-layer trainer's penalties)
LOSS_FORM = 2
# the CLT trainer's peak learning rate at LR_WIDTH features a layer, x sqrt(LR_WIDTH / width):
# on the planted problem (docs/bench/fit_planted.md, 10 epochs) topk's held-out FVU was 0.48 at
# 1e-3, 0.25 at 3e-3, 0.08 at 1e-2 and 0.05-0.07 at 2e-2; jumprelu from unit decoders 0.77-0.83
# at 1e-3 and 0.30-0.32 at 1e-2, from W_dec = 0 (its start now) 0.10-0.12 at 1e-2; relu (30
# epochs, its penalty now) 0.033 / 0.043 (blocks 0 / 1) at 1e-2, 0.022 / 0.030 at 2e-2.
# The penalties and their coefficients are the per-layer trainer's (options.PENALTY), each
# encoder layer's: relu's coefficient 1e-2 on activation x decoder norm without the
# 1 / sqrt(d_out) (2.7 times as strong at d_out 64) left L0 at 6.7 of the planted 7.6 and FVU
# 0.044 / 0.062 at 30 epochs (1e-2); jumprelu's L0 penalty without a target (1e-2 x L0) 0.066 /
# 0.082 at L0 5.1 / 4.8, its target 8 now 0.020 / 0.028 at L0 7.4 / 7.1.
CLT_LR = {"relu": 2e-2, "jumprelu": 1e-2, "topk": 2e-2, "batchtopk": 2e-2}
CLT_COLUMNS = ["layer", "kind", "reads", "activation", "width", "k", "steps", "rows",
               "held_out_rows", "left_out_rows", "fvu", "l0", "dead", "ce_clean", "ce_spliced",
               "ce_zero", "ce_recovered", "kl", "seconds"]  # fmt: skip


def clt_learning_rate(options: FitOptions, width: int) -> float:
    """Adam's peak learning rate of a CLT fit of `width` features a layer: `lr`, else
    CLT_LR[activation] x sqrt(LR_WIDTH / width)."""
    if options.lr is not None:
        return options.lr
    return CLT_LR[options.activation] * (LR_WIDTH / width) ** 0.5


class TrainingCLT(ScheduledTrainer):
    """The parameters a CLT fit learns, on scaled rows ((x_l * x_scale[l] - x_mean[l]) ->
    y_l * y_scale[l]), and the state of its schedule over `total_steps` steps (see the module
    docstring)."""

    x_scale: torch.Tensor  # buffers (registered in __init__)
    y_scale: torch.Tensor
    x_mean: torch.Tensor
    batch_threshold: torch.Tensor

    def __init__(self, n: int, d_in: int, d_out: int, options: FitOptions, seed: int,
                 total_steps: int = 1):  # fmt: skip
        d_tc = options.feature_width(d_in)
        super().__init__(options, total_steps, (n, d_tc))
        self.n = n
        g = torch.Generator().manual_seed(seed)
        decoders = []
        if options.decoder_from_zero:
            decoders = [torch.zeros(d_tc, n - layer, d_out) for layer in range(n)]
            W_enc = (torch.rand(n, d_in, d_tc, generator=g) * 2 - 1) / d_in**0.5
        else:
            for layer in range(n):
                w = torch.randn(d_tc, n - layer, d_out, generator=g)
                w = w / w.flatten(1).norm(dim=1)[:, None, None]
                decoders.append(w * 0.1)
            if d_in == d_out:
                W_enc = torch.stack([w[:, 0].T / w[:, 0].norm(dim=1) for w in decoders])
            else:
                W_enc = torch.randn(n, d_in, d_tc, generator=g) / d_in**0.5
        self.W_enc = nn.Parameter(W_enc.contiguous())
        self.b_enc = nn.Parameter(torch.zeros(n, d_tc))
        self.W_dec = nn.ParameterList([nn.Parameter(w) for w in decoders])
        self.b_dec = nn.Parameter(torch.zeros(n, d_out))
        self.log_threshold = (
            nn.Parameter(torch.full((n, d_tc), math.log(options.threshold)))
            if options.activation == "jumprelu" else None
        )  # fmt: skip
        self.register_buffer("x_scale", torch.ones(n))
        self.register_buffer("y_scale", torch.ones(n))
        self.register_buffer("x_mean", torch.zeros(n, d_in))
        self.register_buffer("batch_threshold", torch.full((n,), -1.0))  # batchtopk; < 0: unset
        self._smallest: list[torch.Tensor | None] = []

    @property
    def width(self) -> int:
        return self.W_enc.shape[-1]

    @property
    def aux_k(self) -> int:
        return self.options.aux_k or max(1, self.b_dec.shape[1] // 2)

    def start(self, xs: list[torch.Tensor], ys: list[torch.Tensor]) -> None:
        """Scales and the inputs' means from a first batch of raw rows (trainer_base.spread_scale
        per site); b_dec at the scaled outputs' mean."""
        with torch.no_grad():
            for layer, (x, y) in enumerate(zip(xs, ys, strict=True)):
                self.x_scale[layer] = spread_scale(x)
                self.y_scale[layer] = spread_scale(y)
                self.x_mean[layer] = x.mean(0) * self.x_scale[layer]
                self.b_dec[layer] = (y * self.y_scale[layer]).mean(0)

    def encode(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, SparseCodes | DenseCodes,
                                                           torch.Tensor]:  # fmt: skip
        """(pre-activations, activations, penalty before its coefficient) of layer `layer`'s
        scaled rows. topk and batchtopk: chosen as the per-layer trainer's
        (probe.analysis.fit.sparse_codes), the pre-activations computed without a graph and only
        the chosen ones carrying gradients."""
        o = self.options
        xc = x - self.x_mean[layer]
        if o.activation in ("topk", "batchtopk"):
            with torch.no_grad():
                pre = torch.addmm(self.b_enc[layer], xc, self.W_enc[layer])
            chosen = top_rows(pre, o.k) if o.activation == "topk" else top_batch(pre, o.k)
            values = selected_preactivations(xc, self.W_enc[layer], self.b_enc[layer], pre, chosen)
            return pre, SparseCodes(torch.relu(values), chosen), pre.new_zeros(())
        pre = xc @ self.W_enc[layer] + self.b_enc[layer]
        norms = self.W_dec[layer].flatten(1).norm(dim=1)
        thresholds = None if self.log_threshold is None else self.log_threshold[layer]
        codes, penalty = dense_codes(pre, o, norms, self.b_dec.shape[1], thresholds)
        return pre, codes, penalty

    def forward(self, xs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor],
                                                       list, torch.Tensor]:  # fmt: skip
        """(each layer's prediction, pre-activations and activations, the penalty summed over
        layers) on scaled rows."""
        pres, acts, penalty = [], [], xs[0].new_zeros(())
        for layer, x in enumerate(xs):
            pre, a, p = self.encode(layer, x)
            pres.append(pre)
            acts.append(a)
            penalty = penalty + p
        outs = [self.b_dec[layer].expand(len(xs[0]), -1) for layer in range(self.n)]
        for source, a in enumerate(acts):
            w = self.W_dec[source]
            writes = a.decode(w.flatten(1)).view(len(xs[0]), *w.shape[1:])
            for j in range(self.n - source):
                outs[source + j] = outs[source + j] + writes[:, j]
        return outs, pres, acts, penalty

    def auxk(self, xs: list[torch.Tensor], pres: list[torch.Tensor],
             errors: list[torch.Tensor]) -> torch.Tensor:  # fmt: skip
        """AuxK's loss before its coefficient, summed over the source layers: each row's aux_k
        largest pre-activations among layer l's dead features (sparse_codes.top_among; `pres`
        without a graph, the chosen ones carrying gradients from the scaled rows `xs`) fit the
        (detached) errors of every layer they write to, l..n-1, side by side through their
        whole decoders: squared error over the errors' variance x min(dead / aux_k, 1)."""
        dead = self.dead()
        total = pres[0].new_zeros(())
        for layer, pre in enumerate(pres):
            n = int(dead[layer].sum())
            if n == 0:
                continue
            chosen = top_among(pre, dead[layer].nonzero().squeeze(1), self.aux_k)
            values = selected_preactivations(xs[layer] - self.x_mean[layer], self.W_enc[layer],
                                             self.b_enc[layer], pre, chosen)  # fmt: skip
            fit = SparseCodes(torch.relu(values), chosen).decode(self.W_dec[layer].flatten(1))
            error = torch.cat(errors[layer:], dim=1)
            variance = (error - error.mean(0)).pow(2).sum().clamp_min(1e-12)
            total = total + min(n / self.aux_k, 1.0) * (fit - error).pow(2).sum() / variance
        return total

    def loss(self, xs: list[torch.Tensor], ys: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
        """The training loss on raw rows at this step (sum over output layers of the MSE, plus
        the warmed-up penalty, plus AuxK) and its parts (mse, penalty, auxk, the batch's fvu
        averaged over layers)."""
        o = self.options
        xs = [x * self.x_scale[i] for i, x in enumerate(xs)]
        ys = [y * self.y_scale[i] for i, y in enumerate(ys)]
        preds, pres, acts, penalty = self(xs)
        mses = [(p - y).pow(2).mean() for p, y in zip(preds, ys, strict=True)]
        mse = torch.stack(mses).sum()
        loss = mse + self.sparsity() * penalty
        aux = mse.new_zeros(())
        if o.activation in ("topk", "batchtopk") and o.aux_coefficient > 0:
            aux = self.auxk(xs, pres, [(y - p).detach() for p, y in zip(preds, ys, strict=True)])
            loss = loss + o.aux_coefficient * aux
        with torch.no_grad():
            fvu = [float(m / (y - y.mean(0)).pow(2).mean().clamp_min(1e-12)) for m, y in zip(mses, ys, strict=True)]  # fmt: skip
            self._fired = torch.stack([a.fired() for a in acts])
            self._smallest = (
                [a.smallest() for a in acts if isinstance(a, SparseCodes)]
                if o.activation == "batchtopk" else []
            )  # fmt: skip
        parts = {"mse": float(mse.detach()), "penalty": float(penalty.detach()),
                 "auxk": float(aux.detach())}  # fmt: skip
        return loss, parts | {"fvu": float(np.mean(fvu))}

    @torch.no_grad()
    def after_step(self, rows: int) -> None:
        """The step, dead counters and batchtopk's thresholds moved on."""
        super().after_step(rows)
        for layer, smallest in enumerate(self._smallest):
            if smallest is not None:
                move_threshold(self.batch_threshold[layer], smallest)
        self._smallest = []

    @torch.no_grad()
    def cross_layer(self, reads: str, model_name: str | None, scan: str) -> CrossLayerTranscoder:
        """The learnt CLT on the model's units (scales and the inputs' means folded into the
        weights; batchtopk as a JumpReLU of each layer's threshold)."""
        a, c, o = self.x_scale, self.y_scale, self.options
        decoders = [w / c[layer:, None] for layer, w in enumerate(self.W_dec)]
        b_enc = self.b_enc - torch.einsum("ld,ldf->lf", self.x_mean, self.W_enc)
        threshold = None
        if self.log_threshold is not None:
            threshold = self.log_threshold.exp()
        elif o.activation == "batchtopk":
            threshold = self.batch_threshold.clamp_min(0)[:, None].expand_as(self.b_enc).clone()
        return CrossLayerTranscoder(
            self.W_enc * a[:, None, None], b_enc, [w.clone() for w in decoders],
            self.b_dec / c[:, None],
            activation="jumprelu" if o.activation == "batchtopk" else o.activation,
            threshold=threshold, k=o.k if o.activation == "topk" else None, reads=reads,
            model_name=model_name, scan=scan,
        )  # fmt: skip


class CltFit:
    """A CLT fitted to the run at `run_path` into `out` (default RUN/clt): `run()` trains,
    writes the CLT, fit.csv and held_out.csv, and returns fit.csv's table (`losses` False:
    without the loss measures)."""

    def __init__(self, run_path, out=None, options: FitOptions | None = None,
                 mlp: str | None = None, norm: str | None = None, losses: bool = True,
                 resume: bool = False):  # fmt: skip
        from probe.read.runs import open_run
        from probe.read.stream import sources_of

        self.options = options or FitOptions()
        self.options.check()
        if self.options.skip:
            raise ConfigError(
                "--skip with --kind clt: circuit-tracer's CLT layout has no skip matrix; fit "
                "without --skip"
            )
        self.run_path = Path(run_path)
        self.losses = losses
        self.out = Path(out) if out is not None else self.run_path / "clt"
        self.checkpoint = self.out / CHECKPOINT
        self._check_resume(resume)
        with open_run(self.run_path) as run:
            self.sites = find_sites(run.keys, self.options.reads, mlp, norm)
            blocks = sorted(self.sites)
            missing = sorted(set(range(max(blocks) + 1)) - set(blocks))
            if missing:
                where = "MLP input" if self.options.reads == "mlp_in" else "MLP norm's input"
                raise DataError(
                    f"a cross-layer transcoder reads and writes every block, but the run holds no "
                    f"{where} and MLP output rows of block(s) {missing}: run with probes=mlp_io "
                    "over every block (or fit per-layer transcoders: --kind plt)"
                )
            self.num_samples = run.num_samples
            self.model_name = str(run.config.get("model", {}).get("name", "") or "")
            self.special, self.left_out_rows = left_out_rows(run, self.options.keep_special)
            self.options.feature_width(run.file[_path(self.sites[0].inputs)].shape[-1])
            for s in self.sites.values():
                for site in (s.inputs, s.outputs):
                    if run.file[_path(site)].attrs.get("row_unit") != "tokens":
                        raise DataError(
                            f"{site[0]!r} {site[1]!r} is not stored one row per token: a CLT fit "
                            "pairs every block's rows of one token; capture with rows=tokens "
                            "(probes=mlp_io)"
                        )
            ranges = None
            for s in self.sites.values():
                (src,) = sources_of(run, *s.inputs, pair=s.outputs)
                ranges = src.ranges if ranges is None else _intersect(ranges, src.ranges)
            self.pieces = [(lo, min(lo + BLOCK_ROWS, hi)) for lo, hi in ranges or []
                           for lo in range(lo, hi, BLOCK_ROWS)]  # fmt: skip

    def _check_resume(self, resume: bool) -> None:
        """ConfigError for a fit into a folder that holds one (unless `resume`), a `resume`
        with nothing to continue, or one with other options than the checkpoint's."""
        if not resume:
            if self.checkpoint.is_file() or (self.out / "config.yaml").is_file():
                raise ConfigError(
                    f"{self.out} already holds a fit: --resume continues it, or give another --out"
                )
            return
        if not self.checkpoint.is_file():
            raise ConfigError(f"--resume: {self.out} holds no CLT fit ({CHECKPOINT}) to continue")
        state = torch.load(self.checkpoint, weights_only=False)
        check_loss_form(state, LOSS_FORM, self.checkpoint)
        stored = state["options"]
        now = asdict(self.options)
        if stored != now:
            diff = [f"{k}={stored.get(k)!r} (now {v!r})" for k, v in now.items()
                    if stored.get(k) != v]  # fmt: skip
            raise ConfigError(
                f"--resume with other options than {CHECKPOINT} was fitted with: "
                f"{', '.join(diff)}; give the same options, or another --out"
            )

    def keep(self, f, lo: int, hi: int, train: bool) -> np.ndarray:
        """Which of rows lo..hi train (or, `train` False, are measured): not held out (held
        out), and not of position 0 or a special token unless keep_special."""
        o = self.options
        held = held_out(f["tokens/sample"][lo:hi], self.num_samples, o.test_fraction, o.seed)
        keep = ~held if train else held
        if not o.keep_special:
            keep &= ~left_out(f["tokens/position"][lo:hi], f["tokens/id"][lo:hi], self.special)
        return keep

    def batches(self, run, train: bool, epoch: int, shuffle: bool = True, skip: int = 0):
        """([x_l], [y_l]) batches of the training (or held-out) rows, float32, less the first
        `skip` (a resumed epoch's trained batches: their rows are not read, the shuffle the same)."""
        from probe.store.fileformat import layer_path

        o, f = self.options, run.file
        rng = np.random.default_rng(o.seed + 1000 * epoch)
        order = rng.permutation(len(self.pieces)) if shuffle else range(len(self.pieces))
        sites: list[LayerSites] = [self.sites[layer] for layer in sorted(self.sites)]
        for i in order:
            lo, hi = self.pieces[i]
            keep = self.keep(f, lo, hi, train)
            rows = int(keep.sum())
            if not rows:
                continue
            perm = torch.from_numpy(rng.permutation(rows)) if shuffle else None
            starts = range(0, rows, o.batch_size)
            if skip >= len(starts):  # (every batch of this piece trained already)
                skip -= len(starts)
                continue
            starts, skip = starts[skip:], 0
            xs = [torch.from_numpy(f[layer_path(*s.inputs)][lo:hi][keep]).float() for s in sites]
            ys = [torch.from_numpy(f[layer_path(*s.outputs)][lo:hi][keep]).float() for s in sites]
            for b in starts:
                idx = perm[b : b + o.batch_size] if perm is not None else slice(b, b + o.batch_size)
                yield [x[idx] for x in xs], [y[idx] for y in ys]

    def run(self) -> pd.DataFrame:
        from probe.models.clt_files import save_cross_layer
        from probe.read.runs import open_run

        o, started = self.options, time.perf_counter()
        with open_run(self.run_path) as run:
            n = len(self.sites)
            first = self.sites[0]
            d_in = run.file[_path(first.inputs)].shape[-1]
            d_out = run.file[_path(first.outputs)].shape[-1]
            train_rows = sum(int(self.keep(run.file, lo, hi, True).sum()) for lo, hi in self.pieces)
            if train_rows == 0:
                raise DataError(
                    f"no training rows: --test-fraction {o.test_fraction} holds out every sample"
                )
            total = o.steps or max(1, math.ceil(o.epochs * math.ceil(train_rows / o.batch_size)))
            model = TrainingCLT(n, d_in, d_out, o, seed=o.seed, total_steps=total)
            opt = adam(model.parameters(), clt_learning_rate(o, model.width))
            step, epoch, trained, rows, curve, seconds = 0, 0, 0, 0, [], 0.0
            state = (
                torch.load(self.checkpoint, weights_only=False)
                if self.checkpoint.is_file() else None
            )  # fmt: skip
            if state is not None:
                model.load_state_dict(state["model"])
                opt.load_state_dict(state["optimizer"])
                step, epoch, trained = state["step"], state["epoch"], state["trained"]
                rows, curve, seconds = state["rows"], state["curve"], state["seconds"]
                log.info("clt: resuming at step %d of %d", step, total)

            def save() -> None:
                self.out.mkdir(parents=True, exist_ok=True)
                snapshot = {"options": asdict(o), "loss_form": LOSS_FORM, "step": step,
                            "epoch": epoch, "trained": trained, "rows": rows, "curve": curve,
                            "model": model.state_dict(), "optimizer": opt.state_dict(),
                            "seconds": seconds + time.perf_counter() - started}  # fmt: skip
                tmp = self.checkpoint.with_suffix(".tmp")
                torch.save(snapshot, tmp)
                os.replace(tmp, self.checkpoint)

            while step < total:
                for i, (xs, ys) in enumerate(self.batches(run, True, epoch, skip=trained),
                                             start=trained):  # fmt: skip
                    if step == 0:
                        model.start(xs, ys)
                    parts = train_step(model, opt, xs, ys)
                    step, rows, trained = step + 1, rows + len(xs[0]), i + 1
                    curve.append((step, parts["fvu"], parts["penalty"]))
                    if step % o.checkpoint_every == 0 or step == total:
                        save()
                    if step == total:
                        break
                else:
                    epoch, trained = epoch + 1, 0
            seconds += time.perf_counter() - started
            short = self.model_name.rstrip("/").split("/")[-1] or "model"
            clt = model.cross_layer(o.reads, self.model_name or None, f"{short}-clt-{o.activation}")
            metrics = evaluate(clt, self.batches(run, False, 0, shuffle=False))
        save_cross_layer(clt, self.out)
        seconds = round(seconds, 3)
        losses = self.loss_measures(clt)
        k = clt.k  # the written CLT's own (topk's k; batchtopk is written as a JumpReLU: none)
        rows_out = [{"layer": layer, "kind": "clt", "reads": o.reads, "activation": o.activation,
                     "width": clt.d_tc, "k": k, "steps": step, "rows": rows,
                     "left_out_rows": self.left_out_rows, **metrics[layer],
                     **losses.get(layer, {}), "seconds": seconds} for layer in range(n)]  # fmt: skip
        if "all" in losses:
            rows_out.append({"layer": "all", "kind": "clt", "reads": o.reads,
                             "activation": o.activation, "k": k, **losses["all"]})  # fmt: skip
        table = pd.DataFrame(rows_out, columns=CLT_COLUMNS)
        table.to_csv(self.out / "fit.csv", index=False)
        pd.DataFrame(curve, columns=["step", "fvu", "penalty"]).to_csv(
            self.out / "fit_curve.csv", index=False
        )
        for r in table.itertuples():
            if r.layer != "all":
                log.info("clt layer %s: fvu %.4f, l0 %.1f, dead %.3f", r.layer, r.fvu, r.l0, r.dead)
        return table

    def loss_measures(self, clt: CrossLayerTranscoder) -> dict:
        """The loss measures (probe.analysis.fit.losses) of `clt` over the held-out samples,
        each layer replaced alone and `all` at once; writes held_out.csv (the samples, always)."""
        from probe.analysis.fit.fitting import HELD_OUT
        from probe.analysis.fit.losses import (
            held_out_samples,
            loss_measures,
            run_model,
            sample_tokens,
        )
        from probe.analysis.fit.transcoder_splice import splice_points
        from probe.read.runs import open_run

        o = self.options
        with open_run(self.run_path) as run:
            samples = held_out_samples(run, o.test_fraction, o.seed)
            samples.to_csv(self.out / HELD_OUT, index=False)
            if not self.losses:
                return {}
            model = run_model(run)
            points = splice_points(model, sorted(self.sites), o.reads, self.sites)
            sequences = sample_tokens(run, samples["sample"].to_numpy())
            return loss_measures(model, sequences, points, copy.deepcopy(clt).float())


def _path(site: tuple[str, str]) -> str:
    from probe.store.fileformat import layer_path

    return layer_path(*site)


def _intersect(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out = [(max(x0, y0), min(x1, y1)) for x0, x1 in a for y0, y1 in b]
    return sorted((lo, hi) for lo, hi in out if hi > lo)


@torch.no_grad()
def evaluate(clt: CrossLayerTranscoder, batches) -> list[dict]:
    """Per layer over `batches` of ([x_l], [y_l]): FVU of its output (sum of squared errors over
    the sum of squares about the rows' mean, float64), mean active features of the layer per row,
    the share of its features never active, the rows."""
    clt = copy.deepcopy(clt).double()
    n = len(clt)
    sse, active, rows = np.zeros(n), np.zeros(n), 0
    total = torch.zeros(n, clt.d_out, dtype=torch.float64)  # per layer, the outputs' sum
    sq = torch.zeros(n, clt.d_out, dtype=torch.float64)  # and their squares' sum
    fired = torch.zeros(n, clt.d_tc, dtype=torch.bool)
    for xs, ys in batches:
        xs, ys = [x.double() for x in xs], [y.double() for y in ys]
        acts = [clt.encode(layer, x) for layer, x in enumerate(xs)]
        preds = clt.decode(acts)
        for layer in range(n):
            y = ys[layer]
            sse[layer] += float((y - preds[layer]).pow(2).sum())
            on = acts[layer] != 0
            active[layer] += float(on.sum())
            fired[layer] |= on.any(0)
            total[layer] += y.sum(0)
            sq[layer] += y.pow(2).sum(0)
        rows += len(xs[0])
    if not rows:
        return [{"held_out_rows": 0, "fvu": math.nan, "l0": math.nan, "dead": math.nan}] * n
    out = []
    for layer in range(n):
        sst = float((sq[layer] - total[layer].pow(2) / rows).sum())
        out.append({"held_out_rows": rows, "fvu": sse[layer] / sst if sst > 0 else math.nan,
                    "l0": active[layer] / rows,
                    "dead": 1 - float(fired[layer].double().mean())})  # fmt: skip
    return out
