"""intervene=patch_grid: a patching grid over layers, token positions and attention heads.

Per batch the source runs once (its values of every grid site kept on the device), the target is
the run's own forward, and each cell is one patched forward (or `stack` cells in one forward of
the batch repeated, which pays on a GPU; on a CPU one cell per forward is fastest). Per-sample
metric values go to /patching in probe.h5, one column per cell; `patching.csv` and the heatmap
are made from the file at the end, so a resumed grid counts every sample.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from probe.config import ATTENTION_SITES, GRID_AXES, PATCH_SOURCES
from probe.errors import ConfigError
from probe.hooks.forward import call
from probe.hooks.hookset import HookSet
from probe.hooks.module_select import match_modules, warn_nested
from probe.intervene.attention import AttentionSites
from probe.intervene.patch_steer import Region, read_rows, run_file
from probe.layout import TokenBatch, class_axis
from probe.plan import GridSpec
from probe.store.fileformat import read_progress
from probe.store.runfile import open_probe_file

log = logging.getLogger("probe")

AXES = GRID_AXES


@dataclass(frozen=True)
class Cell:
    layer: str
    position: int | None = None
    head: int | None = None


class Grid:
    """The cells of a grid spec (a run plan's: the parse checked its values) on a model, and the
    hooks that patch the cells of a forward (a context manager: hung on entry, removed on any
    exit)."""

    def __init__(self, model, spec: GridSpec, length: int | None, label: str = "intervene.grid"):
        over = list(spec.over)
        self.label, self.site, self.over = label, spec.site, over
        self.source, self.direction = str(spec.source), spec.direction
        on_gpu = any(p.is_cuda for p in model.parameters())
        self.stack = spec.stack or (8 if on_gpu else 1)
        self.file = None if self.source in PATCH_SOURCES else run_file(self.source, label)
        self.modules = match_modules(model, label, spec.where)
        warn_nested(label, list(spec.where.layers), [n for n, _ in self.modules])
        config = getattr(model, "config", None)
        self.n_heads = getattr(config, "num_attention_heads", None) or getattr(
            config, "n_head", None
        )
        if spec.site == "key":  # (grouped-query attention shares each key head)
            self.n_heads = getattr(config, "num_key_value_heads", None) or self.n_heads
        self.attention = AttentionSites(self, model) if spec.site in ATTENTION_SITES else None
        positions = self._axis(spec.positions, "positions", length, "position")
        heads = self._axis(spec.heads, "heads", self.n_heads, "head") if "head" in over else []
        self.cells = [
            Cell(name, p, h)
            for name, _ in self.modules
            for p, h in itertools.product(
                positions if "position" in over else [None], heads if "head" in over else [None]
            )
        ]
        if not self.cells:
            raise ConfigError(f"{label} selects no cell (positions {positions}, heads {heads})")
        self.classes = {
            n: class_axis(tuple(c.__name__ for c in type(m).__mro__)) for n, m in self.modules
        }
        self.types = {n: type(m).__name__ for n, m in self.modules}
        self.methods = [spec.method] if isinstance(spec.method, str) else list(spec.method)
        self.active: list[Cell] = []  # the cells of the current forward, one per repeat
        self.values: dict[tuple[str, str], torch.Tensor] = {}  # the source's, this batch
        self.tokens: TokenBatch | None = None
        self.start = 0
        self.hooks = HookSet(label)

    def _axis(self, given, key: str, size: int | None, what: str) -> list[int]:
        if given == "all":
            if size is None:
                raise ConfigError(
                    f"{self.label}.{key}=all needs the number of {what}s, which this "
                    f"model or dataset does not tell; list them: {self.label}.{key}=[0,1]"
                )
            return list(range(size))
        picked = list(given)
        if size is not None:
            bad = [i for i in picked if not -size <= i < size]
            if bad:
                raise ConfigError(f"{self.label}.{key}: {bad} are out of range for {size} {what}s")
        return picked

    def describe(self) -> str:
        """The cells as JSON, for the file: column j of /patching/<metric> is cell j."""
        return json.dumps([asdict(c) for c in self.cells])

    def __enter__(self) -> Grid:
        """Query and key sites patch inside the attention function (no hook); other sites hang
        one hook per layer, all or none, removed on any exit."""
        if self.attention is not None:
            self.attention.__enter__()
        else:
            self.hooks.enter(self._hang)
        return self

    def _hang(self) -> None:
        for name, module in self.modules:
            if self.site == "output":
                self.hooks.forward(module, self._output_hook(name), name=name)
            else:
                self.hooks.forward_pre(module, self._input_hook(name), name=name)

    def __exit__(self, *exc) -> None:
        if self.attention is not None:
            self.attention.__exit__(*exc)
        else:
            self.hooks.__exit__(*exc)

    def _output_hook(self, name: str):
        def hook(module, args, output):
            if not self.active:
                return None
            if isinstance(output, torch.Tensor):
                return self._patched(name, output)
            if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
                return (self._patched(name, output[0]), *output[1:])
            return None

        return hook

    def _input_hook(self, name: str):
        def hook(module, args):
            if not self.active or not args or not isinstance(args[0], torch.Tensor):
                return None
            return (self._patched(name, args[0]), *args[1:])

        return hook

    def _patched(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """x with each active cell of this layer patched into its repeat of the batch."""
        key = self.site if self.site == "input" else "output"
        mine = [(k, c) for k, c in enumerate(self.active) if c.layer == name]
        if not mine:
            return x
        n = len(x) // len(self.active)
        src = self._source(name, key, x[:n])
        out = x.clone()
        for k, cell in mine:
            rows = slice(k * n, (k + 1) * n)
            mask = self.region(cell).mask(x[rows], self.tokens)
            piece = src.to(device=x.device, dtype=x.dtype)
            out[rows] = piece if mask is None else torch.where(mask, piece, x[rows])
        return out

    def region(self, cell: Cell) -> Region:
        """Where a cell patches its layer's value: its position and head."""
        return Region(
            f"{self.label} cell {cell}",
            self.classes[cell.layer],
            None if cell.position is None else [cell.position],
            None,
            None if cell.head is None else [cell.head],
            self.n_heads,
        )

    def source_of(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """The source's value of layer `name`'s site on this batch, shaped like `x`."""
        return self._source(name, self.site if self.site == "input" else "output", x)

    def _source(self, name: str, key: str, x: torch.Tensor) -> torch.Tensor:
        if self.file is not None:
            return read_rows(self.file, name, key, self.start, x, self.label)
        for dataset in (key, f"{key}.0"):  # a tuple's first element is patched
            value = self.values.get((name, dataset))
            if value is not None:
                return value
        raise ConfigError(f"{self.label}: no source value of {name!r} {key}")

    def run_cells(self, model, capture, inputs, tokens, size: int, start: int, read) -> list:
        """`read(output, k)` of one patched forward per cell (`stack` cells per forward), in
        cell order, with the run's other edits acting (`capture`, recording nothing); inputs
        are the target's, already on the device."""
        self.tokens, self.start = tokens, start
        results = []
        if self.attention is not None:
            self.attention.mode = "patch"
        try:
            for i in range(0, len(self.cells), self.stack):
                group = self.cells[i : i + self.stack]
                self.active = group
                capture.begin(size, start, tokens, recording=False, repeats=len(group))
                try:
                    with torch.inference_mode():
                        output = call(model, _repeat(inputs, len(group)))
                finally:
                    capture.end()
                results += read(output, len(group))
        finally:
            self.active = []
            if self.attention is not None:
                self.attention.mode = None
        return results


def _repeat(inputs, k: int):
    if k == 1:
        return inputs
    if isinstance(inputs, dict):
        return {n: torch.cat([v] * k) if torch.is_tensor(v) else v for n, v in inputs.items()}
    return torch.cat([inputs] * k)


TABLE = ["layer", "site", "position", "head", "metric", "method", "layer_type", "n", "value",
         "target", "source", "normalized"]  # fmt: skip
SUFFIX = {"exact": "", "atp": "_atp", "atp_star": "_atp_star"}  # /patching/<metric><suffix>


def patching_table(h5_path, grid: Grid, metrics: list[str]) -> pd.DataFrame:
    """patching.csv: per cell, metric and method the mean over samples of the patched value
    (exact) or its approximation (atp, atp_star), the target's and the source's, and
    normalized = (value - target) / (source - target)."""
    rows = []
    with open_probe_file(h5_path) as f:
        valid = read_progress(f).samples
        for metric, method in itertools.product(metrics, grid.methods):
            values = f[f"patching/{metric}{SUFFIX[method]}"][:valid]
            target = float(np.mean(f[f"patching/{metric}_target"][:valid]))
            source = float(np.mean(f[f"patching/{metric}_source"][:valid]))
            span = source - target
            for j, cell in enumerate(grid.cells):
                value = float(np.mean(values[:, j]))
                rows.append(
                    {
                        **asdict(cell),
                        "site": grid.site,
                        "metric": metric,
                        "method": method,
                        "layer_type": grid.types[cell.layer],
                        "n": valid,
                        "value": value,
                        "target": target,
                        "source": source,
                        "normalized": (value - target) / span if span else math.nan,
                    }
                )
    table = pd.DataFrame(rows, columns=TABLE)
    for column in ("position", "head"):
        table[column] = table[column].astype("Int64")
    return table


def heatmap(table: pd.DataFrame, path: Path, grid: Grid, labels: list[str] | None) -> Path | None:
    """patching.png: normalized of the first metric, layer x position (or head; the mean over
    heads where there are both), the first sample's tokens along the positions; None without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("no matplotlib: patching.png is not drawn (pip install -e '.[plot]')")
        return None
    first = table[(table.metric == table.metric.iloc[0]) & (table.method == table.method.iloc[0])]
    across = "position" if "position" in grid.over else ("head" if "head" in grid.over else None)
    layers = list(dict.fromkeys(first.layer))
    columns: list[Any]  # ["all"], or the positions or heads (pandas' values: untyped)
    if across is None:
        grid_values = first.set_index("layer").loc[layers, ["normalized"]].to_numpy()
        columns = ["all"]
    else:
        pivot = first.groupby(["layer", across])["normalized"].mean().unstack(across)
        grid_values, columns = pivot.loc[layers].to_numpy(), list(pivot.columns)
    if across == "position" and labels:
        columns = [f"{p}: {labels[p] if -len(labels) <= p < len(labels) else ''}" for p in columns]
    fig, ax = plt.subplots(figsize=(1.2 + 0.55 * len(columns), 1.2 + 0.35 * len(layers)))
    limit = max(
        1.0, float(np.nanmax(np.abs(grid_values))) if np.isfinite(grid_values).any() else 1.0
    )
    image = ax.imshow(grid_values, cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto")
    ax.set_yticks(range(len(layers)), layers, fontsize=7)
    ax.set_xticks(range(len(columns)), [str(c) for c in columns], rotation=90, fontsize=7)
    ax.set_xlabel(across or "")
    ax.set_title(
        f"{first.metric.iloc[0]}, normalized ({grid.site}, from {grid.source})", fontsize=8
    )
    fig.colorbar(image, ax=ax, label="normalized")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
