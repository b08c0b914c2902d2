"""Layers of a fit trained side by side in worker processes, each on its own share of the cores.

A layer's training reads only its own rows and writes only its own checkpoint, so layers are
independent: each worker rebuilds the fit from what names it (run, out, options, modules) and
trains one layer at a time; the parent writes the set once all are done. An error in a worker
comes back as itself (a ProbeError keeps its message and exit code); Ctrl-C stops the workers,
and the checkpoints they wrote (atomically) let `--resume` continue.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

import torch

from probe.analysis.fit.options import FitOptions
from probe.analysis.fit.startup import begin, end

log = logging.getLogger("probe.fit")


def default_workers(layers: int, cores: int | None = None) -> int:
    """Worker processes for `layers` layers: one per 4 cores (a layer's matrix products keep about
    4 threads busy), at most one per layer, at least 1."""
    cores = cores or os.cpu_count() or 1
    return max(1, min(layers, cores // 4))


@dataclass(frozen=True)
class FitSpec:
    """What a worker needs to rebuild the fit: its class (probe.analysis.fit.fitting.Fit,
    pickled by name) and its arguments."""

    fit: type
    run: str
    out: str
    options: FitOptions
    mlp: str | None
    norm: str | None


def _start(threads: int, level: int) -> None:
    begin()  # (the collector back on once the worker's fit is built: _fit_layer)
    torch.set_num_threads(threads)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=level, format="probe.fit: %(message)s")


def _fit_layer(spec: FitSpec, layer: int) -> int:
    fit = spec.fit(
        spec.run, spec.out, spec.options, [layer], True, spec.mlp, spec.norm, losses=False
    )  # (the parent measures the losses)
    end()
    fit.fit_layer(fit.sites[layer])
    return layer


def fit_in_workers(spec: FitSpec, layers: list[int], workers: int) -> None:
    """Train `layers` in `workers` spawned processes, cores shared evenly among them."""
    threads = max(1, (os.cpu_count() or 1) // workers)
    log.info("%d layers in %d worker processes of %d threads", len(layers), workers, threads)
    context = multiprocessing.get_context("spawn")  # (no fork of a process holding threads)
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_start,
                               initargs=(threads, log.getEffectiveLevel()))  # fmt: skip
    try:
        futures = [pool.submit(_fit_layer, spec, layer) for layer in layers]
        for done in as_completed(futures):
            done.result()  # (a worker's error raised here)
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
