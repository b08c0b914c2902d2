"""The per-step statistics of a watched training (`probe.watch`) in probe.h5, and train.csv.

Row i of every dataset under `/train` is the recorded step `/train/step[i]`:

    /train/step                  (S,) int64: the training step of each row, increasing
    /train/scalars               (S, K) float64: loss, grad_norm, grad_norm_preclip, grad_scale, lr.*
                                 (attribute `columns`)
    /train/sites/<layer>/<site>  (S, len(STAT_COLUMNS)) float64: the statistics of one site at
                                 each recorded step (attribute `columns`; the columns of
                                 `probe.stats.stat_columns.step_names`); NaN at steps where it
                                 had no value
    /progress                    rows valid (`steps`), the last complete step (`last_step`),
                                 `complete`; beside the counts of a probing run's /progress

The writer appends rows in memory and writes them at `flush`: data first, then `/progress`, each
flushed, in HDF5's SWMR mode, so a reader (and a kill) never sees a step half written. Rows past
`/progress` are a killed writer's and are cut when the training resumes. docs/format.md has the
layout for people; train.csv is the same rows as a table, appended at each flush.

The watch's settings (the `config` attribute, YAML) are also the run directory's watch.yaml; its
`modules` name each module's sites as train.csv does (`sites_as_recorded`), rewritten as sites
are first recorded.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import pandas as pd
import yaml

from probe.errors import ConfigError
from probe.site_keys import VALUE_GRAD_SITES, VALUE_SITES, parse_or_none
from probe.stats import stat_columns
from probe.store.fileformat import FORMAT_VERSION, PROGRESS, decode, encode
from probe.store.livefile import LiveFile

WATCH_MODE = "watch"  # the `store_mode` attribute of a watched training's probe.h5
PROBE_BATCH = "probe_batch"  # the run directory's folder of probe-batch runs, one per step
TRAIN = "train"
SETTINGS_FILE = "watch.yaml"  # the `config` attribute, beside the file
SITES = f"{TRAIN}/sites"
CHUNK_ROWS = 64  # rows per chunk: a flush rewrites at most one partial chunk per dataset
SITE_COLUMNS = stat_columns.SITE_COLUMNS


def step_stat_columns() -> tuple[str, ...]:
    """The statistics of a step's row: summary.csv's, then the per-step ones (`norm`)."""
    return tuple(stat_columns.step_names())


def csv_columns() -> tuple[str, ...]:
    """train.csv's header: the step, what the row is of, then its statistics."""
    return ("step", *SITE_COLUMNS, *step_stat_columns())


def step_integer_columns() -> tuple[str, ...]:
    """The statistics of a step's row that hold integers."""
    columns = step_stat_columns()
    return tuple(c for c in stat_columns.integer_names() if c in columns)


STAT_COLUMNS = step_stat_columns()
INTEGER_COLUMNS = step_integer_columns()
CSV_COLUMNS = csv_columns()  # train.csv
SCALAR_COLUMNS = (
    "loss",
    "grad_norm",
    "grad_norm_preclip",
    "grad_scale",
)  # then lr.<group> per param group
ADDED_SCALARS = ("grad_norm_preclip",)  # scalars a resumed older file goes on without
STEP_PROGRESS = np.dtype(
    PROGRESS.descr + [("steps", "<i8"), ("last_step", "<i8")]  # (a probing run's fields kept)
)


@dataclass(frozen=True)
class SiteInfo:
    """What one recorded (layer, site) is: its module's class, the shape and dtype of its first
    value, and its kind (`activation`: merged over micro-batches and ranks; `parameter`)."""

    layer: str
    site: str
    module_type: str
    shape: tuple[int, ...]
    dtype: str
    kind: str


@dataclass(frozen=True)
class Resumed:
    """What a resume did to the file: the recorded steps it kept (those before the
    checkpoint's step), the recorded steps it cut (taken after the checkpoint) and the rows it
    cut past /progress (written by a flush the stop interrupted, never counted valid)."""

    steps: list[int]
    cut: list[int]
    unflushed: int


def is_watched(f: h5py.File) -> bool:
    """Whether `f` is a watched training's file (per-step statistics, no captures)."""
    return str(f.attrs.get("store_mode", "")) == WATCH_MODE


def sites_as_recorded(
    modules: Mapping[str, list[str]], recorded: Iterable[tuple[str, str]]
) -> dict[str, list[str]]:
    """`modules` ({module: the sites it was asked for}) with each value site the file recorded
    under other names (docs/format.md's names: a tuple output's `output.0`, `output.1`, a second
    call's `output@1`) replaced by those names, in the order first recorded; a site not recorded
    yet stays as asked, and parameter sites are named already (`param.weight`)."""
    names: dict[tuple[str, str], list[str]] = {}
    for layer, site in recorded:
        key = parse_or_none(site)
        if key is not None and key.family in (*VALUE_SITES, *VALUE_GRAD_SITES):
            names.setdefault((layer, key.family), []).append(site)
    return {
        module: [name for site in sites for name in names.get((module, site), [site])]
        for module, sites in modules.items()
    }


def steps_held(f: h5py.File) -> str:
    """A watched training's file in steps (not samples): `120 steps, 12 recorded, the last 110`
    once its watch closed it cleanly (the steps the training took, those recorded), else what it
    holds so far: `12 recorded steps, the last 110`, or `no recorded step`."""
    progress = f["progress"]
    if f.swmr_mode:
        progress.refresh()
    row = progress[()]
    held, last = int(row["steps"]), int(row["last_step"])
    recorded = f"{held} recorded, the last {last}"
    trained = f.attrs.get("steps_trained")
    if row["complete"] and trained is not None:
        return f"{int(trained)} step{'s' * (int(trained) != 1)}, " + recorded
    if not held:
        return "no recorded step"
    return f"{held} recorded step{'s' * (held != 1)}, the last {last}"


def site_path(layer: str, site: str) -> str:
    return f"{SITES}/{encode(layer)}/{encode(site)}"


class StepFile:
    """Appends recorded steps to probe.h5 (a new file, or one resumed at a step) and train.csv.

    `attrs` are written into a new file; a resumed file keeps its own, and its `watch` attribute
    (the watch's settings, JSON) must equal the new one's. `scalar_columns` name the scalars."""

    def __init__(
        self,
        path: Path,
        attrs: dict,
        scalar_columns: Iterable[str],
        resume_at: int | None = None,
    ):
        self.path = Path(path)
        self.csv = self.path.parent / "train.csv"
        self.scalar_columns = tuple(scalar_columns)
        self.sites: dict[tuple[str, str], SiteInfo] = {}  # in order of first appearance
        self.written = 0  # rows on disk and counted by /progress
        self.last_step = -1
        self.pending: list[tuple[int, dict[tuple[str, str], np.ndarray], np.ndarray]] = []
        self.pending_sites: dict[tuple[str, str], SiteInfo] = {}
        self.handles: dict[tuple[str, str], h5py.Dataset] = {}  # the sites' datasets, once opened
        self.resumed: Resumed | None = None  # (set where the file was resumed)
        self.settings = yaml.safe_load(attrs.get("config") or "{}") or {}
        at = resume_at if resume_at is not None and self.path.is_file() else None
        self.out = LiveFile(self.path, resume=at is not None)
        try:
            if at is not None:
                self._resume(attrs, at)
            else:
                self._start(attrs)
            self.out.file.flush()
            self.out.go_live()
        except BaseException:
            self.out.close(None)
            raise

    @property
    def file(self) -> h5py.File:
        return self.out.file

    # -- opening ---------------------------------------------------------------------------------
    def _start(self, attrs: dict) -> None:
        f = self.file
        f.attrs["format_version"] = FORMAT_VERSION
        f.attrs["store_mode"] = WATCH_MODE
        f.attrs["complete"] = False
        f.attrs["resumes"] = 0
        for k, v in attrs.items():
            f.attrs[k] = v
        f.create_dataset(f"{TRAIN}/step", (0,), "<i8", maxshape=(None,), chunks=(CHUNK_ROWS,))
        width = len(self.scalar_columns)
        scalars = f.create_dataset(
            f"{TRAIN}/scalars", (0, width), "<f8", maxshape=(None, width),
            chunks=(CHUNK_ROWS, max(width, 1)), fillvalue=np.nan,
        )  # fmt: skip
        scalars.attrs["columns"] = list(self.scalar_columns)
        f.require_group(SITES)
        self._write_progress(False)
        self._write_settings()
        if self.csv.exists():
            self.csv.unlink()  # (the run directory was replaced: overwrite=True)

    def _resume(self, attrs: dict, step: int) -> None:
        """Keep the rows of steps before `step` (the checkpoint's), cut the rest: rows a kill
        left past /progress and steps recorded after the checkpoint was taken."""
        f = self.file
        if not is_watched(f):
            raise ConfigError(
                f"{str(self.path)!r} is not a watched training's file (store_mode "
                f"{f.attrs.get('store_mode')!r}); give probe.watch a new out= directory"
            )
        mine, theirs = json.loads(attrs.get("watch", "{}")), json.loads(f.attrs.get("watch", "{}"))
        differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
        if differ:
            said = "; ".join(f"{k}: file {theirs.get(k)!r}, now {mine.get(k)!r}" for k in differ)
            raise ConfigError(
                f"the training resumed into {str(self.path.parent)!r} is watched differently "
                f"({said}); resume with the same settings, or watch into a new out= directory"
            )
        held = tuple(f[f"{TRAIN}/scalars"].attrs["columns"])
        if held == tuple(c for c in self.scalar_columns if c not in ADDED_SCALARS):
            self.scalar_columns = held  # (a file written before a scalar was added: kept as is)
        if held != self.scalar_columns:
            raise ConfigError(
                f"the resumed training's scalars {list(self.scalar_columns)} differ from the "
                f"file's {list(f[f'{TRAIN}/scalars'].attrs['columns'])} (another optimizer or "
                "param groups); watch into a new out= directory"
            )
        valid = int(f["progress"][()]["steps"])
        written = int(f[f"{TRAIN}/step"].shape[0])
        steps = f[f"{TRAIN}/step"][:valid]
        keep = int(np.searchsorted(steps, step, side="left"))
        for name in (f"{TRAIN}/step", f"{TRAIN}/scalars"):
            f[name].resize(keep, axis=0)
        order = []
        for link, group in f[SITES].items():
            for site_link, ds in group.items():
                ds.resize(keep, axis=0)
                info = SiteInfo(
                    decode(link), decode(site_link), str(ds.attrs["module_type"]),
                    tuple(int(s) for s in ds.attrs["shape"]), str(ds.attrs["dtype"]),
                    str(ds.attrs["kind"]),
                )  # fmt: skip
                order.append((int(ds.attrs["order"]), info))
        self.sites = {(i.layer, i.site): i for _, i in sorted(order, key=lambda p: p[0])}
        self.written = keep
        self.last_step = int(steps[keep - 1]) if keep else -1
        f.attrs["complete"] = False
        f.attrs["resumes"] = int(f.attrs.get("resumes", 0)) + 1
        self._write_progress(False)
        self._write_settings()
        self.resumed = Resumed(
            [int(s) for s in steps[:keep]], [int(s) for s in steps[keep:]], written - valid
        )
        rewrite_csv(f, self.csv, keep)

    # -- appending -------------------------------------------------------------------------------
    def append(
        self,
        step: int,
        rows: dict[tuple[str, str], tuple[SiteInfo, np.ndarray]],
        scalars: np.ndarray,
    ) -> None:
        """One recorded step: each site's STAT_COLUMNS row and the scalars; kept until `flush`."""
        if step <= self.last_step or (self.pending and step <= self.pending[-1][0]):
            raise ValueError(f"step {step} recorded after a later one")  # (the watch's own bug)
        values = {}
        for key, (info, row) in rows.items():
            if key not in self.sites and key not in self.pending_sites:
                self.pending_sites[key] = info
            values[key] = row
        self.pending.append((step, values, np.asarray(scalars, dtype=np.float64)))

    @property
    def unflushed(self) -> int:
        return len(self.pending)

    def flush(self) -> None:
        """Write the pending steps, then say they are valid (/progress), then append them to
        train.csv."""
        if not self.pending:
            return
        self.out.check()
        if self.pending_sites:
            self._create_sites()
        f = self.file
        lo, hi = self.written, self.written + len(self.pending)
        step_ds = f[f"{TRAIN}/step"]
        step_ds.resize(hi, axis=0)
        step_ds[lo:hi] = [s for s, _, _ in self.pending]
        scalars = f[f"{TRAIN}/scalars"]
        scalars.resize(hi, axis=0)
        if scalars.shape[1]:
            scalars[lo:hi] = np.stack([v for _, _, v in self.pending])
        block = np.full((hi - lo, len(step_stat_columns())), np.nan)
        for key in self.sites:
            block.fill(np.nan)
            for i, (_, values, _) in enumerate(self.pending):
                if key in values:
                    block[i] = values[key]
            ds = self.handles.get(key)
            if ds is None:  # (a lookup by path costs more than the write of a few rows)
                ds = self.handles[key] = f[site_path(*key)]
            ds.resize(hi, axis=0)
            ds[lo:hi] = block
        self.written, self.last_step = hi, self.pending[-1][0]
        self.out.file.flush()
        self._write_progress(False)
        self.out.file.flush()
        self._append_csv()
        self.pending.clear()

    def _append_csv(self) -> None:
        """The pending steps' rows at the end of train.csv, as `step_frame` orders and pandas
        writes them (floats as repr, integers plain, NaN empty), without pandas' cost."""
        lines = [] if self.csv.exists() else [",".join(csv_columns())]
        columns = step_stat_columns()
        at_rows = columns.index("rows")
        integers = {columns.index(c) for c in step_integer_columns()}
        for step, values, _ in self.pending:
            for key, info in self.sites.items():
                row = values.get(key)
                if row is None or math.isnan(row[at_rows]):
                    continue
                head = [str(step), _csv_text(info.layer), _csv_text(info.site),
                        _csv_text(info.module_type), "x".join(map(str, info.shape)), info.dtype]  # fmt: skip
                cells = [_cell(v, i in integers) for i, v in enumerate(row.tolist())]
                lines.append(",".join(head + cells))
        with open(self.csv, "a", newline="") as fh:
            fh.write("".join(line + "\n" for line in lines))

    def _create_sites(self) -> None:
        """Datasets for sites first seen since the last flush (the file leaves SWMR mode to make
        them); their rows before now read NaN."""
        self.out.creating()  # (the file may be reopened: handles taken before are closed)
        self.handles.clear()
        f = self.file
        columns = step_stat_columns()
        for key, info in self.pending_sites.items():
            ds = f.create_dataset(
                site_path(*key), (self.written, len(columns)), "<f8",
                maxshape=(None, len(columns)), chunks=(CHUNK_ROWS, len(columns)),
                fillvalue=np.nan,
            )  # fmt: skip
            ds.attrs.update(
                name=info.layer, site=info.site, module_type=info.module_type,
                shape=list(info.shape), dtype=info.dtype, kind=info.kind,
                order=len(self.sites), columns=list(columns),
            )  # fmt: skip
            f[site_path(*key)].parent.attrs["name"] = info.layer
            self.sites[key] = info
        self.pending_sites.clear()
        self._write_settings()
        f.flush()
        self.out.go_live()

    def _write_settings(self) -> None:
        """The watch's settings, their `modules` naming the sites as recorded so far, into the
        `config` attribute and watch.yaml (while the file is plain: attributes cannot change
        under SWMR)."""
        if not self.settings:
            return
        settings = dict(self.settings)
        if isinstance(settings.get("modules"), dict):
            settings["modules"] = sites_as_recorded(settings["modules"], self.sites)
        text = yaml.safe_dump(settings, sort_keys=False)
        self.file.attrs["config"] = text
        (self.path.parent / SETTINGS_FILE).write_text(text)

    def _write_progress(self, complete: bool) -> None:
        row = np.zeros((), STEP_PROGRESS)
        row["complete"], row["stats_slot"] = int(complete), -1
        row["steps"], row["last_step"] = self.written, self.last_step
        if "progress" in self.file:
            self.file["progress"][()] = row
        else:
            self.file.create_dataset("progress", data=row)

    def close(self, complete: bool, trained: int | None = None) -> None:
        """Flush what is pending (unless the file failed), then write `complete` last;
        `trained`: the steps the training took (`steps_trained`)."""
        if self.out.failed is None:
            self.flush()
            self._write_progress(complete)
        attrs = {"complete": bool(complete), "num_steps": self.written}
        if trained is not None:
            attrs = {"steps_trained": int(trained), **attrs}
        self.out.close(
            attrs if self.out.failed is None else None, abandon=self.out.failed is not None
        )


def _cell(v: float, integer: bool) -> str:
    if math.isnan(v):
        return ""
    return str(int(v)) if integer else repr(v)


def _csv_text(text: str) -> str:
    """A CSV field as the csv module quotes it (a layer name may hold a comma or a quote)."""
    if any(c in text for c in ',"\n\r'):
        return '"' + text.replace('"', '""') + '"'
    return text


def step_row(stats) -> np.ndarray:
    """A RunningStats as one row of `step_stat_columns`: the columns of summary.csv, then `norm`,
    the L2 norm of the finite values."""
    row = stat_columns.values(stats, stat_columns.step_columns())
    return np.array([float(v) for v in row.values()], dtype=np.float64)


def step_frame(steps, infos: list[SiteInfo], values: dict) -> pd.DataFrame:
    """train.csv's rows, one per (step, layer, site) holding a value, steps in order and sites
    in order of first appearance: `values[(layer, site)]` is (steps, STAT_COLUMNS)."""
    steps = np.asarray(steps, dtype=np.int64)
    columns = list(step_stat_columns())
    frames: list[pd.DataFrame] = []
    for info in infos:
        block = values[(info.layer, info.site)]
        held = ~np.isnan(block[:, columns.index("rows")])
        if not held.any():
            continue
        frame = pd.DataFrame(block[held], columns=columns)
        frame.insert(0, "step", steps[held])
        frame.insert(1, "layer", info.layer)
        frame.insert(2, "site", info.site)
        frame.insert(3, "module_type", info.module_type)
        frame.insert(4, "shape", "x".join(map(str, info.shape)))
        frame.insert(5, "dtype", info.dtype)
        frame["_order"] = len(frames)
        frames.append(frame)
    if not frames:
        return pd.DataFrame(columns=list(csv_columns()))
    table = pd.concat(frames, ignore_index=True).sort_values(["step", "_order"], kind="stable")
    table = table.drop(columns="_order").reset_index(drop=True)
    for column in step_integer_columns():
        table[column] = table[column].astype("Int64")
    return table[list(csv_columns())]


def read_sites(f: h5py.File) -> list[SiteInfo]:
    """The recorded sites of a watched file, in order of first appearance."""
    found: list[tuple[int, SiteInfo]] = []
    if SITES not in f:
        return []
    for link, group in f[SITES].items():
        for site_link, ds in group.items():
            info = SiteInfo(
                decode(link), decode(site_link), str(ds.attrs["module_type"]),
                tuple(int(s) for s in ds.attrs["shape"]), str(ds.attrs["dtype"]),
                str(ds.attrs["kind"]),
            )  # fmt: skip
            found.append((int(ds.attrs["order"]), info))
    return [info for _, info in sorted(found, key=lambda p: p[0])]


def valid_steps(f: h5py.File) -> int:
    """How many rows /progress counts as valid (a reader refreshes it first)."""
    ds = f["progress"]
    if f.swmr_mode:
        ds.refresh()
    return int(ds[()]["steps"])


def read_frame(f: h5py.File, rows: int | None = None) -> pd.DataFrame:
    """train.csv's table from the file: the first `rows` recorded steps (default: the valid)."""
    rows = valid_steps(f) if rows is None else rows
    step_ds = f[f"{TRAIN}/step"]
    if f.swmr_mode:
        step_ds.refresh()
    infos = read_sites(f)
    values = {}
    for info in infos:
        ds = f[site_path(info.layer, info.site)]
        if f.swmr_mode:
            ds.refresh()
        values[(info.layer, info.site)] = ds[:rows]
    return step_frame(step_ds[:rows], infos, values)


def read_scalars(f: h5py.File, rows: int | None = None) -> pd.DataFrame:
    """One row per recorded step: `step`, then the scalars (loss, grad_norm,
    grad_norm_preclip, grad_scale, lr.*)."""
    rows = valid_steps(f) if rows is None else rows
    ds, steps = f[f"{TRAIN}/scalars"], f[f"{TRAIN}/step"]
    if f.swmr_mode:
        ds.refresh()
        steps.refresh()
    table = pd.DataFrame(ds[:rows], columns=[str(c) for c in ds.attrs["columns"]])
    table.insert(0, "step", steps[:rows])
    return table


def rewrite_csv(f: h5py.File, csv: Path, rows: int) -> None:
    """train.csv anew from the file's first `rows` steps (a resume cuts it as it cuts the file)."""
    table = read_frame(f, rows)
    if rows:
        table.to_csv(csv, index=False)
    elif csv.exists():
        csv.unlink()
