"""`python -m probe.fit --evaluate SET RUN`: fit.csv's measures of a transcoder set someone else
trained (a circuit-tracer YAML or folder: probe.models.transcoder_files.load_transcoders), per-layer
or cross-layer, on a run's samples, so a user compares their fit with a published set on the same
rows. A per-layer set may cover some of the model's blocks only (a fit of `--layers`): each of
its blocks is measured, and the row `all` replaces those blocks at once (logged); a layer the
model does not have is refused by name.

The row measures (held-out FVU, L0, dead: probe.analysis.fit.measures) read the run's captured
rows of what the set reads and the MLPs' outputs (for `mlp_normalized`, the captured norm inputs
normalised by the model's own norms); a run without those captures leaves them empty. The loss
measures (probe.analysis.fit.losses) splice the set into the run's model. The samples are those
a fit with the same `seed` and `test_fraction` holds out, or every sample (`every`).
"""

from __future__ import annotations

import logging
import tempfile
from itertools import chain
from pathlib import Path

import pandas as pd
import torch

from probe.analysis.fit.fit_sites import find_sites
from probe.analysis.fit.losses import (
    BATCH_TOKENS,
    held_out_samples,
    loss_measures,
    run_model,
    sample_tokens,
)
from probe.analysis.fit.measures import evaluate
from probe.analysis.fit.options import FitOptions
from probe.analysis.fit.transcoder_splice import splice_points
from probe.errors import DataError
from probe.models.cross_layer_transcoder import CrossLayerTranscoder
from probe.models.transcoder import Transcoder, TranscoderSet, normalized
from probe.models.transcoder_files import check_transcoders, load_transcoders, model_blocks

log = logging.getLogger("probe.fit")


def evaluate_set(set_path: str | Path, run_path: str | Path, *, every: bool = False,
                 test_fraction: float = 0.1, seed: int = 0, mlp: str | None = None,
                 norm: str | None = None, batch_tokens: int | None = None,
                 keep_special: bool = False,
                 ) -> tuple[pd.DataFrame, pd.DataFrame]:  # fmt: skip
    """(the measures, one row per layer and one `all`, in fit.csv's columns less the
    training's; the samples measured, held_out.csv's rows)."""
    from probe.analysis.fit.fitting import EVALUATE_COLUMNS
    from probe.read.runs import open_run

    tset = load_transcoders(set_path, every_block=False)
    tset.to(dtype=torch.float32)
    clt = tset if isinstance(tset, CrossLayerTranscoder) else None
    per_layer = tset.transcoders if isinstance(tset, TranscoderSet) else {}
    layers = list(range(len(clt))) if clt is not None else sorted(per_layer)
    rows_reads = "resid_mid" if tset.reads == "mlp_normalized" else tset.reads
    options = FitOptions(reads=rows_reads, test_fraction=test_fraction, seed=seed,
                         keep_special=keep_special)  # fmt: skip
    options.check()
    with open_run(run_path) as run:
        model = run_model(run)
        check_transcoders(tset, model, every_block=False)
        depth = model_blocks(model)
        if depth is not None and layers != list(range(depth)):
            log.info(
                "the set covers blocks %s of the model's %d: each is measured, and `all` "
                "replaces those blocks only", layers, depth,
            )  # fmt: skip
        try:
            sites = find_sites(run.keys, rows_reads, mlp, norm)
        except DataError as e:
            log.info("row measures left empty: %s", e)
            sites = {}
        points = splice_points(
            model, layers, tset.reads, sites if set(layers) <= set(sites) else None
        )
        samples = held_out_samples(run, test_fraction, seed, every)
        sequences = sample_tokens(run, samples["sample"].to_numpy())
        which = clt if clt is not None else per_layer
        losses = loss_measures(model, sequences, points, which, batch_tokens or BATCH_TOKENS)
        normalize = (
            {layer: model.get_submodule(points[layer].source) for layer in layers}
            if tset.reads == "mlp_normalized" else {}
        )  # fmt: skip
    kinds: dict[int, Transcoder | CrossLayerTranscoder]
    if clt is not None:
        rows = _cross_layer_rows(clt, run_path, options, sites, every, mlp, norm)
        kinds = {layer: clt for layer in layers}
    else:
        rows = _row_measures(tset, run_path, options, sites, normalize, every, mlp, norm)
        kinds = dict(per_layer)
    table = []
    for layer in layers:
        t = kinds[layer]
        table.append({"layer": layer, "reads": tset.reads, "activation": t.activation,
                      "width": t.d_tc, "k": t.k, "skip": t.W_skip is not None,
                      **rows.get(layer, {}), **losses[layer]})  # fmt: skip
    first = kinds[layers[0]]
    table.append({"layer": "all", "reads": tset.reads, "activation": first.activation,
                  "k": first.k, "skip": first.W_skip is not None, **losses["all"]})  # fmt: skip
    return pd.DataFrame(table, columns=EVALUATE_COLUMNS), samples


def _row_measures(tset, run_path, options: FitOptions, sites: dict, normalize: dict,
                  every: bool, mlp: str | None, norm: str | None) -> dict[int, dict]:  # fmt: skip
    """FVU, L0 and dead of each layer whose rows the run holds, over the rows a fit with
    `options` measures (held out, or every row with `every`; rows of position 0 and special
    tokens left out unless `keep_special`, their count in `left_out_rows`); `normalize`: layer -> the norm
    whose normalisation of the captured rows the set reads (mlp_normalized)."""
    from probe.analysis.fit.fitting import Fit
    from probe.read.runs import open_run

    if not sites:
        return {}
    out = {}
    with tempfile.TemporaryDirectory() as unused:  # (a Fit that only reads rows: writes nothing)
        fit = Fit(run_path, Path(unused) / "fit", options, mlp=mlp, norm=norm, losses=False)
        with open_run(run_path) as run:
            for layer, t in sorted(tset.transcoders.items()):
                if layer not in sites:
                    continue
                pairs = fit.pairs(fit.stream(sites[layer], run, shuffle=False), train=False)
                if every:
                    train = fit.pairs(fit.stream(sites[layer], run, shuffle=False), train=True)
                    pairs = chain(train, pairs)
                if layer in normalize:
                    module = normalize[layer]
                    pairs = ((normalized(module, x.double()), y) for x, y in pairs)
                out[layer] = {**evaluate(t, pairs), "left_out_rows": fit.left_out_rows}
    return out


def _cross_layer_rows(clt: CrossLayerTranscoder, run_path, options: FitOptions, sites: dict,
                      every: bool, mlp: str | None, norm: str | None) -> dict[int, dict]:  # fmt: skip
    """A CLT's FVU per output layer, L0 and dead per layer (probe.analysis.fit.clt.evaluate)
    over the rows a CLT fit with `options` measures, where the run holds every block's rows of
    what it reads (mlp_in or resid_mid; a CLT reading mlp_normalized: none, logged)."""
    from probe.analysis.fit.clt import CltFit, evaluate
    from probe.read.runs import open_run

    if clt.reads == "mlp_normalized" or set(range(len(clt))) - set(sites):
        log.info("row measures left empty: the run holds no rows of every block's %s", clt.reads)
        return {}
    with tempfile.TemporaryDirectory() as unused:  # (a CltFit that only reads rows)
        fit = CltFit(run_path, Path(unused) / "clt", options, mlp, norm, losses=False)
        with open_run(run_path) as run:
            batches = fit.batches(run, False, 0, shuffle=False)
            if every:
                batches = chain(fit.batches(run, True, 0, shuffle=False), batches)
            measured = evaluate(clt, batches)
    return {layer: {**m, "left_out_rows": fit.left_out_rows} for layer, m in enumerate(measured)}
