"""The cells of one query position's decomposed pairs (probe.graphs.qk_attribution), reduced in
chunks of query-side parts so that the memory they take is bounded whatever the number of parts.

A pair's cells are its query-side parts times its key-side parts (nq x nk, per head and key
position): at SmolLM2's 30 blocks a node-traced side has some 6,000 parts, 36 million cells a
pair, gigabytes a query position in float64. The table keeps of them only the `rows` largest by
|cell| and the sum of the others (`rest`), the query-side marginals (a part against the whole
key), the key-side ones, the total and the sum of |cells| (the cells' check). So the cells are
made for `chunk_parts(...)` query-side parts at a time (CHUNK_BYTES of cells and their
magnitudes at most) and each chunk is folded in: its query marginals are complete (a chunk
holds whole query-side rows), the key marginals and the sum of |cells| are running sums, the
total (which `rest` is taken from) is the query marginals' sum, and the `rows` largest of the
chunk are merged with those kept so far (a top-k of the union: a pair's largest cells are among
their own chunk's largest). The kept cells are then the same, largest first, as from the whole
matrix at once, values equal up to float64 rounding of a changed summation order, order equal
except where |cells| tie exactly.

`rows=None` keeps every cell, and the table then holds a row per cell: the whole matrix is
made (still chunk by chunk) and sorted once, which needs memory for every cell and its row;
where that passes a share of the device's free memory (probe.graphs.batch_plan.free_bytes) the
table is refused by name, pointing at a `rows` that bounds it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from probe.errors import ConfigError
from probe.graphs.batch_plan import FRACTION, free_bytes, human

CHUNK_BYTES = 1 << 27  # 128 MiB: one chunk's cells while it is reduced (see CELL_BYTES)
CELL_BYTES = 4 * 8  # a cell in a chunk: its value, |value|, and the flattened copies top-k reads
# (rows=None) a kept cell: its value and |value| (twice while the chunks are joined), the sort's
# value and index (8 bytes each), and its table row: a tuple of the columns in qk_table's list,
# then the DataFrame made from it (240 and 280 bytes a row measured)
EVERY_CELL_BYTES = 5 * 8 + 520


def chunk_parts(heads: int, n_keys: int, nk: int) -> int:
    """Query-side parts per chunk: as many as CHUNK_BYTES holds of their cells (heads x keys x
    `nk` key-side parts each, CELL_BYTES apiece), at least one."""
    return max(1, CHUNK_BYTES // (CELL_BYTES * heads * n_keys * max(nk, 1)))


@dataclass
class Largest:
    """Per pair ([head][key]) of a block of values: the indices and values of its largest
    by magnitude (padding left out), largest first, and the sum of the others (None where
    none was left out)."""

    index: list[list[list[int]]]
    value: list[list[list[float]]]
    rest: list[list[float | None]]


class PairCells:
    """The reductions of one query position's cells (heads, K key positions, nq query-side
    parts, nk key-side parts; see the module docstring): `query` (H, K, nq) and `key`
    (H, K, nk) marginals, `total` and `abs_total` (H, K), the key's part counts `counts`,
    `valid` (H, K, nk: False on a key's padding), and `largest`, the cells' Largest (index
    j: query-side part j // nk, key-side part j % nk).

    `q_vectors` (nq, H, d) are the query-side parts' queries, `k_vectors` (nk, H, K, d) the
    key-side parts' keys at each pair's key position (zeros on a key's padding), `scaling` the
    family's factor on q . k; `where` names the query position in a refusal."""

    def __init__(
        self,
        q_vectors: torch.Tensor,
        k_vectors: torch.Tensor,
        valid: torch.Tensor,
        scaling: float,
        rows: int | None,
        where: str,
    ) -> None:
        heads, n_keys, nk = valid.shape
        nq = q_vectors.shape[0]
        self.valid, self.nq, self.nk = valid, nq, nk
        self.counts = valid.sum(-1)
        if rows is None:
            _check_every_cell_fits(heads * n_keys * nq * nk, q_vectors.device, where)
        pad = ~valid[:, :, None, :]
        double = torch.float64
        self.key = torch.zeros(heads, n_keys, nk, dtype=double, device=valid.device)
        self.abs_total = torch.zeros(heads, n_keys, dtype=double, device=valid.device)
        query: list[torch.Tensor] = []
        every: list[tuple[torch.Tensor, torch.Tensor]] = []  # rows None: (values, magnitudes)
        kept: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        step = chunk_parts(heads, n_keys, nk)
        for start in range(0, nq, step):
            chunk = q_vectors[start : start + step]
            cells = torch.einsum("ihd,jhkd->hkij", chunk, k_vectors) * scaling  # (H, K, c, nk)
            query.append(cells.sum(-1))
            self.key += cells.sum(-2)
            magnitude = cells.abs()
            self.abs_total += magnitude.sum((-1, -2))
            magnitude.masked_fill_(pad, -1.0)  # a key's padding: never among the largest
            flat, flat_magnitude = (
                cells.reshape(heads, n_keys, -1),
                magnitude.reshape(heads, n_keys, -1),
            )
            if rows is None:
                every.append((flat, flat_magnitude))
                continue
            top = torch.topk(flat_magnitude, min(rows, flat.shape[-1]), dim=-1)
            found = (top.values, top.indices + start * nk, flat.gather(-1, top.indices))
            kept = found if kept is None else _merge(kept, found, rows)
        self.query = torch.cat(query, -1)  # (H, K, nq)
        self.total = self.query.sum(-1)
        if rows is None:
            values = torch.cat([v for v, _ in every], -1)
            magnitudes = torch.cat([m for _, m in every], -1)
            del every
            top = torch.topk(magnitudes, values.shape[-1], dim=-1)
            kept = (top.values, top.indices, values.gather(-1, top.indices))
        assert kept is not None  # (nq >= 1: the bias part)
        magnitudes, indices, values = kept
        self.largest = _as_lists(indices, values, magnitudes, self.total, self.counts * nq)


def _merge(kept, found, rows: int):
    """The `rows` largest by magnitude of two (magnitudes, indices, values) triples."""
    magnitudes = torch.cat([kept[0], found[0]], -1)
    top = torch.topk(magnitudes, min(rows, magnitudes.shape[-1]), dim=-1)
    pick = top.indices
    return (
        top.values,
        torch.cat([kept[1], found[1]], -1).gather(-1, pick),
        torch.cat([kept[2], found[2]], -1).gather(-1, pick),
    )


def _check_every_cell_fits(cells: int, device: torch.device, where: str) -> None:
    """rows=None: refuse by name where every cell of a query position, with its table row,
    would pass FRACTION of the device's free memory."""
    need = cells * EVERY_CELL_BYTES
    free = free_bytes(device)
    if free is not None and need > FRACTION * free:
        raise ConfigError(
            f"graphs: the QK table with every cell (qk_rows=None; graph.qk_rows=null) has "
            f"{cells:,} cells at {where}, some {human(need)} with their rows, past "
            f"{FRACTION:.0%} of the {human(free)} free; keep a pair's largest cells "
            "(graph.qk_rows=20, qk_rows=20 in the API), whose memory is bounded by chunks of "
            "cells, or ask for fewer keys (graph.qk) or positions"
        )


def largest(values: torch.Tensor, magnitude: torch.Tensor, count: torch.Tensor, rows) -> Largest:
    """Per pair (the leading two dimensions), the `rows` largest `magnitude` (|values|, -1 where
    an entry is padding; rows None: every one) of `values` and the sum of the others, of its
    `count` real entries (padding entries are zeros)."""
    take = values.shape[-1] if rows is None else min(rows, values.shape[-1])
    top = torch.topk(magnitude, take, dim=-1)
    return _as_lists(top.indices, values.gather(-1, top.indices), top.values, values.sum(-1), count)


def _as_lists(indices, chosen, magnitudes, total, count) -> Largest:
    """Largest from the chosen entries (indices, values, magnitudes: -1 on padding) of each
    pair, the sum of all its entries `total` and its real entries' `count`."""
    real = magnitudes >= 0  # (not padding)
    rest = total - (chosen * real).sum(-1)
    left = (real.sum(-1) < count).tolist()
    index, value = [], []
    for idx_h, val_h, real_h in zip(indices.tolist(), chosen.tolist(), real.tolist(), strict=True):
        index.append([[j for j, r in zip(a, m, strict=True) if r]
                      for a, m in zip(idx_h, real_h, strict=True)])  # fmt: skip
        value.append([[v for v, r in zip(a, m, strict=True) if r]
                      for a, m in zip(val_h, real_h, strict=True)])  # fmt: skip
    rests = [[float(r) if lo else None for r, lo in zip(rh, lh, strict=True)]
             for rh, lh in zip(rest.tolist(), left, strict=True)]  # fmt: skip
    return Largest(index, value, rests)
