"""Training one transcoder per block from a run's captures of each MLP's input and output.

The run stores, per block, the MLP module's `input` (the normed residual: `mlp_in`) or the input
of the norm before it (`resid_mid`), and the MLP's `output`, as token rows (e.g. `probes=mlp_io`).
Rows of the same token are paired by `run.dataset(..., pair=...)` and streamed shuffled, with
bounded memory. The trainer is plain torch (Adam):

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

Each layer checkpoints its parameters, optimizer and stream position every `checkpoint_every`
steps in `out/checkpoints/`; a resumed fit gives the uninterrupted one's weights. Held-out rows
(whole samples: `held_out`) never train; fit.csv reports on them.
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch import nn

from probe.errors import ConfigError, DataError
from probe.models.anatomy import FAMILIES
from probe.models.transcoder import ACTIVATIONS, READS, Transcoder
from probe.models.transcoder_files import write_set_config, write_transcoder

log = logging.getLogger("probe.fit")
FIT_READS = ("mlp_in", "resid_mid")  # mlp_normalized is not captured by a run
MLP_NAMES = tuple(dict.fromkeys(f["mlp_out"] for f in FAMILIES.values() if not f.get("post_norm")))
NORM_NAMES = tuple(dict.fromkeys(f["mlp_norm"] for f in FAMILIES.values() if "mlp_norm" in f))
FIT_COLUMNS = ["layer", "reads", "activation", "width", "k", "skip", "steps", "rows",
               "held_out_rows", "fvu", "l0", "dead", "seconds"]  # fmt: skip
CHECKPOINTS = "checkpoints"


@dataclass(frozen=True)
class FitOptions:
    """What a fit trains (see the module docstring). `width` None: 8 x the input's width;
    `sparsity` None: 1e-2 (relu and jumprelu); `steps` per layer (None: `epochs`)."""

    activation: str = "relu"
    width: int | None = None
    k: int = 16
    reads: str = "mlp_in"
    skip: bool = False
    steps: int | None = None
    epochs: float = 1.0
    lr: float = 1e-3
    sparsity: float | None = None
    batch_size: int = 1024
    test_fraction: float = 0.1
    seed: int = 0
    threshold: float = 0.1  # jumprelu's initial threshold (on the scaled pre-activations)
    bandwidth: float = 0.05  # jumprelu's straight-through kernel width
    checkpoint_every: int = 200
    buffer_rows: int | None = None

    def check(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"--activation {self.activation!r}; choose {', '.join(ACTIVATIONS)}")
        if self.reads == "mlp_normalized":
            raise ConfigError(
                "--reads mlp_normalized: a fit reads captured token rows, and a run captures no "
                "norm output without its weight and bias; fit --reads mlp_in or resid_mid"
            )
        if self.reads not in READS:
            raise ConfigError(f"--reads {self.reads!r}; choose {', '.join(FIT_READS)}")
        positive = {"--batch-size": self.batch_size, "--lr": self.lr, "--epochs": self.epochs,
                    "--checkpoint-every": self.checkpoint_every, "--k": self.k,
                    "--bandwidth": self.bandwidth, "--threshold": self.threshold}  # fmt: skip
        if self.width is not None:
            positive["--width"] = self.width
        if self.steps is not None:
            positive["--steps"] = self.steps
        bad = [f"{k} {v}" for k, v in positive.items() if not v > 0]
        if self.sparsity is not None and self.sparsity < 0:
            bad.append(f"--sparsity {self.sparsity}")
        if not 0 < self.test_fraction < 1:
            bad.append(f"--test-fraction {self.test_fraction} (want it in (0, 1))")
        if bad:
            raise ConfigError(f"{', '.join(bad)}: each must be above 0")

    @property
    def penalty(self) -> float:
        if self.sparsity is not None:
            return self.sparsity
        return {"relu": 1e-2, "jumprelu": 1e-2, "topk": 0.0}[self.activation]


def held_out(samples: np.ndarray, num_samples: int, fraction: float, seed: int) -> np.ndarray:
    """Which rows are held out: those of samples `s` with `default_rng(seed).random(n)[s] <
    fraction` (whole samples, so no sequence gives rows to both sides)."""
    draws = np.random.default_rng(seed).random(max(num_samples, int(samples.max(initial=-1)) + 1))
    return draws[np.asarray(samples, np.int64)] < fraction


@dataclass(frozen=True)
class LayerSites:
    """Where block `layer`'s transcoder reads and what it predicts: (layer, site) of the run."""

    layer: int
    inputs: tuple[str, str]
    outputs: tuple[str, str]


def _site(keys: set, layer: str, names: tuple[str, ...]) -> str | None:
    return next((s for s in names if (layer, s) in keys), None)


def find_sites(keys: list[tuple[str, str]], reads: str, mlp: str | None = None,
               norm: str | None = None) -> dict[int, LayerSites]:  # fmt: skip
    """Block index -> its MLP's input (or its norm's input) and output among a run's keys; the
    block's MLP is `<blocks>.<i>.<mlp>` (default: the MLP names the anatomy knows)."""
    have = set(keys)
    mlps, norms = (mlp,) if mlp else MLP_NAMES, (norm,) if norm else NORM_NAMES
    found: dict[int, dict] = {}
    pattern = re.compile(r"^(?:.*\.)?(\d+)\.(.+)$")
    for layer in dict.fromkeys(lay for lay, _ in keys):
        m = pattern.match(layer)
        if not m:
            continue
        block, suffix = int(m.group(1)), m.group(2)
        if suffix in mlps:
            found.setdefault(block, {})["mlp"] = layer
        elif suffix in norms:
            found.setdefault(block, {})["norm"] = layer
    out = {}
    for block, names in sorted(found.items()):
        if "mlp" not in names:
            continue
        output = _site(have, names["mlp"], ("output", "output.0"))
        source = names["mlp"] if reads == "mlp_in" else names.get("norm")
        inp = _site(have, source, ("input", "input.0")) if source else None
        if output and inp and source:  # (inp only where a source)
            out[block] = LayerSites(block, (source, inp), (names["mlp"], output))
    if not out:
        wanted = (
            f"each block's MLP ({' or '.join(mlps)}) input and output"
            if reads == "mlp_in"
            else f"each block's MLP output and its norm's ({' or '.join(norms)}) input"
        )
        stored = ", ".join(f"{lay} {s}" for lay, s in keys[:8]) or "nothing"
        raise DataError(
            f"the run holds no {reads} pairs: a fit needs {wanted} as token rows (run with "
            f"probes=mlp_io{' and a probe of the norm input' if reads == 'resid_mid' else ''}, or "
            f"name the modules with --mlp/--norm); it stores: {stored}"
            f"{' ...' if len(keys) > 8 else ''}"
        )
    return out


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


@torch.no_grad()
def evaluate(t: Transcoder, batches) -> dict:
    """FVU (sum of squared errors over the sum of squares about the rows' mean, float64), mean
    active features per row and the share of features never active, over `batches` of (x, y)."""
    t = Transcoder(**{n: getattr(t, n).double() for n in ("W_enc", "b_enc", "W_dec", "b_dec")},
                   layer=t.layer, activation=t.activation, k=t.k,
                   threshold=None if t.threshold is None else t.threshold.double(),
                   W_skip=None if t.W_skip is None else t.W_skip.double())  # fmt: skip
    sse = active = rows = 0.0
    total = sq = None
    fired = torch.zeros(t.d_tc, dtype=torch.bool)
    for x, y in batches:
        x, y = x.double(), y.double()
        acts = t.encode(x)
        pred = t.decode(acts) + t.skip(x)
        sse += float((y - pred).pow(2).sum())
        on = acts != 0
        active += float(on.sum())
        fired |= on.any(0)
        total = y.sum(0) if total is None else total + y.sum(0)
        sq = y.pow(2).sum(0) if sq is None else sq + y.pow(2).sum(0)
        rows += len(x)
    if not rows:
        return {"fvu": float("nan"), "l0": float("nan"), "dead": float("nan"), "held_out_rows": 0}
    assert sq is not None and total is not None  # rows were read
    sst = float((sq - total.pow(2) / rows).sum())
    return {"fvu": sse / sst if sst > 0 else float("nan"), "l0": active / rows,
            "dead": 1 - float(fired.double().mean()), "held_out_rows": int(rows)}  # fmt: skip


def _save_atomic(obj, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


class Fit:
    """A fit of one run's transcoders into `out`: `run()` trains every layer not done."""

    def __init__(self, run_path, out=None, options: FitOptions | None = None,
                 layers: list[int] | None = None, resume: bool = False, mlp: str | None = None,
                 norm: str | None = None):  # fmt: skip
        from probe.read.runs import open_run

        self.options = options or FitOptions()
        self.options.check()
        self.run_path = Path(run_path)
        self.out = Path(out) if out is not None else self.run_path / "transcoders"
        with open_run(self.run_path) as run:
            self.sites = find_sites(run.keys, self.options.reads, mlp, norm)
            self.num_samples = run.num_samples
            self.model_name = str(run.config.get("model", {}).get("name", "") or "")
        blocks = sorted(self.sites)
        if layers:
            missing = sorted(set(layers) - set(blocks))
            if missing:
                raise ConfigError(
                    f"--layers {missing}: the run holds {self.options.reads} pairs of blocks "
                    f"{blocks} only"
                )
        self.layers = sorted(set(layers)) if layers else blocks
        self.checkpoints = self.out / CHECKPOINTS
        done_before = (
            sorted(self.checkpoints.glob("layer_*.pt")) if self.checkpoints.is_dir() else []
        )
        if done_before and not resume:
            raise ConfigError(
                f"{self.out} already holds a fit ({len(done_before)} layer checkpoints): --resume "
                "continues it, or give another --out"
            )
        for path in done_before:
            stored = torch.load(path, weights_only=False)["options"]
            if stored != asdict(self.options):
                diff = [f"{k}={stored.get(k)!r} (now {v!r})" for k, v in asdict(self.options).items()
                        if stored.get(k) != v]  # fmt: skip
                raise ConfigError(
                    f"--resume with other options than {path.name} was fitted with: "
                    f"{', '.join(diff)}; give the same options, or another --out"
                )

    def stream(self, sites: LayerSites, run, shuffle: bool = True):
        o = self.options
        return run.dataset(*sites.inputs, pair=sites.outputs, batch_size=o.batch_size,
                           shuffle=shuffle, seed=o.seed + sites.layer, with_index=True,
                           dtype=torch.float32, buffer_rows=o.buffer_rows)  # fmt: skip

    def pairs(self, stream, train: bool):
        """(x, y) of the training (or held-out) rows of each batch of `stream`."""
        o = self.options
        for rows, _, index, out in stream:
            held = torch.from_numpy(
                held_out(index["sample"].numpy(), self.num_samples, o.test_fraction, o.seed)
            )
            keep = ~held if train else held
            if keep.any():
                yield rows[keep], out[keep]

    def run(self) -> pd.DataFrame:
        """Train every layer not done; write the set (config.yaml, layer_<i>.safetensors),
        fit.csv and fit_curve.csv; the fit.csv table."""
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        for layer in self.layers:
            self.fit_layer(self.sites[layer])
        return self.write()

    def fit_layer(self, sites: LayerSites) -> dict:
        from probe.read.runs import open_run

        o, path = self.options, self.checkpoints / f"layer_{sites.layer}.pt"
        state = torch.load(path, weights_only=False) if path.is_file() else None
        if state is not None and state["done"]:
            return state
        started = time.perf_counter()
        with open_run(self.run_path) as run:
            stream = self.stream(sites, run)
            d_in = stream.sources[0].shape[-1]
            d_out = stream.sources[0].paired_shape[-1]
            model = TrainingTranscoder(d_in, d_out, o, seed=o.seed + sites.layer)
            opt = torch.optim.Adam(model.parameters(), lr=o.lr)
            total = o.steps or max(1, math.ceil(o.epochs * len(stream)))
            step, epoch, curve, seconds, rows = 0, 0, [], 0.0, 0
            if state is not None:
                model.load_state_dict(state["model"])
                opt.load_state_dict(state["optimizer"])
                step, epoch, curve = state["step"], state["epoch"], state["curve"]
                seconds, rows = state["seconds"], state["rows"]
                stream.set_epoch(epoch)
                stream.load_state_dict(state["stream"])

            def save(done: bool, **extra) -> dict:
                snapshot = {"options": asdict(o), "layer": sites.layer, "step": step,
                            "epoch": epoch, "curve": curve, "rows": rows, "done": done,
                            "model": model.state_dict(), "optimizer": opt.state_dict(),
                            "stream": stream.state_dict(), "d_in": d_in, "d_out": d_out,
                            "seconds": seconds + time.perf_counter() - started, **extra}  # fmt: skip
                _save_atomic(snapshot, path)
                return snapshot

            while step < total:
                stream.set_epoch(epoch)
                for x, y in self.pairs(stream, train=True):
                    if step == 0 and state is None:
                        model.start(x, y)
                    parts = train_step(model, opt, x, y)
                    step, rows = step + 1, rows + len(x)
                    curve.append((step, parts["fvu"], parts["penalty"]))
                    if step % o.checkpoint_every == 0 or step == total:
                        save(False)
                    if step == total:
                        break
                else:
                    epoch += 1
                    if step == 0:
                        raise DataError(
                            f"no training rows of {sites.inputs}: --test-fraction "
                            f"{o.test_fraction} holds out every sample"
                        )
                    continue
                break
            t = model.transcoder(sites.layer)
            metrics = evaluate(t, self.pairs(self.stream(sites, run, shuffle=False), train=False))
        write_transcoder(t, self.out / f"layer_{sites.layer}.safetensors")
        state = save(True, metrics=metrics)
        log.info("layer %d: %d steps, fvu %.4f, l0 %.1f, dead %.3f", sites.layer, step,
                 metrics["fvu"], metrics["l0"], metrics["dead"])  # fmt: skip
        return state

    def write(self) -> pd.DataFrame:
        """fit.csv, fit_curve.csv and config.yaml over every finished layer in `out`."""
        from probe.models.transcoder_files import read_transcoder

        states = [torch.load(p, weights_only=False) for p in self.checkpoints.glob("layer_*.pt")]
        states = sorted((s for s in states if s["done"]), key=lambda s: s["layer"])
        o = self.options
        rows, curve = [], []
        for s in states:
            m = s["metrics"]
            rows.append({"layer": s["layer"], "reads": o.reads, "activation": o.activation,
                         "width": s["model"]["W_enc"].shape[1],
                         "k": o.k if o.activation == "topk" else None, "skip": o.skip,
                         "steps": s["step"], "rows": s["rows"],
                         "held_out_rows": m["held_out_rows"], "fvu": m["fvu"], "l0": m["l0"],
                         "dead": m["dead"], "seconds": round(s["seconds"], 3)})  # fmt: skip
            curve += [{"layer": s["layer"], "step": st, "fvu": f, "penalty": p}
                      for st, f, p in s["curve"]]  # fmt: skip
        table = pd.DataFrame(rows, columns=FIT_COLUMNS)
        table.to_csv(self.out / "fit.csv", index=False)
        pd.DataFrame(curve, columns=["layer", "step", "fvu", "penalty"]).to_csv(
            self.out / "fit_curve.csv", index=False
        )
        transcoders = {
            s["layer"]: read_transcoder(self.out / f"layer_{s['layer']}.safetensors", s["layer"])
            for s in states
        }
        short = self.model_name.rstrip("/").split("/")[-1] or "model"
        write_set_config(self.out, transcoders, o.reads, self.model_name or None,
                         {layer: f"{short}-{o.activation}-{layer}" for layer in transcoders})  # fmt: skip
        return table
