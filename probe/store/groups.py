"""Keyed groups in a run's file: per key (a prompt, for its attribution graph) rows of a few
column tables, appended one key at a time after the run's loop and whole once the key's index
row is written.

A kind (`GroupKind`) names its root (`/graph`), its tables and their columns, the index table
that holds one row per key (written last) and its spans: columns of the index that say where a
key's rows lie in another table (`node_start`, `nodes`). Every column is one chunked, resizable
dataset. One rule for every kind: opened again to append (a resumed run), rows past the last
whole key (a write cut short) are cut off; under torchrun, the ranks' groups are concatenated in
rank order (`concatenate`), each key's spans moved by the rows before it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import h5py
import numpy as np

CHUNK_ROWS = 1 << 14


@dataclass(frozen=True)
class GroupKind:
    """The layout of one kind of keyed group. `tables`: columns and dtypes by table; `index`:
    the table of one row per key, `key` its column naming the key; `spans`: for each other
    table, the index's (start, count) columns of a key's rows there; `attrs`: attributes of the
    tables (a code list); `format`: the root's `format` attribute."""

    root: str
    tables: Mapping[str, Mapping[str, object]]
    index: str
    key: str
    spans: Mapping[str, tuple[str, str]]
    format: str
    attrs: Mapping[str, Mapping[str, object]] = field(default_factory=dict)


class GroupTables:
    """One kind's group of an open h5py file, to append keys to: a new group (replacing one
    there unless `keep`) with the attributes `attrs`, or the one there, cut to its whole keys."""

    def __init__(self, file: h5py.File, kind: GroupKind, attrs: Mapping[str, object],
                 keep: bool = True) -> None:  # fmt: skip
        self.file, self.kind = file, kind
        if kind.root in file and not keep:
            del file[kind.root]
        if kind.root not in file:
            self.group = _new_group(file, kind, attrs)
        else:
            self.group = file[kind.root]
            cut_to_whole_keys(self.group, kind)
        file.flush()

    @property
    def keys(self) -> list[int]:
        """The keys the group holds, in the order they were written."""
        return [int(k) for k in self.group[f"{self.kind.index}/{self.kind.key}"][:]]

    def append(
        self, row: Mapping[str, object], tables: Mapping[str, Mapping[str, np.ndarray]]
    ) -> None:
        """One key: its rows of each table first, its index row (`row`, the spans filled in)
        last, each flushed, so the key is in the file once its index row is."""
        g, kind = self.group, self.kind
        row = dict(row)
        for table, (start, count) in kind.spans.items():
            columns = tables[table]
            row[start] = len(g[f"{table}/{next(iter(kind.tables[table]))}"])
            row[count] = len(next(iter(columns.values())))
        for table in kind.spans:
            _extend(g[table], tables[table])
        self.file.flush()
        _extend(g[kind.index], {k: np.array([v]) for k, v in row.items()})
        self.file.flush()

    def mark(self, complete: bool) -> None:
        """Say in the group whether it holds every key of its run."""
        self.group.attrs["complete"] = bool(complete)


def _new_group(file: h5py.File, kind: GroupKind, attrs: Mapping[str, object]) -> h5py.Group:
    g = file.create_group(kind.root)
    g.attrs["format"] = kind.format
    g.attrs["complete"] = False
    for k, v in attrs.items():
        g.attrs[k] = v
    for table, columns in kind.tables.items():
        t = g.create_group(table)
        for name, dtype in columns.items():
            t.create_dataset(name, (0,), dtype=dtype, maxshape=(None,), chunks=(CHUNK_ROWS,))
        for k, v in kind.attrs.get(table, {}).items():
            t.attrs[k] = v
    return g


def _extend(table: h5py.Group, columns: Mapping[str, np.ndarray]) -> None:
    for name, values in columns.items():
        ds = table[name]
        if ds.dtype.kind == "O":  # (h5py writes variable-length strings from objects)
            values = np.asarray(values, dtype=object)
        start = len(ds)
        ds.resize(start + len(values), axis=0)
        if len(values):
            ds[start:] = values


def cut_to_whole_keys(g: h5py.Group, kind: GroupKind) -> None:
    """Rows written after the last whole key's (its index row is written last) removed."""
    index = g[kind.index]
    n = min(len(index[c]) for c in kind.tables[kind.index])
    ends = {kind.index: n}
    for table, (start, count) in kind.spans.items():
        ends[table] = int(index[start][n - 1] + index[count][n - 1]) if n else 0
    for table, end in ends.items():
        for ds in g[table].values():
            ds.resize(min(end, len(ds)), axis=0)


def read_columns(table: h5py.Group, start: int, count: int) -> dict[str, np.ndarray]:
    """Rows [start, start + count) of every column of a table (strings decoded)."""
    out = {}
    for name, ds in table.items():
        values = ds[start : start + count]
        out[name] = ds.asstr()[start : start + count] if ds.dtype.kind == "O" else values
    return out


def iter_keys(g: h5py.Group, kind: GroupKind) -> Iterator[tuple[dict, dict[str, dict]]]:
    """(index row, each spanned table's columns) of every key of a group, one key in memory at
    a time, in the order they were written."""
    index = g[kind.index]
    n = len(index[kind.key])
    for i in range(n):
        row = {name: _item(ds, i) for name, ds in index.items()}
        tables = {
            table: read_columns(g[table], int(row[start]), int(row[count]))
            for table, (start, count) in kind.spans.items()
        }
        yield row, tables


def _item(ds: h5py.Dataset, i: int):
    return ds.asstr()[i] if ds.dtype.kind == "O" else ds[i]


def concatenate(out: h5py.File, kind: GroupKind, sources: list[h5py.File]) -> int:
    """Every key of the sources' groups of `kind`, in order, appended to a new group in `out`
    (torchrun: the ranks' files into the run's), its attributes the first source's; complete
    when every source's is. Returns the number of keys; no group when no source holds one."""
    present = [f[kind.root] for f in sources if kind.root in f]
    if not present:
        return 0
    attrs = {k: v for k, v in present[0].attrs.items() if k not in ("format", "complete")}
    tables = GroupTables(out, kind, attrs, keep=False)
    count = 0
    for g in present:
        for row, spanned in iter_keys(g, kind):
            kept = {k: v for k, v in row.items() if k not in _span_columns(kind)}
            tables.append(kept, spanned)
            count += 1
    tables.mark(all(bool(g.attrs.get("complete", False)) for g in present))
    return count


def _span_columns(kind: GroupKind) -> set[str]:
    return {c for pair in kind.spans.values() for c in pair}
