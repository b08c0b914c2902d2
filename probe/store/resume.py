"""Continue an interrupted run: check its config, cut the file back to the last complete batch,
and restore the streaming statistics so the finished file equals an uninterrupted run's.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import h5py
import numpy as np

from probe.errors import ConfigError, DataError
from probe.plan import config_values
from probe.stats import backend
from probe.stats.running import stats_for
from probe.stats.topk import TopKState
from probe.store import stats_file
from probe.store.coverage import seen_ranges
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
from probe.store.sparse_rows import stored_rows

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
        if isinstance(part.get(section), dict):
            part[section] = {k: v for k, v in part[section].items() if k not in keys}
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


def restore(writer, batch_rows: int) -> None:
    """Bring a ProbeWriter opened on an existing file back to the state of its last flushed batch."""
    f = writer.file
    progress = read_progress(f)
    finished = progress.complete  # only summarised again: not a resumption
    writer.num_samples, writer.num_batches = progress.samples, progress.batches
    writer.num_tokens = progress.tokens
    for info in stats_file.described(f):
        writer.datasets[(info.layer, info.site)] = info
    saved = stats_file.read(f)
    for name in _stored_arrays(f):
        ds = f[name]
        if ds.maxshape[0] is not None:  # written once whole (a lens's first samples' top-k)
            writer.known.add(name)
            continue
        unit = row_unit(ds.attrs, name)
        rows = {"batches": writer.num_batches, "tokens": writer.num_tokens}.get(
            unit, writer.num_samples
        )
        if ds.shape[0] < rows and not name.startswith("layers/"):
            raise DataError(
                f"{str(writer.path)!r}: {name} has {ds.shape[0]} rows but the file says {rows} were "
                "written; the file is damaged, start a new run without resume=true"
            )
        ds.resize(min(rows, ds.shape[0]), axis=0)
        writer.known.add(name)
    for key, info in writer.datasets.items():
        rows = writer.num_batches if info.per_batch else writer.num_samples
        rows = writer.num_tokens if info.rows == "tokens" else rows
        ds = f.get(layer_path(*key))
        writer.coverage.restore(f, key, min(rows, len(ds)) if ds is not None else rows)
        hist = f.get(f"stats/{encode(key[0])}/{encode(key[1])}/hist")
        writer.hist_capacity[key] = hist.shape[-1] if hist is not None else 0
    if "scalars" not in _first_stats_group(f):
        if "stats" in f:
            del f["stats"]  # a version 1 file: its statistics are rewritten in the new layout
    else:
        groups = (f"stats/{encode(a)}/{encode(b)}" for a, b in writer.datasets)
        writer.known.update(g for g in groups if g in f)
    writer.known.update(d for d in ("sample", "token", "batch") if d in f)
    writer.progress = Progress(
        writer.num_samples, writer.num_batches, writer.num_tokens, False, progress.stats_slot
    )
    f.attrs["complete"] = False
    f.attrs["format_version"] = FORMAT_VERSION
    if not finished:
        f.attrs["resumes"] = int(f.attrs.get("resumes", 0)) + 1
    write_progress(f, writer.progress)
    f.flush()
    # readable from here on: a kill while statistics are recomputed below (reads only, seconds
    # for a long run) leaves a file in SWMR mode, which readers open
    writer.out.go_live()
    if writer.stats_during != "run":  # computed at close from every row, or not at all
        return
    for key, info in writer.datasets.items():
        _restore_stats(writer, key, info, valid_rows(writer, info), saved.get(key), batch_rows)


def valid_rows(writer, info) -> int:
    """How many rows of a dataset the writer has written: batches, tokens or samples."""
    rows = writer.num_batches if info.per_batch else writer.num_samples
    return writer.num_tokens if info.rows == "tokens" else rows


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


def _restore_stats(writer, key, info, rows: int, stored, batch_rows: int) -> None:
    """From /stats when they cover exactly the kept rows, else recomputed batch by batch from them."""
    slots = "progress" in writer.file  # whole by construction: published with the counts
    if stored is not None and (slots or stored.stats.rows == rows - _unseen(writer, key)):
        info.stats, info.shape, info.dtype = stored.stats, stored.shape, stored.dtype
        info.topk = stored.topk
        return
    ds = stored_rows(writer.file, *key)
    if ds is None:
        raise DataError(
            f"{str(writer.path)!r} holds no statistics for the {rows} rows of {key[0]} {key[1]} "
            "that agree with each other, and no stored rows to recompute them from (a "
            "store.mode=stats run killed while it rewrote them); start a new run without "
            "resume=true"
        )
    recompute(writer, key, info, rows, batch_rows)


def recompute(writer, key, info, rows: int, batch_rows: int) -> None:
    """`info.stats` from the first `rows` stored rows of (layer, site), folded batch by batch as
    the run would have (stats.during=close, and a resume whose /stats do not cover its rows)."""
    ds = stored_rows(writer.file, *key)
    info.stats = stats_for(info.module_type, key[1], info.stats.unit_axis)
    examples = writer.topk is not None and not info.per_batch
    info.topk = TopKState(writer.topk) if examples else None
    seen = seen_ranges(writer.file, key[0], key[1], min(rows, len(ds)))
    for lo, hi in _batch_rows(writer, info, rows, batch_rows):
        for a, b in seen:
            if max(lo, a) < min(hi, b):
                block = ds[max(lo, a) : min(hi, b)]
                backend.fold(info.stats, block)
                if examples:
                    _fold_examples(writer, info, block, max(lo, a))
    info.shape, info.dtype = tuple(ds.shape[1:]), str(ds.dtype)


def _fold_examples(writer, info, block: np.ndarray, lo: int) -> None:
    """A block of stored rows' examples per unit, their keys from /samples/index or /tokens/*
    (a capture of token positions per sample cannot tell its padding apart: rows: tokens can)."""
    import torch

    from probe.hooks.batch_topk import POSITION_BITS, partial, stored_keys

    f, n = writer.file, len(block)
    if info.rows == "tokens":
        inner = int(np.prod(block.shape[1:], dtype=np.int64)) // block.shape[info.stats.unit_axis]
        sample = f["tokens/sample"][lo : lo + n].astype(np.int64)
        base = sample * (1 << POSITION_BITS) + f["tokens/position"][lo : lo + n] * inner
    else:
        base = f["samples/index"][lo : lo + n].astype(np.int64) * (1 << POSITION_BITS)
    found = stored_keys(torch.from_numpy(block), info.stats.unit_axis, torch.from_numpy(base))
    kinds = partial(*found, writer.topk)
    info.topk.merge({kind: (v.numpy(), k.numpy()) for kind, (v, k) in kinds.items()})


def _unseen(writer, key) -> int:
    return sum(b - a for a, b in writer.coverage.gaps.get(key, []))


def _batch_rows(writer, info, rows: int, batch_rows: int) -> list[tuple[int, int]]:
    """The [lo, hi) rows of each batch: the statistics merge batch by batch, as the run did."""
    if info.per_batch:
        return [(b, b + 1) for b in range(rows)]
    if info.rows != "tokens":
        return [(lo, min(lo + batch_rows, rows)) for lo in range(0, rows, batch_rows)]
    samples = writer.file["tokens/sample"][:rows] - writer.index_offset
    edges = np.searchsorted(samples, np.arange(0, writer.num_samples + batch_rows, batch_rows))
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:], strict=True) if b > a]
