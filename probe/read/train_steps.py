"""A watched training's run read back (`probe.watch`): its per-step table, its scalars, its
modules in the model's order, and the last step's table that `python -m probe.summarize RUN`
prints.

The rows are those `/progress` counts (probe.store.steps_file): a training still running shows
the steps flushed so far, a killed one those flushed before it died.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import h5py
import pandas as pd
import yaml

from probe.errors import DataError
from probe.store import swmr
from probe.store.runfile import NothingFlushed, open_probe_file, state
from probe.store.steps_file import (
    PROBE_BATCH,
    is_watched,
    read_frame,
    read_scalars,
    rewrite_csv,
    steps_held,
    valid_steps,
)


def train_table(f: h5py.File) -> pd.DataFrame:
    """One row per (step, layer, site): `step`, the columns of summary.csv, then `norm`."""
    return read_frame(f)


def train_scalars(f: h5py.File) -> pd.DataFrame:
    """One row per recorded step: `step`, loss, grad_norm, grad_scale and lr.<group>."""
    return read_scalars(f)


def watched_modules(f: h5py.File) -> list[str]:
    """The watched modules in the model's order: the `modules` of the watch's settings (the
    file's `config`, watch.yaml)."""
    settings = yaml.safe_load(str(f.attrs.get("config", ""))) or {}
    modules = settings.get("modules") if isinstance(settings, dict) else None
    return [str(m) for m in modules] if isinstance(modules, dict) else []


def last_step(table: pd.DataFrame) -> pd.DataFrame:
    """The rows of the table's last step."""
    if table.empty:
        return table
    return table[table["step"] == table["step"].max()].reset_index(drop=True)


def is_watched_run(path: Path) -> bool:
    """Whether `path` (a run directory or its probe.h5) holds a watched training."""
    path = Path(path)
    h5 = path if path.is_file() else path / "probe.h5"
    if not h5.is_file():
        return False
    try:
        with swmr.open_read(h5) as f:
            return is_watched(f)
    except OSError:
        return False


def probe_batch_sweep(path: Path) -> Path | None:
    """The folder of a watched run's probe-batch runs (a sweep over steps), if it has one."""
    folder = Path(path) / PROBE_BATCH
    return folder if folder.is_dir() and is_watched_run(path) else None


@dataclass
class WatchSummary:
    """A watched run as `probe.summarize` reports it: its state and the last step's table."""

    path: Path
    state: str
    frame: pd.DataFrame = field(default_factory=pd.DataFrame)
    message: str = ""
    num_samples: int = 0
    datasets: tuple = ()
    steps: str = ""  # its steps, as probe.store.steps_file.steps_held says them

    @property
    def table(self) -> pd.DataFrame:
        return last_step(self.frame)

    @property
    def detail(self) -> str:
        return f"a watched training, {self.steps}"


def summarize_watched(h5: Path) -> WatchSummary | None:
    """The watched run in `h5`, or None when it is not one. A partial run's train.csv (a kill
    may leave its last line cut) is written again from the file."""
    if not is_watched_run(h5):
        return None
    try:
        f = open_probe_file(h5, ours_only=False)
    except NothingFlushed as e:
        said = "in progress" if e.in_progress else "partial"
        return WatchSummary(h5, said, message=str(e))
    except DataError as e:
        return WatchSummary(h5, "corrupt", message=str(e))
    with f:
        said = state(f)
        table = train_table(f)
        steps = steps_held(f)
        message = ""
        if said == "partial":
            rewrite_csv(f, h5.parent / "train.csv", valid_steps(f))
            message = (
                f"{h5} is partial (the training stopped without closing its watch): "
                f"{table['step'].nunique() if not table.empty else 0} recorded steps flushed; "
                "train.csv rewritten from them"
            )
        elif said == "in progress":
            message = f"{h5} is in progress: the steps flushed so far"
    return WatchSummary(h5, said, table, message, steps=steps)
