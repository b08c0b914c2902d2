"""The forward passes a run with edits makes before its edited one, batch by batch: the run's own
input unedited (the target: effects, metrics, `source: clean` patches), and for `source: pair`
patches the other half of a pairs batch (the source). The sites a patch reads are recorded in
those passes, on the model's device.

With `dataset=pairs` the run's own input is the corrupt half when denoising (clean values are
patched in) and the clean half when noising.
"""

from __future__ import annotations

import inspect
import logging
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import cast

import numpy as np
import pandas as pd
import torch
from torch.utils.data import Subset

from probe.data.batches import Batch
from probe.errors import ConfigError
from probe.hooks import device as devices
from probe.hooks.capture import Capture
from probe.hooks.forward import answer, call, first_output, output_rows, to_device
from probe.hooks.module_select import Selection
from probe.hooks.step_context import StepContext
from probe.intervene.atp import agreement, linearised
from probe.intervene.effects import BATCH_ROWS, Effects
from probe.intervene.grid import Grid, heatmap, patching_table
from probe.intervene.metrics import at_position, check_metrics, per_sample, summary, value
from probe.intervene.patch_steer import SOURCES, Patch, Recorded
from probe.layout import TokenBatch
from probe.plan import InterventionSpec
from probe.store.fileformat import read_progress
from probe.store.runfile import open_probe_file

log = logging.getLogger("probe")


def split_pair(batch: Batch, direction: str) -> tuple[Batch, dict[str, torch.Tensor] | None]:
    """(the batch with the run's own input, the source half's inputs) of a pairs batch; other
    batches as they are, with no source."""
    if "corrupt_ids" not in batch.side:
        return batch, None
    clean = batch.inputs
    if not isinstance(clean, dict):  # (the loaders take corrupt_ids out of a dict's inputs)
        raise TypeError(f"a pairs batch's inputs are a dict of token ids, not {type(clean)}")
    corrupt = {**clean, "input_ids": batch.side["corrupt_ids"]}
    own, other = (corrupt, clean) if direction == "denoise" else (clean, corrupt)
    return replace(batch, inputs=own), other


def direction_of(spec: InterventionSpec, is_pairs: bool) -> str:
    """The direction of the run's patches and grid (`spec.direction`), where a patch from the
    pair has a dataset of pairs to take it from."""
    patches = [e for e in spec.edits.values() if e.op == "patch"]
    grid = spec.grid
    if (
        any(e.source == "pair" for e in patches) or (grid and grid.source == "pair")
    ) and not is_pairs:
        raise ConfigError(
            "intervene: op=patch with source=pair needs dataset=pairs (clean and corrupt halves); "
            "use source=clean or an earlier run's directory"
        )
    return spec.direction


@dataclass
class Interventions:
    """Per batch: the passes around the edited forward and what they measure. A context manager
    over the hooks of its recorders (one Capture per source) and of its grid."""

    effects: Effects | None
    metrics: list[str]
    position: int | None
    direction: str
    # by source (pair, clean): its pass's capture, and the values its patches read (filled by it)
    recorders: dict[str, tuple[Capture, list[Recorded]]]
    grid: Grid | None = None
    labels: list[int] | None = None  # the first sample's ids (the heatmap's positions)
    tokenizer: str | None = None  # a local tokenizer to show them as tokens
    held: list = field(default_factory=list)  # (capture, its lent host buffers) of this batch
    recorded: dict = field(default_factory=dict)  # this batch's values of the sites, by source
    batch_rows: dict = field(default_factory=dict)  # this batch's one-row datasets (effects)
    _entered: ExitStack | None = field(default=None, init=False, repr=False)  # while inside

    @classmethod
    def of(cls, model, edits, spec: InterventionSpec, dataset, is_pairs: bool, tokenizer=None):
        """The passes of a run of `model` over `dataset` (of pairs or not) with `edits` (bound to
        the model) and the intervene group `spec` of its plan; None when it neither edits nor
        patches a grid."""
        if not edits and spec.grid is None:
            return None
        while isinstance(dataset, Subset):  # (a torchrun shard, a resumed run)
            dataset = dataset.dataset
        metrics = check_metrics(spec.metrics, side_keys(dataset), model)
        ids = getattr(dataset, "input_ids", None)
        length = ids.shape[1] if ids is not None else None
        grid = Grid(model, spec.grid, length) if spec.grid is not None else None
        sites: dict[str, dict] = {}
        patches: dict[str, list[Recorded]] = {}
        for e in edits:
            fn = e.fn
            if isinstance(fn, Patch) and fn.recorded is not None:  # (its source is in SOURCES)
                sites.setdefault(fn.source, {}).setdefault(e.module_name, (e.module, set()))
                sites[fn.source][e.module_name][1].add(e.site)
                patches.setdefault(fn.source, []).append(fn.recorded)
        if grid is not None and grid.source in SOURCES:
            for name, module in grid.modules:
                sites.setdefault(grid.source, {}).setdefault(name, (module, set()))[1].add(
                    grid.site
                )
        recorders = {
            kind: (Capture([Selection(n, m, tuple(sorted(s)), "none", "float32", "patch")
                            for n, (m, s) in found.items()]), patches.get(kind, []))
            for kind, found in sites.items()
        }  # fmt: skip
        effects = None if metrics or grid else Effects()
        direction = direction_of(spec, is_pairs)
        found = cls(effects, metrics, spec.position, direction, recorders, grid)
        found.tokenizer = tokenizer
        return found

    def __enter__(self) -> Interventions:
        """The recorders' hooks, then the grid's, all or none (a failure leaves again what was
        entered); on any exit every one is removed, the grid's first."""
        with ExitStack() as entering:
            for capture, _ in self.recorders.values():
                entering.enter_context(capture)
            if self.grid is not None:
                entering.enter_context(self.grid)
            self._entered = entering.pop_all()
        return self

    def __exit__(self, *exc) -> None:
        entered, self._entered = self._entered, None
        if entered is not None:
            entered.__exit__(*exc)

    def before(self, ctx: StepContext) -> dict:
        """The target (own input, unedited; a grid's target is the run's own forward) and the
        source passes of the batch `ctx` holds, recording the sites patches and the grid read."""
        model, batch, inputs, source, tokens = (
            ctx.model,
            ctx.batch,
            ctx.inputs,
            ctx.source,
            ctx.tokens,
        )
        device = ctx.device
        run = (model, batch, tokens, device, ctx.precision)
        out = {}
        sites = self.grid.attention if self.grid is not None else None
        self.grid_tokens(tokens)
        if (
            self.grid is None
            or "clean" in self.recorders
            or (sites and self.grid.source == "clean")
        ):
            with _recording(sites, self.grid is not None and self.grid.source == "clean"):
                out["clean"] = self._pass(*run, "clean", inputs)
        wanted = "pair" in self.recorders or (self.metrics and self.grid is None) or sites
        if source is not None and wanted:
            with _recording(sites, self.grid is not None and self.grid.source == "pair"):
                out["pair"] = self._pass(*run, "pair", to_device(model, source, device, True))
        if self.grid is not None:
            self.grid.values = self.recorded.get(self.grid.source, {})
        return out

    def grid_tokens(self, tokens) -> None:
        if self.grid is not None:
            self.grid.tokens = tokens

    def _pass(self, model, batch: Batch, tokens, device, precision, kind: str, inputs):
        capture, patch_values = self.recorders.get(kind, (None, []))
        captured = capture.begin(batch.size, batch.start, tokens) if capture else None
        try:
            with torch.inference_mode(), devices.autocast(device, precision):
                output = call(model, inputs)
        finally:
            if capture:
                capture.end()
        if captured is not None:
            self.held.append((capture, captured.pooled))
            self.recorded[kind] = captured.values
            for values in patch_values:
                values.values = captured.values
        return output

    def after(self, passes: dict, ctx: StepContext) -> dict:
        """Per-sample rows for the file, from the passes and the edited output `ctx` holds:
        single edits' target outputs (/model/output_clean) and metrics (/effects/<metric>:
        target, source, edited), or each grid cell's metrics (/patching/<metric>: a column per
        cell)."""
        output, batch, inputs, tokens = ctx.output, ctx.batch, ctx.inputs, ctx.tokens
        model_output, run = ctx.model_output, (ctx.model, ctx.device, ctx.precision, ctx.capture)
        if self.grid is not None:
            if batch.start == 0 and isinstance(batch.inputs, dict):
                self.labels = batch.inputs["input_ids"][0].tolist()
            return self._cells(self.grid, passes, output, batch, inputs, tokens, *run)
        target = passes["clean"]
        rows = output_rows(target, model_output, batch.size, tokens, "model/output_clean")
        if self.effects is not None:
            this = Effects()
            this.update(answer(target, tokens), answer(output, tokens), batch.targets)
            self.effects = Effects.from_rows(np.stack([self.effects.vector(), this.vector()]))
            self.batch_rows = {BATCH_ROWS: this.vector()[None]}
        if self.metrics:
            target_at, source_at, edited_at = (
                at(x, tokens, self.position) for x in (target, passes.get("pair"), output)
            )
            values = per_sample(self.metrics, target_at, source_at, edited_at, batch.side)
            rows.update({f"effects/{k}": v for k, v in values.items()})
        return rows

    def _cells(
        self, grid: Grid, passes, output, batch, inputs, tokens, model, device, precision, capture
    ):
        """Each cell of `grid` (the run's): its metrics per sample, read from the logits at the
        metrics' position (only the last position's are computed where that is all they read:
        HF's logits_to_keep)."""
        target = at(output, tokens, self.position)
        source = at(passes.get(grid.source), tokens, self.position)
        last_only = self._last_only(model, inputs, tokens)
        cell_inputs = {**inputs, "logits_to_keep": 1} if last_only else inputs

        def read(out, k: int) -> list:
            chunks = first_output(out).chunk(k)
            if last_only:
                return [c[:, -1].double() for c in chunks]
            return [at_position(c, tokens, self.position) for c in chunks]

        edited: list = []  # each cell's read (run_cells)
        if "exact" in grid.methods:
            with devices.autocast(device, precision):
                edited = grid.run_cells(
                    model, capture, cell_inputs, tokens, batch.size, batch.start, read
                )
        rows = {}
        for name in self.metrics:
            base = per_sample([name], target, source, target, batch.side)[name]
            rows[f"patching/{name}_target"], rows[f"patching/{name}_source"] = (
                base[:, 0],
                base[:, 1],
            )
            if edited:
                cells = [value(name, e, target, batch.side) for e in edited]
                rows[f"patching/{name}"] = torch.stack(cells, 1).cpu()
        if {"atp", "atp_star"} & set(grid.methods):
            args = (model, inputs, tokens, batch.side, self.metrics, self.position, device)
            rows.update(linearised(grid, *args, precision))
        return rows

    def _last_only(self, model, inputs, tokens) -> bool:
        """Whether the metrics read only the last position of every sample, and the model can
        compute only that position's logits."""
        if not isinstance(inputs, dict) or tokens is None or tokens.mask is not None:
            return False
        if self.position not in (None, -1):
            return False
        try:
            return "logits_to_keep" in inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            return False

    def attrs(self) -> dict:
        """File attributes that say what /patching's columns are."""
        if self.grid is None:
            return {}
        return {"patching_cells": self.grid.describe(), "patching_site": self.grid.site}

    def report(self, h5_path, run_dir) -> None:
        """effects.csv, or for a grid patching.csv and its heatmap, from every sample the file
        holds (a resumed run's too)."""
        if self.grid is not None:
            table = patching_table(h5_path, self.grid, self.metrics)
            table.to_csv(run_dir / "patching.csv", index=False)
            agreed = agreement(table)
            if agreed is not None and len(agreed):
                agreed.to_csv(run_dir / "patching_agreement.csv", index=False)
                for r in agreed.itertuples():
                    log.info(
                        "patching: %s %s vs exact on %s: Spearman %.3f, top-10 recall %.2f",
                        r.method, r.metric, r.layer_type, r.spearman, r.top10_recall,
                    )  # fmt: skip
            labels = token_labels(self.labels, self.tokenizer) if self.labels else None
            heatmap(table, run_dir / "patching.png", self.grid, labels)
            return
        table = effects_table(self, h5_path)
        table.to_csv(run_dir / "effects.csv", index=False)
        log.info("effects: %s (effects.csv)", one_line(table))

    def release(self) -> None:
        """Give the recorded values' host buffers back once the edited pass is done."""
        for _, patch_values in self.recorders.values():
            for values in patch_values:
                values.values = {}
        self.recorded.clear()
        while self.held:
            capture, pooled = self.held.pop()
            capture.pool.give(pooled)


class _recording:
    """Query or key sites in record mode for one source pass (nothing without them)."""

    def __init__(self, sites, on: bool):
        self.sites = sites if on else None

    def __enter__(self):
        if self.sites is not None:
            self.sites.mode = "record"

    def __exit__(self, *exc):
        if self.sites is not None:
            self.sites.mode = None


def at(output, tokens: TokenBatch | None, position: int | None):
    return None if output is None else at_position(first_output(output), tokens, position)


def side_keys(dataset) -> set[str]:
    """Which answer tokens a dataset gives (a pairs dataset's answer and wrong)."""
    return {k for k in ("answer", "wrong") if getattr(dataset, k, None) is not None}


def effects_table(interventions: Interventions, h5_path) -> pd.DataFrame:
    """effects.csv: the metrics over every sample the file holds (so a resumed run counts the
    samples before its resumption), else the summary of the output's change."""
    with open_probe_file(h5_path) as f:
        progress = read_progress(f)
        if not interventions.metrics:
            if BATCH_ROWS in f:  # every batch's, those before a resumption included
                return Effects.from_rows(f[BATCH_ROWS][: progress.batches]).table()
            if interventions.effects is None:  # (no metrics and no grid: effects are counted)
                raise RuntimeError("an effects table without metrics or counted effects")
            return interventions.effects.table()
        valid = progress.samples
        rows = {m: f[f"effects/{m}"][:valid] for m in interventions.metrics if f"effects/{m}" in f}
    return summary(rows)


def one_line(table: pd.DataFrame) -> str:
    """The effects table in one line: each column's value, or per metric its normalized value."""
    if "metric" in table:
        return "; ".join(
            f"{r.metric} {r.target:.4g} -> {r.edited:.4g} (normalized {r.normalized:.3g})"
            for r in table.itertuples()
        )
    row = table.iloc[0]
    return ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items())


def token_labels(ids: list[int], tokenizer: str | None) -> list[str]:
    """The tokens of `ids` by a tokenizer in a local folder, else the ids themselves."""
    if tokenizer and Path(tokenizer).is_dir():
        try:
            from transformers import AutoTokenizer

            tokens = AutoTokenizer.from_pretrained(tokenizer).convert_ids_to_tokens(ids)
            # (a list of ids gives a list; the stub's return type is the union for an id or ids)
            return cast(list[str], tokens)
        except Exception:  # noqa: BLE001 - the ids serve as well
            pass
    return [str(i) for i in ids]
