"""Per-layer statistic tables from a run or a sweep; `python -m probe.summarize PATH...`.

A run directory's probe.h5 is re-summarized slab by slab (bounded memory: a few slabs at a time,
read through h5py while the previous one is reduced, or with `--mapped` reduced where they lie
in the file's pages, `probe.read.mapped`); a stats-only file gives its stored statistics.
Only the rows the file counts as valid are read (`/progress`, probe.store.fileformat), and of a module
that skipped batches only the rows it produced (probe.store.coverage). A sweep directory gives one table
with a row per (run, layer, site) and a column per override of each run's `.hydra/overrides.yaml`.
A file being written is summarized as it stands ("in progress", printed, not written into the
live run's directory); a partial file (stopped early) or a corrupt one is reported as such.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import h5py
import numpy as np
import pandas as pd
import yaml

from probe.errors import DataError, ProbeError
from probe.read import slabs as slab_reads
from probe.read.tables import integer_columns, summary_columns, summary_frame, units_frame
from probe.stats import backend, parallel
from probe.stats.running import stats_for
from probe.store import stats_file
from probe.store.coverage import seen_ranges
from probe.store.fileformat import captured, is_per_batch, layer_path, read_progress
from probe.store.runfile import NothingFlushed, missing_sources, open_probe_file, state
from probe.store.stats_file import DatasetInfo

if TYPE_CHECKING:
    from probe.read.train_steps import WatchSummary

log = logging.getLogger("probe")


@dataclass
class FileSummary:
    """What one probe.h5 holds: its state (complete, in progress, partial, corrupt, missing) and
    statistics."""

    path: Path
    state: str
    num_samples: int = 0
    message: str = ""
    datasets: list[DatasetInfo] = field(default_factory=list)

    @property
    def table(self) -> pd.DataFrame:
        return summary_frame(self.datasets)

    @property
    def detail(self) -> str:
        return f"{self.num_samples} samples, {len(self.datasets)} datasets"


def summarize_file(path: Path | str, from_stats: bool = False) -> FileSummary:
    """Statistics of every (layer, site) of a probe.h5; never raises on a partial or corrupt file."""
    path = Path(path)
    if not path.is_file():
        return FileSummary(path, "missing", message=f"{path} does not exist")
    try:
        f = open_probe_file(path, ours_only=False)  # names a file cut short
    except NothingFlushed as e:
        return FileSummary(path, "in progress" if e.in_progress else "partial", message=str(e))
    except DataError as e:
        return FileSummary(path, "corrupt", message=str(e))
    if "format_version" not in f.attrs and "stats" not in f and "layers" not in f:
        f.close()
        return FileSummary(
            path,
            "corrupt",
            message=f"{path} is an HDF5 file but not one written by probe (no format_version "
            "attribute); give the probe.h5 of a run directory",
        )
    try:
        with f:
            return _summarize_open(path, f, from_stats)
    except (OSError, KeyError, ValueError, RuntimeError) as e:
        return FileSummary(path, "corrupt", message=f"{path} cannot be read ({e})")


def _summarize_open(path: Path, f: h5py.File, from_stats: bool) -> FileSummary:
    progress = read_progress(f)
    out = FileSummary(path, state(f), progress.samples)
    stored = stats_file.read(f, warn=log.warning)
    unusable = missing_sources(f)  # a stitched file's shards: their rows would read as fill values
    if unusable:
        from_stats, out.state = True, "partial"
        out.message = (
            f"{path} is stitched from shard files and some are unusable ({', '.join(unusable)}): "
            "its table comes from the /stats merged when it was stitched; restore the shard "
            "files next to it to read its layers"
        )
    for layer, site in dataset_keys(f):
        saved = stored.get((layer, site))
        name = layer_path(layer, site)
        if saved is not None and (from_stats or name not in f):
            out.datasets.append(saved)
            continue
        if unusable or name not in f:
            if unusable:
                out.message += f"; {layer}/{site} has no /stats and is left out"
            continue
        ds = f[name]
        if f.swmr_mode:
            ds.refresh()
        valid = progress.valid_rows(ds, site)
        module_type = str(f[name].parent.attrs.get("module_type", ""))
        stats = stats_for(module_type, site, int(ds.attrs.get("unit_axis", 1)))
        for slab in _seen_slabs(f, ds, layer, site, valid):
            backend.fold(stats, slab)
        per_batch = is_per_batch(ds.attrs, site)
        rows = str(ds.attrs.get("row_unit", "samples"))
        out.datasets.append(
            DatasetInfo(
                layer, site, module_type, ds.shape[1:], str(ds.dtype), stats, per_batch, rows
            )
        )
    if out.state != "complete":
        stitched = out.message
        if out.state == "in progress":
            said = f"{path} is in progress: summarized the {progress.samples} rows flushed so far"
        else:
            said = (
                f"{path} is partial (the run stopped early): summarized the {progress.samples} "
                "rows written before it stopped"
            )
        out.message = said + (f"; {stitched}" if stitched else "")
        if not out.datasets:
            out.message += (
                "; it holds no statistics yet (a stats-only run writes them at each flush, "
                "every 10 s by default)"
            )
    return out


def _seen_slabs(f: h5py.File, ds: h5py.Dataset, layer: str, site: str, valid: int):
    """The valid rows (layer, site) produced, in slabs; a site that skipped batches is read range
    by range."""
    ranges = seen_ranges(f, layer, site, valid)
    if ranges == [(0, valid)]:
        yield from slab_reads.slabs(ds, valid)
        return
    step = max(1, slab_reads.SLAB_BYTES // max(1, ds.dtype.itemsize * int(np.prod(ds.shape[1:]))))
    for lo, hi in ranges:
        for at in range(lo, hi, step):
            yield ds[at : min(at + step, hi)]


def dataset_keys(f: h5py.File) -> list[tuple[str, str]]:
    """(layer, site) pairs of /layers and /stats, in the order the run produced them."""
    found: dict[tuple[str, str], tuple[int, int]] = {}
    for top in ("stats", "layers"):
        if top not in f:
            continue
        for link, group in captured(f[top]):
            order = int(group.attrs.get("order", 1 << 30))
            layer = str(group.attrs.get("name", link))
            for site, item in captured(group):
                if isinstance(item, h5py.Group) and top == "layers":
                    continue
                rank = int(item.attrs.get("order", order))
                found.setdefault((str(item.attrs.get("name", layer)), site), (rank, len(found)))
    return sorted(found, key=found.__getitem__)


def stored_stats(f: h5py.File) -> dict[tuple[str, str], DatasetInfo]:
    """The statistics the writer stored under /stats: at close, and at each flush of a stats-only
    run (a killed full run has none)."""
    return stats_file.read(f, warn=log.warning)


# -- runs and sweeps ---------------------------------------------------------------------------
def is_sweep(path: Path) -> bool:
    return not (path / ".hydra").is_dir() and (
        (path / "multirun.yaml").is_file() or bool(sweep_runs(path))
    )


def sweep_runs(path: Path) -> list[Path]:
    """The run directories of a sweep (subdirectories holding .hydra/overrides.yaml), in job order."""
    runs = [p.parent.parent for p in path.glob("*/.hydra/overrides.yaml")]
    return sorted(
        runs, key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name)
    )


def read_overrides(run_dir: Path) -> dict[str, str]:
    """key -> value of a run's command-line overrides (`model=vgg11` gives model: vgg11)."""
    file = run_dir / ".hydra" / "overrides.yaml"
    if not file.is_file():
        return {}
    out = {}
    for item in yaml.safe_load(file.read_text()) or []:
        key, _, value = str(item).partition("=")
        out[key.lstrip("+~")] = value
    return out


def sweep_table(path: Path, from_stats: bool = False) -> tuple[pd.DataFrame, list[FileSummary]]:
    """One row per (run, layer, site) of every run of the sweep, with its override columns."""
    frames, summaries = [], []
    for run_dir in sweep_runs(path):
        s = summarize_file(run_dir / "probe.h5", from_stats)
        summaries.append(s)
        table = s.table
        overrides = read_overrides(run_dir)
        table.insert(0, "status", s.state)
        for i, (key, value) in enumerate(overrides.items()):
            table.insert(1 + i, key, value)
        table.insert(0, "run", run_dir.name)
        if table.empty:
            table = pd.DataFrame([{"run": run_dir.name, "status": s.state, **overrides}])
        frames.append(table)
    columns = summary_columns()
    if not frames:
        return pd.DataFrame(columns=["run", "status", *columns]), summaries
    table = pd.concat(frames, ignore_index=True)
    for column in integer_columns() & set(table.columns):  # a run without rows made them float
        table[column] = table[column].astype("Int64")
    override_cols = [c for c in table.columns if c not in ("run", "status", *columns)]
    return table[["run", "status", *override_cols, *[c for c in columns if c in table]]], summaries


def gather_tables(path: Path, name: str) -> pd.DataFrame | None:
    """One table of every run's `name` (patching.csv, effects.csv) with the run and its override
    columns first; None when no run wrote one."""
    frames = []
    for run_dir in sweep_runs(path):
        if (run_dir / name).is_file():
            table = pd.read_csv(run_dir / name)
            columns = {"run": run_dir.name, **read_overrides(run_dir)}
            for i, (key, value) in enumerate(columns.items()):
                table.insert(i, key, value)
            frames.append(table)
    return pd.concat(frames, ignore_index=True) if frames else None


def write_table(table: pd.DataFrame, stem: Path) -> list[Path]:
    """stem.csv, and stem.parquet when pyarrow is installed."""
    written = [stem.with_suffix(".csv")]
    table.to_csv(written[0], index=False)
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return written
    table.to_parquet(stem.with_suffix(".parquet"), index=False)
    return [*written, stem.with_suffix(".parquet")]


def summarize_path(
    path: Path, from_stats: bool = False, units: bool = False
) -> list[FileSummary] | list[WatchSummary]:
    """Write the table(s) of one run or sweep directory; return what each file was found to be."""
    if path.is_file():
        path = path.parent
    if not path.is_dir():
        raise DataError(f"{str(path)!r} is not a run or sweep directory; give a path that exists")
    if is_sweep(path):
        table, summaries = sweep_table(path, from_stats)
        write_table(table, path / "summary")
        for name in ("patching", "effects", "attribution", "lens", "dla"):
            gathered = gather_tables(path, f"{name}.csv")
            if gathered is not None:
                write_table(gathered, path / name)
        return summaries
    from probe.read.train_steps import summarize_watched

    watched = summarize_watched(path / "probe.h5")
    if watched is not None:  # a watched training: its last step's table (train.csv is its own)
        if not watched.frame.empty:
            print(watched.table.to_string(index=False))
        return [watched]
    s = summarize_file(path / "probe.h5", from_stats)
    if s.state == "in progress":
        print(s.table.to_string(index=False))
    elif s.state in ("complete", "partial"):
        write_table(s.table, path / "summary")
        if units:
            units_frame(s.datasets).to_csv(path / "units.csv", index=False)
    return [s]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m probe.summarize",
        description="Write summary.csv for run directories (re-read chunk by chunk) or sweeps.",
    )
    parser.add_argument("paths", nargs="+", type=Path, help="run or sweep directories")
    parser.add_argument(
        "--from-stats", action="store_true", help="use the statistics stored at the end of a run"
    )
    parser.add_argument(
        "--units", action="store_true", help="also write units.csv (one row per unit)"
    )
    parser.add_argument(
        "--mapped",
        action="store_true",
        help="reduce uncompressed datasets in the file's own pages (faster; a file truncated "
        "meanwhile ends the process with SIGBUS instead of an error)",
    )
    args = parser.parse_args(argv)
    slab_reads.MAPPED = slab_reads.MAPPED or args.mapped
    faulthandler.enable()  # a file truncated while mapped ends the process (SIGBUS): say where
    if not parallel.configured():  # no forward runs beside the summarizer: every core
        parallel.threads.resize(parallel.usable_cores())
    failed = False
    for path in args.paths:
        try:
            summaries = summarize_path(path, args.from_stats, args.units)
        except ProbeError as e:
            print(f"probe.summarize: error: {e}", file=sys.stderr)
            failed = True
            continue
        if not summaries:
            print(f"{path}: no runs found (no */.hydra/overrides.yaml)", file=sys.stderr)
            failed = True
        for s in summaries:
            if s.state == "complete":
                print(f"{s.path}: complete, {s.detail}")
            else:
                print(f"{s.path}: {s.state}: {s.message}", file=sys.stderr)
                failed |= s.state in ("corrupt", "missing")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
