"""Continue an interrupted run: check its config and its inputs' identity, and cut the file's
rows back to the last flushed batch (each fold restores its own values: probe.store.folds), so
the finished file equals an uninterrupted run's.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import h5py

from probe.errors import ConfigError, DataError
from probe.plan import config_values
from probe.store import stats_file
from probe.store.fileformat import (
    FORMAT_VERSION,
    Progress,
    captured,
    encode,
    is_scale,
    layer_path,
    read_progress,
    row_unit,
    write_progress,
)
from probe.store.runfile import open_probe_file

# The parts of the resolved config that decide the values in the file.
COMPARED = (
    "model",
    "dataset",
    "probes",
    "objective",
    "store",
    "seed",
    "train_mode",
    "precision",
    "intervene",
)
IGNORED = {"store": ("queue_batches", "flush_seconds")}  # change speed, not values
EXAMPLES = ("topk", "bottomk", "topk_quantiles")  # stats.* that decide what /topk holds


def _values_part(config: dict) -> dict:
    part = {k: config.get(k) for k in COMPARED}
    part["stats"] = {k: (config.get("stats") or {}).get(k, 0) for k in EXAMPLES}
    for section, keys in IGNORED.items():
        values = part.get(section)
        if isinstance(values, dict):
            part[section] = {k: v for k, v in values.items() if k not in keys}
    return part


def _differences(old, new, prefix: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new), key=str):
            out += _differences(old.get(k), new.get(k), f"{prefix}{k}.")
        return out
    return [] if old == new else [f"{prefix.rstrip('.')}: {old!r} in the file, {new!r} now"]


def check_resumable(path: Path, config: str) -> bool:
    """True when `path` holds a run of the same config (its YAML text, as the file's `config`
    attribute holds it: probe.plan.RunPlan.text) to continue; False when there is no file.

    A file of another config, or one that cannot be read, is an error: resuming it would mix runs.
    """
    if not path.exists():
        return False
    with open_probe_file(path) as f:
        stored = f.attrs.get("config")
    if stored is None:
        raise DataError(f"{str(path)!r} has no config attribute, so it cannot be resumed")
    old = _values_part(config_values(str(stored)))
    new = _values_part(config_values(config))
    diff = _differences(old, new)
    if diff:
        shown = "; ".join(diff[:5]) + ("; ..." if len(diff) > 5 else "")
        raise ConfigError(
            f"resume=true but the config differs from the one {str(path)!r} was written with "
            f"({shown}); resume with the same settings, or choose a new hydra.run.dir"
        )
    return True


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file's bytes, read in 1 MiB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for piece in iter(lambda: fh.read(1 << 20), b""):
            h.update(piece)
    return h.hexdigest()


def check_identity(path: Path, identity: dict[str, str]) -> None:
    """Refuse to resume when the checkpoint's or the dataset's contents differ from those the
    file was written with (same paths, other weights or data): the rows would mix two runs."""
    with open_probe_file(path) as f:
        stored = {k: str(f.attrs[k]) for k in identity if k in f.attrs}
    for key, value in identity.items():
        old = stored.get(key)
        if old is None or old == value:
            continue
        what = "model.checkpoint" if key == "checkpoint_sha256" else "the dataset"
        if key == "dataset_identity":
            old, value = (json.loads(v).get("hash", v) for v in (old, value))
            if old == value:
                continue
        raise ConfigError(
            f"resume=true but the contents of {what} changed since {str(path)!r} was written "
            f"({key}: {old[:16]}... in the file, {value[:16]}... now); resume with the same "
            "files, or start a new run (overwrite=true or a new hydra.run.dir)"
        )


def restore_rows(sink) -> None:
    """Bring a Sink opened on an existing file back to the state of its last flush: its counts,
    its captures' layout in the run's order, its row datasets cut to the counts, the coverage;
    each fold restores its own values (probe.store.folds)."""
    f, rows = sink.file, sink.rows
    progress = read_progress(f)
    finished = progress.complete  # only summarised again: not a resumption
    rows.num_samples, rows.num_batches = progress.samples, progress.batches
    rows.num_tokens = progress.tokens
    saved = stats_file.read(f)
    for info in stats_file.described(f):
        key = (info.layer, info.site)
        if key in saved:  # (a stats-only capture's layout is in /stats alone)
            info.shape, info.dtype = saved[key].shape, saved[key].dtype
        rows.datasets[key] = info
        rows.orders[key] = len(rows.orders)
    for name in _stored_arrays(f):
        ds = f[name]
        if ds.maxshape[0] is not None:  # written once whole (a lens's first samples' top-k)
            rows.known.add(name)
            continue
        unit = row_unit(ds.attrs, name)
        valid = {"batches": rows.num_batches, "tokens": rows.num_tokens}.get(unit, rows.num_samples)
        if ds.shape[0] < valid and not name.startswith("layers/"):
            raise DataError(
                f"{str(sink.path)!r}: {name} has {ds.shape[0]} rows but the file says {valid} were "
                "written; the file is damaged, start a new run without resume=true"
            )
        ds.resize(min(valid, ds.shape[0]), axis=0)
        rows.known.add(name)
    for key, info in rows.datasets.items():
        valid = rows.valid(info)
        ds = f.get(layer_path(*key))
        rows.coverage.restore(f, key, min(valid, len(ds)) if ds is not None else valid)
    if "scalars" not in _first_stats_group(f):
        if "stats" in f:
            del f["stats"]  # a version 1 file: its statistics are rewritten in the new layout
    else:
        groups = (f"stats/{encode(a)}/{encode(b)}" for a, b in rows.datasets)
        rows.known.update(g for g in groups if g in f)
    rows.known.update(d for d in ("sample", "token", "batch") if d in f)
    sink.progress = Progress(
        rows.num_samples, rows.num_batches, rows.num_tokens, False, progress.stats_slot
    )
    f.attrs["complete"] = False
    f.attrs["format_version"] = FORMAT_VERSION
    if not finished:
        f.attrs["resumes"] = int(f.attrs.get("resumes", 0)) + 1
    write_progress(f, sink.progress)


def _first_stats_group(f: h5py.File) -> h5py.Group | dict:
    for _, group in captured(f.get("stats", {})):
        for _, g in captured(group):
            return g
    return {"scalars": None}


def _stored_arrays(f: h5py.File) -> list[str]:
    names: list[str] = []
    for top in ("layers", "samples", "model", "tokens", "effects", "patching", "lens", "dla"):
        if top in f:
            f[top].visititems(
                lambda n, o, top=top: (
                    names.append(f"{top}/{n}")
                    if isinstance(o, h5py.Dataset) and not is_scale(o) or n == "index"
                    else None
                )
            )
    return names
