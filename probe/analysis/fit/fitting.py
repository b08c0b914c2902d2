"""A fit of one run's transcoders: every layer trained from the run's paired token rows,
checkpointed and resumable, written as circuit-tracer's transcoder set with fit.csv.

The run stores, per block, the MLP module's `input` (the normed residual: `mlp_in`) or the input
of the norm before it (`resid_mid`), and the MLP's `output`, as token rows (e.g. `probes=mlp_io`).
Rows of the same token are paired by `run.dataset(..., pair=...)` and streamed shuffled, with
bounded memory.

Each layer checkpoints its parameters, optimizer and stream position every `checkpoint_every`
steps in `out/checkpoints/`; a resumed fit gives the uninterrupted one's weights. Held-out rows
(whole samples: `held_out`) never train; fit.csv reports on them. Rows of position 0 and of
special tokens (`fit_sites.left_out`) neither train nor count in fit.csv's row measures unless
`keep_special`; fit.csv's `left_out_rows` says how many there were.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from probe.analysis.fit.fit_sites import LayerSites, find_sites, held_out, left_out, left_out_rows
from probe.analysis.fit.losses import held_out_samples, loss_measures, run_model, sample_tokens
from probe.analysis.fit.measures import evaluate
from probe.analysis.fit.options import FitOptions
from probe.analysis.fit.trainer_base import adam, check_loss_form, train_step
from probe.analysis.fit.transcoder_splice import splice_points
from probe.analysis.fit.transcoder_trainer import LOSS_FORM, TrainingTranscoder
from probe.analysis.fit.workers import FitSpec, default_workers, fit_in_workers
from probe.errors import ConfigError, DataError
from probe.models.transcoder_files import write_set_config, write_transcoder

log = logging.getLogger("probe.fit")
FIT_COLUMNS = ["layer", "reads", "activation", "width", "k", "skip", "steps", "rows",
               "held_out_rows", "left_out_rows", "fvu", "l0", "dead", "ce_clean", "ce_spliced",
               "ce_zero", "ce_recovered", "kl", "seconds"]  # fmt: skip
# `python -m probe.fit --evaluate`'s table: fit.csv's less what only a training has
EVALUATE_COLUMNS = [c for c in FIT_COLUMNS if c not in ("steps", "rows", "seconds")]
HELD_OUT = "held_out.csv"  # the samples fit.csv's measures are over (sample, tokens)
CHECKPOINTS = "checkpoints"
PROGRESS_LINES = 10  # a layer's progress lines while it trains


def _progress(layer: int, step: int, total: int, rows: int, curve: list) -> None:
    """A log line of a layer's training: its step, rows, and the batch FVU and penalty averaged
    over the steps since the line before."""
    recent = curve[-max(1, total // PROGRESS_LINES) :]
    fvu, penalty = (sum(c[i] for c in recent) / len(recent) for i in (1, 2))
    log.info("layer %d: step %d/%d, %s rows, train fvu %.4f, penalty %.4g", layer, step, total,
             f"{rows:,}", fvu, penalty)  # fmt: skip


def _save_atomic(obj, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _stream_state(stream) -> dict:
    """The stream's state for a checkpoint, its buffer's held rows (as many as the buffer holds)
    as one int64 tensor: torch.save writes it as a block, where a list of [source, row] lists
    pickles object by object (most of a checkpoint's cost, and garbage for the collector to
    scan). `RowStream.load_state_dict` reads either."""
    state = stream.state_dict(arrays=True)
    if "held" in state:
        state["held"] = torch.from_numpy(state["held"])
    return state


class Fit:
    """A fit of one run's transcoders into `out`: `run()` trains every layer not done."""

    def __init__(self, run_path, out=None, options: FitOptions | None = None,
                 layers: list[int] | None = None, resume: bool = False, mlp: str | None = None,
                 norm: str | None = None, losses: bool = True):  # fmt: skip
        from probe.read.runs import open_run
        from probe.store.fileformat import layer_path

        self.options = options or FitOptions()
        self.options.check()
        self.run_path = Path(run_path)
        self.mlp, self.norm = mlp, norm
        self.out = Path(out) if out is not None else self.run_path / "transcoders"
        with open_run(self.run_path) as run:
            self.sites = find_sites(run.keys, self.options.reads, mlp, norm)
            self.num_samples = run.num_samples
            self.model_name = str(run.config.get("model", {}).get("name", "") or "")
            self.special, self.left_out_rows = left_out_rows(run, self.options.keep_special)
            d_in = {layer: run.file[layer_path(*s.inputs)].shape[-1]
                    for layer, s in self.sites.items()}  # fmt: skip
            self.losses = losses
            # the run's model, built now (a fit must not fail on it once trained) and kept for
            # the loss measures (building it again costs its load)
            self._model = run_model(run) if losses else None
        blocks = sorted(self.sites)
        if layers:
            missing = sorted(set(layers) - set(blocks))
            if missing:
                raise ConfigError(
                    f"--layers {missing}: the run holds {self.options.reads} pairs of blocks "
                    f"{blocks} only"
                )
        self.layers = sorted(set(layers)) if layers else blocks
        for layer in self.layers:  # k against each layer's width, before workers start
            self.options.feature_width(d_in[layer])
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
            state = torch.load(path, weights_only=False)
            check_loss_form(state, LOSS_FORM, path)
            stored = state["options"]
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
        # each sample's side drawn once, not per batch (held_out draws a number per sample)
        held_sample = torch.zeros(0, dtype=torch.bool)
        for rows, _, index, out in stream:
            samples = index["sample"].long()
            if len(samples) and int(samples.max()) >= len(held_sample):
                n = max(self.num_samples, int(samples.max()) + 1)
                held_sample = torch.from_numpy(
                    held_out(np.arange(n), self.num_samples, o.test_fraction, o.seed)
                )
            held = held_sample[samples]
            keep = ~held if train else held
            if not o.keep_special:
                keep &= ~torch.from_numpy(
                    left_out(index["position"].numpy(), index["token"].numpy(), self.special)
                )
            if keep.any():
                yield rows[keep], out[keep]

    def run(self, workers: int | None = None) -> pd.DataFrame:
        """Train every layer not done, in `workers` processes (None: workers.default_workers);
        write the set (config.yaml, layer_<i>.safetensors), fit.csv and fit_curve.csv; the
        fit.csv table."""
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        todo = [layer for layer in self.layers if not self._done(layer)]
        workers = default_workers(len(todo)) if workers is None else min(workers, len(todo))
        if workers > 1:
            spec = FitSpec(
                type(self), str(self.run_path), str(self.out), self.options, self.mlp, self.norm
            )
            fit_in_workers(spec, todo, workers)
        else:
            for layer in todo:
                self.fit_layer(self.sites[layer])
        return self.write()

    def _done(self, layer: int) -> bool:
        path = self.checkpoints / f"layer_{layer}.pt"
        return path.is_file() and torch.load(path, weights_only=False)["done"]

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
            total = o.steps or max(1, math.ceil(o.epochs * len(stream)))
            model = TrainingTranscoder(d_in, d_out, o, seed=o.seed + sites.layer,
                                       total_steps=total)  # fmt: skip
            opt = adam(model.parameters(), o.learning_rate(model.width))
            step, epoch, curve, seconds, rows = 0, 0, [], 0.0, 0
            if state is not None:
                model.load_state_dict(state["model"])
                opt.load_state_dict(state["optimizer"])
                step, epoch, curve = state["step"], state["epoch"], state["curve"]
                seconds, rows = state["seconds"], state["rows"]
                stream.set_epoch(epoch)
                stream.load_state_dict(state["stream"])

            def save(done: bool, **extra) -> dict:
                snapshot = {"options": asdict(o), "loss_form": LOSS_FORM, "layer": sites.layer,
                            "step": step, "epoch": epoch, "curve": curve, "rows": rows, "done": done,
                            "model": model.state_dict(), "optimizer": opt.state_dict(),
                            "stream": _stream_state(stream), "d_in": d_in, "d_out": d_out,
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
                    if step % max(1, total // PROGRESS_LINES) == 0 and step < total:
                        _progress(sites.layer, step, total, rows, curve)
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
        state = save(True, metrics=metrics, left_out_rows=self.left_out_rows)
        log.info("layer %d: %d steps, fvu %.4f, l0 %.1f, dead %.3f", sites.layer, step,
                 metrics["fvu"], metrics["l0"], metrics["dead"])  # fmt: skip
        return state

    def write(self) -> pd.DataFrame:
        """fit.csv (with the loss measures: layers spliced alone and `all` at once),
        held_out.csv, fit_curve.csv and config.yaml over every finished layer in `out`."""
        from probe.models.transcoder_files import read_transcoder

        states = [torch.load(p, weights_only=False) for p in self.checkpoints.glob("layer_*.pt")]
        states = sorted((s for s in states if s["done"]), key=lambda s: s["layer"])
        o = self.options
        transcoders = {
            s["layer"]: read_transcoder(self.out / f"layer_{s['layer']}.safetensors", s["layer"])
            for s in states
        }
        losses = self.loss_measures(transcoders)
        rows, curve = [], []
        for s in states:
            m = s["metrics"]
            rows.append({"layer": s["layer"], "reads": o.reads, "activation": o.activation,
                         "width": s["model"]["W_enc"].shape[1],
                         "k": o.k if o.activation == "topk" else None, "skip": o.skip,
                         "steps": s["step"], "rows": s["rows"],
                         "held_out_rows": m["held_out_rows"],
                         "left_out_rows": s.get("left_out_rows", 0), "fvu": m["fvu"], "l0": m["l0"],
                         "dead": m["dead"], **losses.get(s["layer"], {}),
                         "seconds": round(s["seconds"], 3)})  # fmt: skip
            curve += [{"layer": s["layer"], "step": st, "fvu": f, "penalty": p}
                      for st, f, p in s["curve"]]  # fmt: skip
        if "all" in losses:
            rows.append({"layer": "all", "reads": o.reads, "activation": o.activation,
                         "k": o.k if o.activation == "topk" else None, "skip": o.skip,
                         **losses["all"]})  # fmt: skip
        table = pd.DataFrame(rows, columns=FIT_COLUMNS)
        table.to_csv(self.out / "fit.csv", index=False)
        pd.DataFrame(curve, columns=["layer", "step", "fvu", "penalty"]).to_csv(
            self.out / "fit_curve.csv", index=False
        )
        short = self.model_name.rstrip("/").split("/")[-1] or "model"
        write_set_config(self.out, transcoders, o.reads, self.model_name or None,
                         {layer: f"{short}-{o.activation}-{layer}" for layer in transcoders})  # fmt: skip
        return table

    def loss_measures(self, transcoders: dict) -> dict:
        """The loss measures (probe.analysis.fit.losses) of `transcoders` over the held-out
        samples, each layer alone and `all`; writes held_out.csv (the samples, always)."""
        from probe.read.runs import open_run

        o = self.options
        with open_run(self.run_path) as run:
            samples = held_out_samples(run, o.test_fraction, o.seed)
            samples.to_csv(self.out / HELD_OUT, index=False)
            if not self.losses or not transcoders:
                return {}
            model = self._model if self._model is not None else run_model(run)
            points = splice_points(model, sorted(transcoders), o.reads, self.sites)
            sequences = sample_tokens(run, samples["sample"].to_numpy())
            return loss_measures(model, sequences, points, transcoders)
