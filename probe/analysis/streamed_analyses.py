"""Linear probes and CKA over a run's captures, streamed; `python -m probe.analyze PATH linear|cka`.

The run's file is read once, in slabs of whole chunks, into a float32 scratch file of features per
sample; the probes (probe.analysis.linear_probe) and the CKA passes (probe.analysis.cka) then stream
windows of it, so memory is bounded by `--memory`, never by the number of samples. What is read and
what is skipped: docs/analyses.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path

import numpy as np
import pandas as pd

from probe.analysis.cka import (
    CountSketch,
    Features,
    SourceMoments,
    cross_cka_table,
    draw_run,
    draw_sweep,
    run_cka_table,
    sketch_seed,
)
from probe.analysis.linear_probe import LINEAR_COLUMNS, run_table
from probe.errors import ConfigError, DataError, ProbeError
from probe.read import slabs as slab_reads
from probe.read.runs import open_run
from probe.read.summaries import is_sweep, read_overrides, sweep_runs, write_table
from probe.read.train_steps import is_watched_run, probe_batch_sweep
from probe.store.fileformat import is_per_batch, layer_path

log = logging.getLogger("probe")


@dataclass
class Options:
    """What the analyses read and how: see `python -m probe.analyze --help`."""

    test_fraction: float = 0.2
    seed: int = 0
    ridge: float = 1e-3
    features: str = "pool"  # or "flatten"
    max_features: int = 2048
    memory_mb: float = 512.0
    layers: tuple[str, ...] = ()
    sites: tuple[str, ...] = ()
    tmp: Path | None = None
    window_rows: int | None = None  # rows per window of cached features (default: from memory)
    slab_bytes: int | None = None  # bytes per slab of the file (default: from memory)
    control: bool = False  # token rows: Hewitt and Liang's control task and selectivity
    probe: str = "linear"  # or mlp: also a one-hidden-layer probe

    @property
    def budget(self) -> int:
        return int(self.memory_mb * 2**20)

    def wanted(self, layer: str, site: str) -> bool:
        return (not self.layers or any(fnmatchcase(layer, p) for p in self.layers)) and (
            not self.sites or any(fnmatchcase(site, p) for p in self.sites)
        )


@dataclass
class Item:
    """One (layer, site) extracted into the scratch file."""

    layer: str
    site: str
    features: Features
    offset: int
    reduce: str
    usable: np.ndarray  # rows whose features are all finite

    @property
    def width(self) -> int:
        return self.features.width


@dataclass
class RunColumns:
    """Every sample-row (layer, site) of one run as columns per sample (the inputs of probes and
    CKA), in a scratch file."""

    path: Path
    options: Options
    rows: int = 0
    complete: bool = True
    index: np.ndarray | None = None
    targets: np.ndarray | None = None
    items: list[Item] = field(default_factory=list)
    token_keys: list[tuple[str, str]] = field(default_factory=list)  # token rows, with labels

    def __post_init__(self) -> None:
        self.name = self.path.name
        self.scratch = tempfile.TemporaryFile(dir=self.options.tmp)  # noqa: SIM115 (closed in close())
        try:
            self._extract()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.scratch.close()

    def _extract(self) -> None:
        with open_run(self.path) as run:
            self.rows, self.complete = run.num_samples, run.complete
            if not run.complete:
                log.warning("%s is partial: analysing its %d valid rows", run.h5_path, self.rows)
            for name in ("index", "target"):
                if f"samples/{name}" in run.file:
                    ds = run.file[f"samples/{name}"]
                    setattr(self, "index" if name == "index" else "targets", ds[: self.rows])
            for layer, site in run.keys:
                if not self.options.wanted(layer, site) or layer_path(layer, site) not in run.file:
                    continue
                array = run.array(layer, site)
                ds = array.ds
                if ds.attrs.get("CLASS") == b"DIMENSION_SCALE":  # names an axis, holds no rows
                    continue
                if is_per_batch(ds.attrs, site):
                    log.info("%s %s: one row per batch, not per sample: skipped", layer, site)
                elif ds.attrs.get("row_unit") == "tokens" and "tokens/label" in run.file:
                    self.token_keys.append((layer, site))
                elif ds.attrs.get("row_unit") == "tokens":
                    log.info(
                        "%s %s: one row per token and no /tokens/label: skipped (label the "
                        "tokens, dataset.word_labels_field, or capture reduce: token_mean)",
                        layer,
                        site,
                    )
                else:
                    self.items.append(self._extract_one(layer, site, ds, array.valid))

    def _extract_one(self, layer: str, site: str, ds, valid: int) -> Item:
        opts, shape = self.options, ds.shape[1:]
        unit = int(ds.attrs.get("unit_axis", 1))
        if len(shape) <= 1:
            axes, source, reduce = None, int(np.prod(shape, dtype=np.int64)), "none"
        elif opts.features == "flatten" or not 1 <= unit <= len(shape):
            axes, source, reduce = None, int(np.prod(shape, dtype=np.int64)), "flatten"
        else:
            axes = tuple(a for a in range(1, len(shape) + 1) if a != unit)
            source, reduce = shape[unit - 1], "mean" + str(axes).replace(" ", "")
        sketch = None
        if source > opts.max_features:
            seed = sketch_seed(opts.seed, self.name, layer, site)
            sketch, moments = CountSketch(source, opts.max_features, seed), SourceMoments()
            log.info(
                "%s %s: %d features count-sketched to %d", layer, site, source, opts.max_features
            )
        width = opts.max_features if sketch else source
        offset = self.scratch.seek(0, os.SEEK_END)
        usable = np.ones(valid, dtype=bool)
        total, lo = np.zeros(width), 0
        # the float64 features and the sketch take up to 8 slabs: budget/32 a slab keeps them in budget/4
        slab_bytes = opts.slab_bytes or min(slab_reads.SLAB_BYTES, max(1 << 20, opts.budget // 32))
        for slab in slab_reads.slabs(ds, valid, slab_bytes):
            if axes is None:
                f = slab.reshape(len(slab), -1).astype(np.float64)
            else:
                f = slab.mean(axis=axes, dtype=np.float64)
            finite = np.isfinite(f).all(axis=1)
            if not finite.all():
                usable[lo : lo + len(f)] = finite
                f[~finite] = 0.0
            if sketch is not None:
                moments.update(f if finite.all() else f[finite])
                f = sketch(f)
            total += f.sum(axis=0)  # rows left out are zeros
            _write_all(self.scratch.fileno(), np.ascontiguousarray(f, dtype=np.float32))
            lo += len(f)
        if not usable.all():
            log.warning("%s %s: %d rows hold NaN or Inf: left out", layer, site, (~usable).sum())
        feats = Features((self.name, layer, site), width, total / max(1, usable.sum()))
        if sketch is not None:
            feats.sketched, feats.source_width, feats.counted = True, source, moments.n
            feats.trace, feats.diag_sq = moments.terms()
        return Item(layer, site, feats, offset, reduce, usable)

    def read(self, item: Item, lo: int, hi: int) -> np.ndarray:
        """Rows [lo, hi) of an item's features (float32)."""
        out = np.empty((hi - lo, item.width), dtype=np.float32)
        view, where = out.data.cast("B"), item.offset + lo * item.width * 4
        while view.nbytes:
            got = os.preadv(self.scratch.fileno(), [view], where)
            if got <= 0:
                raise DataError(f"the scratch file of {self.path} ended early")
            view, where = view[got:], where + got
        return out

    def windows(self, item: Item, step: int):
        for lo in range(0, len(item.usable), step):
            yield lo, self.read(item, lo, min(len(item.usable), lo + step))

    def step(self, width: int) -> int:
        return self.options.window_rows or max(1, (self.options.budget // 8) // (12 * width))

    @property
    def usable(self) -> np.ndarray:
        """Rows usable by every item (CKA compares rows across items)."""
        out = np.ones(self.rows, dtype=bool)
        for item in self.items:
            out[: len(item.usable)] &= item.usable
            out[len(item.usable) :] = False
        return out


def _write_all(fd: int, array: np.ndarray) -> None:
    view = array.data.cast("B")
    while view.nbytes:
        view = view[os.write(fd, view) :]


def linear_table(rf: RunColumns) -> pd.DataFrame | None:
    """The probes of the sample rows (with /samples/target) and of the token rows (with
    /tokens/label) in one table; None when neither has labels."""
    tables = [t for t in [run_table(rf)] if t is not None]
    if rf.token_keys:
        from probe.analysis.token_probe import token_rows

        found = []
        with open_run(rf.path) as run:
            for layer, site in rf.token_keys:
                row = token_rows(run, layer, site, rf.options)
                if row is not None:
                    found.append({"run": rf.name, "layer": layer, "site": site, **row})
        if found:
            tables.append(pd.DataFrame(found, columns=LINEAR_COLUMNS))
    return pd.concat(tables, ignore_index=True) if tables else None


# -- runs and sweeps ---------------------------------------------------------------------------
def analyze_run(path: Path, what: set[str], options: Options) -> dict[str, pd.DataFrame]:
    """Write linear_probes.csv and/or cka.csv (+ cka.png) beside the run's summary.csv."""
    rf = RunColumns(path, options)
    try:
        return _write_run(rf, what)
    finally:
        rf.close()


def _write_run(rf: RunColumns, what: set[str]) -> dict[str, pd.DataFrame]:
    out = {}
    if "linear" in what and (table := linear_table(rf)) is not None:
        write_table(table, rf.path / "linear_probes")
        out["linear"] = table
    if "cka" in what and len(rf.items) >= 2:
        table = run_cka_table(rf)
        write_table(table, rf.path / "cka")
        draw_run(table, rf, rf.path / "cka.png")
        out["cka"] = table
    elif "cka" in what:
        log.info("%s: fewer than two sample-row captures: no CKA table", rf.path)
    return out


def analyze_sweep(path: Path, what: set[str], options: Options) -> dict[str, pd.DataFrame]:
    """Every run's tables, and at the sweep's root one linear table (run and override columns)
    and one table of CKA between the same (layer, site) of every two runs."""
    runs: list[RunColumns] = []
    linear: list[pd.DataFrame] = []
    try:
        for run_dir in sweep_runs(path):
            try:
                rf = RunColumns(run_dir, options)
            except (DataError, OSError) as e:
                log.warning("%s: not analysed (%s)", run_dir, e)
                continue
            try:
                tables = _write_run(rf, what)
            except BaseException:
                rf.close()
                raise
            if "linear" in tables:
                table = tables["linear"]
                for i, (key, value) in enumerate(read_overrides(run_dir).items()):
                    table.insert(1 + i, key, value)
                linear.append(table)
            if "cka" in what:
                runs.append(rf)
            else:
                rf.close()
        out = {}
        if linear:
            out["linear"] = pd.concat(linear, ignore_index=True)
            write_table(out["linear"], path / "linear_probes")
        cross = [cross_cka_table(a, b) for i, a in enumerate(runs) for b in runs[i + 1 :]]
        cross = [t for t in cross if t is not None and not t.empty]
        if cross:
            out["cka"] = pd.concat(cross, ignore_index=True)
            write_table(out["cka"], path / "cka")
            draw_sweep(out["cka"], path / "cka.png")
        return out
    finally:
        for rf in runs:
            rf.close()


def analyze(path: Path | str, what: set[str] | str, options: Options | None = None):
    """Analyse a run directory (or its probe.h5) or a sweep directory; returns the tables. A
    watched training is analysed through its probe-batch runs, a sweep over its steps."""
    path, options = Path(path), options or Options()
    what = {"linear", "cka"} if what == "all" else {what} if isinstance(what, str) else set(what)
    if not what or not what <= {"linear", "cka"}:
        raise ConfigError(f"analyses {sorted(what)}: choose linear, cka or all")
    if 16 * options.max_features**2 > options.budget:  # a probe's fit: 2 features^2 float64
        log.warning(
            "a linear probe over %d features takes %.0f MB, more than --memory %g",
            options.max_features,
            16 * options.max_features**2 / 2**20,
            options.memory_mb,
        )
    if path.is_file():
        path = path.parent
    if (path / "probe.h5").is_file() and is_watched_run(path):
        steps = probe_batch_sweep(path)  # its probe batch at each step: a sweep over steps
        if steps is None or not sweep_runs(steps):
            raise DataError(
                f"{str(path)!r} is a watched training without probe-batch runs: the analyses "
                "read captures; watch with probe_batch= to have them at steps of the training"
            )
        return analyze_sweep(steps, what, options)
    if (path / "probe.h5").is_file():
        return analyze_run(path, what, options)
    if path.is_dir() and is_sweep(path):
        return analyze_sweep(path, what, options)
    raise DataError(f"{str(path)!r} is neither a run directory (probe.h5) nor a sweep directory")


def hand_back_freed_slabs() -> None:
    """Have glibc map every allocation of 1 MB and up apart, so that a freed slab goes back to
    the system: by default, once a block that large is freed, blocks up to 32 MB come from the
    heap, which keeps the freed ones resident (measured: 68 MB of freed slabs still resident
    after reading a file at a 128 MB bound, against 14 MB with this)."""
    try:
        import ctypes

        ctypes.CDLL(None).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD; absent outside glibc
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="python -m probe.analyze",
        description="Linear probes (linear_probes.csv) and CKA (cka.csv, cka.png) of a run or sweep.",
    )
    parser.add_argument("path", type=Path, help="a run directory, its probe.h5, or a sweep")
    parser.add_argument("analysis", nargs="?", default="all", choices=["linear", "cka", "all"])
    parser.add_argument("--test-fraction", type=float, default=0.2, help="held-out share (0.2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split and sketches")
    parser.add_argument("--ridge", type=float, default=1e-3, help="ridge on standardised features")
    parser.add_argument(
        "--features", choices=["pool", "flatten"], default="pool",
        help="pool: mean over all axes but the unit axis (default); flatten: every value",
    )  # fmt: skip
    parser.add_argument("--max-features", type=int, default=2048, help="wider: count-sketched")
    parser.add_argument("--memory", type=float, default=512.0, help="working memory bound, MB")
    parser.add_argument("--layers", nargs="*", default=[], help="fnmatch globs of layers")
    parser.add_argument("--sites", nargs="*", default=[], help="fnmatch globs of sites")
    parser.add_argument("--tmp", type=Path, default=None, help="folder of the scratch files")
    parser.add_argument(
        "--control", action="store_true",
        help="token rows: also a control task (a random label per word type) and selectivity",
    )  # fmt: skip
    parser.add_argument(
        "--probe", choices=["linear", "mlp"], default="linear",
        help="mlp: also a one-hidden-layer probe beside the closed-form linear one",
    )  # fmt: skip
    args = parser.parse_args(argv)
    hand_back_freed_slabs()
    if not logging.getLogger().handlers and not log.handlers:
        logging.basicConfig(level=logging.INFO, format="probe.analyze: %(message)s")
    options = Options(
        args.test_fraction, args.seed, args.ridge, args.features, args.max_features, args.memory,
        tuple(args.layers), tuple(args.sites), args.tmp, control=args.control, probe=args.probe,
    )  # fmt: skip
    try:
        if not 0 < options.test_fraction < 1 or options.max_features < 1 or options.memory_mb <= 0:
            raise ConfigError(
                "--test-fraction must lie in (0, 1), --max-features and --memory above 0"
            )
        tables = analyze(args.path, args.analysis, options)
    except ProbeError as e:
        print(f"probe.analyze: error: {e}", file=sys.stderr)
        return 1
    for name, table in tables.items():
        print(f"{args.path}: {name}: {len(table)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
