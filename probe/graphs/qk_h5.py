"""The /graph_qk layout in a run's probe.h5: each prompt's QK attribution table
(probe.graphs.qk_attribution), appended as the prompt's graph is made (a keyed group of the
run's sink, probe.store.groups, as /graph), and graph_qk.csv written from it.

    /graph_qk             attrs: format, complete
    /graph_qk/prompts/*   one row per prompt: prompt, row_start, rows
    /graph_qk/rows/*      one row per table row: prompt and QK_COLUMNS

A prompt's rows are rows [row_start, row_start + rows) of /graph_qk/rows; its prompts row is
written last and flushed, so a prompt is in the group once that row is.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np
import pandas as pd

from probe.graphs.graph_data import QK_COLUMNS
from probe.store.groups import GroupKind, GroupTables, read_columns

GROUP = "graph_qk"
QK_CSV = "graph_qk.csv"
STR = h5py.string_dtype()
ROW_COLUMNS = {
    "prompt": np.int64, "layer": np.int64, "head": np.int64, "query_pos": np.int64,
    "key_pos": np.int64, "query_node": np.int64, "key_node": np.int64, "query_part": STR,
    "key_part": STR, "contribution": np.float64, "score": np.float64, "pattern": np.float64,
}  # fmt: skip
QK_GRAPH = GroupKind(
    root=GROUP,
    tables={"prompts": {"prompt": np.int64, "row_start": np.int64, "rows": np.int64},
            "rows": ROW_COLUMNS},
    index="prompts", key="prompt", spans={"rows": ("row_start", "rows")},
    format="probe-graph-qk 1",
)  # fmt: skip


def append_qk(tables: GroupTables, prompt: int, table: pd.DataFrame) -> None:
    """Prompt `prompt`'s QK table as its rows of /graph_qk (its prompts row last)."""
    n = len(table)
    columns = {"prompt": np.full(n, prompt, np.int64)}
    for name, dtype in ROW_COLUMNS.items():
        if name != "prompt":
            values = table[name].to_numpy()
            columns[name] = (
                np.array(values.tolist(), dtype=object) if dtype is STR else values.astype(dtype)
            )
    tables.append({"prompt": prompt}, {"rows": columns})


def iter_qk(path: Path) -> Iterator[tuple[int, pd.DataFrame]]:
    """(prompt, its QK table) of every prompt in `path`'s /graph_qk, in the order written; none
    where the file has no /graph_qk."""
    with h5py.File(path, "r") as f:
        if GROUP not in f:
            return
        g = f[GROUP]
        prompts = read_columns(g["prompts"], 0, len(g["prompts/prompt"]))
        for prompt, start, count in zip(prompts["prompt"], prompts["row_start"], prompts["rows"],
                                        strict=True):  # fmt: skip
            yield int(prompt), _frame(read_columns(g["rows"], int(start), int(count)))


def read_qk(path: Path, prompt: int) -> pd.DataFrame | None:
    """Prompt `prompt`'s QK table in `path` (None: the file holds none for it), its rows alone
    read."""
    with h5py.File(path, "r") as f:
        if GROUP not in f:
            return None
        g = f[GROUP]
        prompts = read_columns(g["prompts"], 0, len(g["prompts/prompt"]))
        match = np.flatnonzero(prompts["prompt"] == prompt)
        if not len(match):
            return None
        i = int(match[-1])
        return _frame(read_columns(g["rows"], int(prompts["row_start"][i]),
                                   int(prompts["rows"][i])))  # fmt: skip


def write_qk(f: h5py.File, prompt: int, table: pd.DataFrame) -> None:
    """`table` as prompt `prompt`'s QK table in a new /graph_qk of the open file `f` (a graph
    saved alone: probe.graphs.graph_h5.write_graph)."""
    tables = GroupTables(f, QK_GRAPH, {}, keep=False)
    append_qk(tables, prompt, table)
    tables.mark(True)


def _frame(columns: dict) -> pd.DataFrame:
    table = pd.DataFrame({c: columns[c] for c in QK_COLUMNS})
    for c in ("query_part", "key_part"):
        table[c] = [v.decode() if isinstance(v, bytes) else str(v) for v in table[c]]
    return table


def write_qk_csv(h5_path: Path, run_dir: Path) -> Path | None:
    """graph_qk.csv (prompt and QK_COLUMNS) from the run's /graph_qk, one prompt in memory at a
    time; None (no file) where the run made no QK attribution."""
    with h5py.File(h5_path, "r") as f:
        if GROUP not in f:
            return None
    path = Path(run_dir) / QK_CSV
    with open(path, "w", newline="") as out:
        pd.DataFrame(columns=["prompt", *QK_COLUMNS]).to_csv(out, index=False)
        for prompt, table in iter_qk(h5_path):
            table.insert(0, "prompt", prompt)
            table.to_csv(out, header=False, index=False)
    return path
