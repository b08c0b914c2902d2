"""Read a run or a sweep back: layers and sites, lazy arrays, config, summary and effects tables.

    run = probe.open_run("outputs/2026-11-21/10-00-00")
    run.layers, run.sites("conv1"), run.array("conv1", "output")[:4], run.summary, run.config

Arrays are h5py-backed: slicing reads only the rows asked for, and only the rows the file counts
as valid are visible. A run still writing opens too ("in progress"); `run.refresh()` picks up the
rows flushed since. `run.xarray(layer, site)` gives a labelled array (the `xarray` extra).
"""

from __future__ import annotations

import warnings
from functools import cached_property
from pathlib import Path

import h5py
import numpy as np
import pandas as pd
from omegaconf import DictConfig, OmegaConf

from probe.attribute.table import attribution_table
from probe.errors import DataError
from probe.read.latents import SparseLatents
from probe.read.lazy import LazyArray
from probe.read.summaries import (
    dataset_keys,
    gather_tables,
    read_overrides,
    summarize_file,
    sweep_runs,
    sweep_table,
)
from probe.read.tables import summary_frame, units_frame
from probe.read.train_series import series
from probe.read.train_steps import train_scalars, train_table, watched_modules
from probe.stats.running import LogHistogram, PointQuantiles, RunningStats
from probe.store.coverage import seen_ranges
from probe.store.fileformat import layer_path, read_progress
from probe.store.runfile import missing_sources, open_probe_file, state
from probe.store.steps_file import is_watched, steps_held


class Run:
    """One run directory (or a bare probe.h5). Close it, or use it in a `with` block."""

    def __init__(self, path: Path | str):
        path = Path(path)
        self.h5_path = path if path.is_file() else path / "probe.h5"
        self.path = self.h5_path.parent
        self.file = open_probe_file(self.h5_path)
        self._read_state(warn=True)

    def _read_state(self, warn: bool = False) -> None:
        self.attrs = dict(self.file.attrs)
        unusable = missing_sources(self.file)
        if unusable and warn:
            warnings.warn(
                f"{str(self.h5_path)!r} is stitched from shard files and some are unusable "
                f"({', '.join(unusable)}): their rows read as NaN (-1 for integers); restore the "
                "shard files next to it",
                stacklevel=3,
            )
        progress = read_progress(self.file)
        self.progress = progress
        self.complete = progress.complete and not unusable
        self.state = "partial" if unusable else state(self.file)
        self.num_samples = progress.samples
        self.num_batches = progress.batches
        self.num_tokens = progress.tokens
        self.watched = is_watched(self.file)  # a watched training (probe.watch): run.train()

    def refresh(self) -> Run:
        """Pick up what a run in progress flushed since this Run was opened (reopens the file:
        the writer may have added datasets)."""
        self.close()
        self.file = open_probe_file(self.h5_path)
        self._read_state()
        for name in ("keys", "_datasets", "summary"):
            self.__dict__.pop(name, None)
        return self

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.file.id.valid:
            self.file.close()

    def __repr__(self) -> str:
        if self.watched:  # in steps, not samples
            return f"Run({str(self.path)!r}, {self.state}, a watched training: {steps_held(self.file)})"
        return (
            f"Run({str(self.path)!r}, {self.state}, {self.num_samples} samples, "
            f"{len(self.layers)} layers)"
        )

    @cached_property
    def keys(self) -> list[tuple[str, str]]:
        """(layer, site) pairs in the order the run produced them."""
        return dataset_keys(self.file)

    @property
    def layers(self) -> list[str]:
        return list(dict.fromkeys(layer for layer, _ in self.keys))

    def sites(self, layer: str) -> list[str]:
        found = [site for name, site in self.keys if name == layer]
        if not found:
            raise KeyError(f"no layer {layer!r} in {self.h5_path}; run.layers lists them")
        return found

    def array(self, layer: str, site: str = "output") -> LazyArray:
        """Rows of one (layer, site); rows a module skipped (`seen`) read as NaN. An SAE's
        latents stored sparse read as dense rows."""
        sparse = layer_path(layer, "sae.latents.index")
        if (
            site == "sae.latents"
            and layer_path(layer, site) not in self.file
            and sparse in self.file
        ):
            index, value = (self._dataset(layer, f"sae.latents.{p}") for p in ("index", "value"))
            return SparseLatents(index, value, self.progress.valid_rows(index, "sae.latents.index"))
        ds = self._dataset(layer, site)
        return LazyArray(ds, self.progress.valid_rows(ds, site))

    def _dataset(self, layer: str, site: str) -> h5py.Dataset:
        name = layer_path(layer, site)
        if name not in self.file:
            mode = self.attrs.get("store_mode", "full")
            hint = " (a store=stats run keeps no tensors)" if mode == "stats" else ""
            raise KeyError(f"no tensors for {layer!r} {site!r} in {self.h5_path}{hint}")
        ds = self.file[name]
        if self.file.swmr_mode:
            ds.refresh()
        return ds

    def seen(self, layer: str, site: str = "output") -> np.ndarray:
        """One boolean per valid row: whether the module produced it (False where it did not run
        for that batch: data-dependent control flow)."""
        ds = self._dataset(layer, site)
        valid = self.progress.valid_rows(ds, site)
        mask = np.zeros(valid, dtype=bool)
        for lo, hi in seen_ranges(self.file, layer, site, valid):
            mask[lo:hi] = True
        return mask

    def xarray(self, layer: str, site: str = "output", rows: slice = slice(None)):
        """One (layer, site) as an xarray.DataArray with named dimensions (sample, channel,
        height, width; token, feature; ...) and the rows' coordinates: dataset-wide sample index,
        target and per-sample names (sample rows), or sample, position and token id (token rows)."""
        from probe.read.labelled import data_array

        return data_array(self, layer, site, rows)

    def dataset(self, layer: str, site: str = "output", pair: tuple[str, str] | None = None,
                **options):  # fmt: skip
        """The valid rows of one (layer, site) as a shuffled torch IterableDataset of
        `(rows, labels)` batches (docs/training_data.md): batch_size=4096, shuffle=True, seed=0,
        buffer_rows, drop_last, with_index, dtype, device; `pair=(layer, site)` adds, last in
        each batch, that site's rows of the same tokens (an MLP's input and output)."""
        from probe.read.stream import RowStream, sources_of

        return RowStream(sources_of(self, layer, site, pair), **options)

    def topk(self, layer: str, site: str = "output", unit=None, kind: str = "top",
             context: tuple[int, int] = (8, 4), tokenizer=None) -> pd.DataFrame:  # fmt: skip
        """The examples the run kept of `unit` (int, list, None: all) with stats.topk (kind
        top, bottom or quantiles): value, sample, position, and what the sample is (its path,
        document, or tokens with `context` tokens around); docs/features.md."""
        from probe.read.example_rows import examples_table

        return examples_table(self, layer, site, unit, kind, context, tokenizer)

    def tokens(self) -> pd.DataFrame:
        """What each row of the token-row datasets (rows: tokens) is: its sample, position and
        token id."""
        if "tokens" not in self.file:
            raise KeyError(f"{self.h5_path} holds no token rows (a probe with rows: tokens)")
        return pd.DataFrame(
            {k: self.file[f"tokens/{k}"][: self.num_tokens] for k in ("sample", "position", "id")}
        )

    def train(self) -> pd.DataFrame:
        """A watched training's statistics (train.csv's rows, as far as the file counts them
        valid): one row per (step, layer, site), `step` first, the columns of summary.csv,
        then `norm`."""
        self._check_watched("train")
        return train_table(self.file)

    def train_scalars(self) -> pd.DataFrame:
        """A watched training's scalars, one row per recorded step: `step`, loss, grad_norm,
        grad_scale, lr.<group>."""
        self._check_watched("train_scalars")
        return train_scalars(self.file)

    def train_series(self) -> dict[str, pd.DataFrame]:
        """A watched training's statistics over the steps as its figures draw them: {statistic:
        a step x module frame} (`abs_mean (output)`, `std (output)`, `dead_frac (output)`,
        `grad norm (grad_output)`, `grad norm (param_grad)`, `update / weight`: those the run
        holds the sites of; probe.read.train_series), modules in the model's order."""
        self._check_watched("train_series")
        return series(train_table(self.file), watched_modules(self.file))

    def _check_watched(self, what: str) -> None:
        if not self.watched:
            raise DataError(
                f"run.{what}() reads a watched training (probe.watch); {self.h5_path} is a "
                "probing run: read run.summary and run.array(...) instead"
            )

    @cached_property
    def config(self) -> DictConfig:
        """The run's resolved config (.hydra/config.yaml, else the copy inside probe.h5)."""
        hydra_cfg = self.path / ".hydra" / "config.yaml"
        if hydra_cfg.is_file():
            loaded = OmegaConf.load(hydra_cfg)
        else:
            loaded = OmegaConf.create(str(self.attrs.get("config", "{}")))
        if not isinstance(loaded, DictConfig):
            raise DataError(
                f"the config of {self.path} is not a mapping; rerun into a new directory"
            )
        return loaded

    @cached_property
    def summary(self) -> pd.DataFrame:
        """summary.csv when the run wrote one, else computed from the file."""
        csv = self.path / "summary.csv"
        if csv.is_file():
            return pd.read_csv(csv)
        return summarize_file(self.h5_path).table

    @property
    def effects(self) -> pd.DataFrame | None:
        """effects.csv of the run directory, or None when the run made none."""
        csv = self.path / "effects.csv"
        return pd.read_csv(csv) if csv.is_file() else None

    @property
    def attribution(self) -> pd.DataFrame | None:
        """attribution.csv of the run directory, else the table from the run's statistics; None
        when the run has no attribution site."""
        csv = self.path / "attribution.csv"
        if csv.is_file():
            return pd.read_csv(csv)
        table = attribution_table(self._datasets)
        return table if len(table) else None

    @property
    def lens(self) -> pd.DataFrame | None:
        """lens.csv (the logit lens's metrics per layer), None when the run made none."""
        csv = self.path / "lens.csv"
        return pd.read_csv(csv) if csv.is_file() else None

    @property
    def dla(self) -> pd.DataFrame | None:
        """dla.csv (direct logit attribution per component), None when the run made none."""
        csv = self.path / "dla.csv"
        return pd.read_csv(csv) if csv.is_file() else None

    def stats(self, layer: str, site: str = "output") -> RunningStats:
        """The streaming statistics of one (layer, site): stored ones, else re-read from the data."""
        for d in self._datasets:
            if (d.layer, d.site) == (layer, site):
                return d.stats
        raise KeyError(f"no statistics for {layer!r} {site!r}; run.keys lists them")

    def units(self, layer: str | None = None, site: str | None = None) -> pd.DataFrame:
        """Per-unit table (one row per channel) of one (layer, site), or of all of them."""
        picked = [
            d
            for d in self._datasets
            if (layer is None or d.layer == layer) and (site is None or d.site == site)
        ]
        return units_frame(picked)

    def histogram(self, layer: str, site: str = "output") -> tuple[np.ndarray, np.ndarray]:
        """(bucket midpoints, counts) of the quantile sketch, increasing values."""
        hist = self.stats(layer, site).hist
        if hist is None or isinstance(hist, PointQuantiles):
            raise KeyError(f"no histogram kept for {layer!r} {site!r}; run.units() has the rest")
        return (hist if isinstance(hist, LogHistogram) else hist.whole()).ordered()

    def table(self) -> pd.DataFrame:
        """The summary recomputed from the file (ignores summary.csv)."""
        return summary_frame(self._datasets)

    @cached_property
    def _datasets(self):
        return summarize_file(self.h5_path, from_stats=True).datasets


class Sweep:
    """A sweep directory: its runs, their overrides, and one summary table for all of them."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.run_dirs = sweep_runs(self.path)
        if not self.run_dirs:
            raise DataError(
                f"{str(self.path)!r} holds no runs (no */.hydra/overrides.yaml); give a sweep directory"
            )

    def __repr__(self) -> str:
        return f"Sweep({str(self.path)!r}, {len(self.run_dirs)} runs)"

    @cached_property
    def overrides(self) -> pd.DataFrame:
        """One row per run: its directory name and one column per override."""
        return pd.DataFrame([{"run": p.name, **read_overrides(p)} for p in self.run_dirs])

    @cached_property
    def table(self) -> pd.DataFrame:
        """One row per (run, layer, site) with the override columns (the sweep's summary.csv)."""
        csv = self.path / "summary.csv"
        if csv.is_file():
            return pd.read_csv(csv, dtype={"run": str})
        return sweep_table(self.path, from_stats=True)[0]

    @cached_property
    def attribution(self) -> pd.DataFrame | None:
        """Every run's attribution.csv in one table, with the run and its override columns
        first; None when no run made one."""
        csv = self.path / "attribution.csv"
        if csv.is_file():
            return pd.read_csv(csv, dtype={"run": str})
        return gather_tables(self.path, "attribution.csv")

    @cached_property
    def effects(self) -> pd.DataFrame | None:
        """Every run's effects.csv in one table, with the run and its override columns first
        (the sweep's effects.csv when `probe.read.summaries` wrote it); None when no run made one."""
        csv = self.path / "effects.csv"
        if csv.is_file():
            return pd.read_csv(csv, dtype={"run": str})
        return gather_tables(self.path, "effects.csv")

    def run(self, name: str | int) -> Run:
        return Run(self.path / str(name))

    def dataset(self, layer: str, site: str = "output", pair: tuple[str, str] | None = None,
                **options):  # fmt: skip
        """Run.dataset over every run of the sweep that stored (layer, site) (and `pair`), one
        stream."""
        from probe.read.stream import RowStream, sources_of

        sources = []
        for d in self.run_dirs:
            with Run(d) as run:
                if (layer, site) in run.keys and (pair is None or tuple(pair) in run.keys):
                    sources += sources_of(run, layer, site, pair)
        if not sources:
            raise KeyError(f"no run of {str(self.path)!r} stored {layer!r} {site!r}")
        return RowStream(sources, **options)


def open_run(path: Path | str) -> Run:
    """Open a run directory (or its probe.h5) for reading."""
    return Run(path)


def open_sweep(path: Path | str) -> Sweep:
    """Open a sweep directory (the parent of the runs 0/, 1/, ...)."""
    return Sweep(path)
