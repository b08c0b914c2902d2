"""A batch's packed sites read together on their device: every site's packed batch (the fused
reduction's, `probe.stats.fused`, or the reference's, `probe.stats.torch_backend.reduce`) turned
into its batch accumulator, its units' rows and its quantile sketch, for all the sites of one
device in one pass of about a hundred operations whatever their number (per site, the reading
would be that many again for each: 2,500 kernel launches a batch for resnet18's convolutions).

The packs are laid end to end (one `cat`) and read through index tensors made once per kind of
batch (the sites' layouts and sizes; the last PLANS kinds kept, a few numbers per unit): one
gather takes, for every unit of every slab of
every fused site (a "cell"), the numbers `fused.Layout._slab` reads on the host; the same
arithmetic, element for element, then runs over all cells at once, so that each unit's count,
sum, extremes, positive and saturated counts equal the host's exactly (tests/stats/
test_batched_read.py); the accumulators (segment sums over each site's cells, the moments about
the site's mean) agree with the host's within float64 rounding. The histograms are viewed
where they lie and copied side by side into rows (a `cat` and a copy per kind of block); a
third gather takes the reference packs' heads and units, which are already read.

The units' rows come in `UNIT_ORDER` (count, sum, positive, saturated, min, -max): a merge adds
the first four and keeps the lesser of the last two (probe.stats.device_units). Nothing here
reads a value on the host.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from probe.stats import fused
from probe.stats.stat_columns import BATCH_NAMES, PACKED_FIRST, PACKED_HEAD
from probe.stats.torch_backend import _CLEARED, BINS, UNIT_ROWS

UNIT_ORDER = ("count", "sum", "positive", "saturated", "min", "-max")
HEAD = len(BATCH_NAMES)  # numbers of a site's batch accumulator
_REFERENCE_ROWS = (0, 1, 4, 5, 2, 3)  # the reference's unit rows in UNIT_ORDER (max negated)
_MEANS = 7  # the fused reduction's z rows read (value, positive part, 3 levels, 2 saturation)


@dataclass(frozen=True)
class PackedSite:
    """One site's packed batch on its device and how to read it: `layout` the fused reduction's
    (None: the reference's, whose units are `width`); `empty`: the batch held no value (its
    rows count, nothing else)."""

    packed: torch.Tensor
    layout: fused.Layout | None
    width: int
    tracked: bool
    empty: bool

    def kind(self) -> tuple:
        return (self.layout, self.width, self.tracked, self.empty, self.packed.numel())


@dataclass
class BatchRead:
    """A batch's sites read: `heads` (sites with values, HEAD) float64, each its batch
    accumulator in `stat_columns.BATCH` order; `units` (6, units) in UNIT_ORDER, or None;
    `hists` (sites with values, BINS) float64 counts; `buckets` (sites with values,) int64
    occupied buckets. Per site (in the order given) its row of heads and hists (None: empty) and
    its first unit column (None: no units)."""

    heads: torch.Tensor
    units: torch.Tensor | None
    hists: torch.Tensor
    buckets: torch.Tensor
    row: list[int | None]
    unit_at: list[int | None]


def read(sites: list[PackedSite]) -> BatchRead:
    """All of `sites` (one device) read on their device (queued: nothing waits)."""
    device = sites[0].packed.device
    plan = _plan(tuple(s.kind() for s in sites), device)
    flat = torch.cat([*(s.packed.view(-1) for s in sites), _zero(device)])  # (contiguous)
    heads, units = [], []
    if plan.fused is not None:
        h, u = _read_fused(flat, plan.fused)
        heads.append(h)
        if u is not None:
            units.append(u)
    if plan.reference is not None:
        ref = plan.reference
        heads.append(flat.index_select(0, ref.heads.view(-1)).view(-1, HEAD))
        if ref.units is not None:
            units.append(flat.index_select(0, ref.units.view(-1)).view(UNIT_ROWS, -1) * ref.sign)
    hists = _histograms(sites, plan)
    return BatchRead(
        heads[0] if len(heads) == 1 else torch.cat(heads),
        None if not units else units[0] if len(units) == 1 else torch.cat(units, 1),
        hists,
        torch.count_nonzero(hists, dim=1),
        plan.row,
        plan.unit_at,
    )


def _histograms(sites: list[PackedSite], plan: _Plan) -> torch.Tensor:
    """(sites with values, BINS) float64: each slab's histogram (K rows of a block, or one for
    the reference) viewed where it lies, those of one K laid side by side (one `cat`) and
    copied into rows; a site's slabs summed (whole counts: exact), float16 patterns' counts
    moved into the float32 buckets they fall in, the NaN and Inf buckets cleared."""
    parts = []
    for k, width, pieces in plan.hist_groups:
        views = [sites[i].packed.view(-1)[at : at + k * stride].view(k, stride)[:, lead:]
                 for i, at, stride, lead in pieces]  # fmt: skip
        block = views[0] if len(views) == 1 else torch.cat(views, 1)
        rows = block.view(k, len(pieces), width).transpose(0, 1).reshape(len(pieces), -1)
        parts.append(rows[:, :BINS])
    # (a new tensor, never a view of a site's pack: the packs are read, not written, and may be
    # inference tensors, which nothing outside inference mode may write)
    hists = parts[0].clone() if len(parts) == 1 else torch.cat(parts)
    if plan.piece_row is not None:  # (pieces out of the sites' order, or several a site)
        hists = hists.new_zeros(plan.sites, BINS).index_add_(0, plan.piece_row, hists)
    if plan.half is not None:
        rows, table = plan.half
        remapped = hists.new_zeros(len(rows), BINS).index_add_(1, table, hists[rows])
        hists = hists.index_copy(0, rows, remapped)
    for lo, hi in _CLEARED:  # (the NaN and Inf buckets, as the host reader clears them)
        hists[:, lo:hi] = 0
    return hists


@dataclass(frozen=True)
class _Fused:
    """Index tensors and per-cell constants of a batch's fused sites (C cells, S sites)."""

    gather: torch.Tensor  # (14, C): ext rows 1-4, var rows 0, 2, 4, mean rows 0-6
    n: torch.Tensor  # (C,) values of the cell's unit in its slab
    base: torch.Tensor  # (4, C) the patterns' offsets: b, a, nb, na
    sign: torch.Tensor  # (4, 1) +1, -1, +1, -1
    threshold: torch.Tensor  # (2, C) a - b, na - nb: a pattern row at or above holds values
    formats: tuple[tuple[str, torch.Tensor | None], ...]  # (format, its cells' mask or None)
    tracked: torch.Tensor | None  # (C,) 1.0 where saturation is counted (None: nowhere)
    site: torch.Tensor  # (C,) each cell's site
    sites: int
    single: torch.Tensor  # (S,) sites whose rows are one value (their L2 is the abs sum)
    norms: torch.Tensor | None  # (N,) the row norms of the other sites
    norm_site: torch.Tensor | None
    unit_cells: torch.Tensor | None  # (U,) the cells that start each unit (None: all cells)
    later: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # (cells, their units) per later slab


@dataclass(frozen=True)
class _Reference:
    heads: torch.Tensor  # (S, HEAD)
    units: torch.Tensor | None  # (6, U)
    sign: torch.Tensor  # (6, 1) the max row negated


@dataclass(frozen=True)
class _Plan:
    fused: _Fused | None
    reference: _Reference | None
    # per K: (K, columns of a row, pieces (site, first value, row stride, first column))
    hist_groups: tuple[tuple[int, int, tuple[tuple[int, int, int, int], ...]], ...]
    piece_row: torch.Tensor | None  # each piece's site row (None: the pieces are the rows)
    half: tuple[torch.Tensor, torch.Tensor] | None  # float16 sites' rows, the bucket table
    sites: int
    row: list[int | None]
    unit_at: list[int | None]


PLANS = 16  # kinds of batch whose plans a thread keeps (token batches vary in length)


class _Plans(threading.local):
    def __init__(self):
        self.cache: OrderedDict = OrderedDict()
        self.zeros: dict = {}


_plans = _Plans()


def _zero(device: torch.device) -> torch.Tensor:
    found = _plans.zeros.get(device)
    if found is None:
        with torch.inference_mode(False):
            found = _plans.zeros[device] = torch.zeros(1, dtype=torch.float64, device=device)
    return found


def _plan(kinds: tuple, device: torch.device) -> _Plan:
    key = (kinds, device)
    cache = _plans.cache
    found = cache.get(key)
    if found is None:
        found = cache[key] = _make_plan(kinds, device)
        if len(cache) > PLANS:
            cache.popitem(last=False)
    else:
        cache.move_to_end(key)
    return found


def _on(a, device, dtype=torch.int64) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a)).to(dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _make_plan(kinds: tuple, device: torch.device) -> _Plan:
    offsets = np.cumsum([0, *(k[4] for k in kinds)])
    zero = int(offsets[-1])  # the appended zero
    row: list[int | None] = [None] * len(kinds)
    unit_at: list[int | None] = [None] * len(kinds)
    fused_sites = [i for i, k in enumerate(kinds) if k[0] is not None and not k[3]]
    ref_sites = [i for i, k in enumerate(kinds) if k[0] is None and not k[3]]
    order = fused_sites + ref_sites  # (the heads' rows: the fused sites' first)
    for r, i in enumerate(order):
        row[i] = r
    hist_rows: list[tuple[int, int, int, int, int]] = []  # (K, site, first, stride, lead)
    hist_site: list[int] = []
    half_rows: list[int] = []
    units = 0
    fused_plan = None
    if fused_sites:
        fused_plan, units = _make_fused(kinds, fused_sites, offsets, zero, device, unit_at,
                                        hist_rows, hist_site, half_rows)  # fmt: skip
    ref_plan = None
    if ref_sites:
        heads, unit_index = [], []
        for i in ref_sites:
            o, width = int(offsets[i]), kinds[i][1]
            heads.append(o + PACKED_FIRST + np.arange(HEAD))
            if width:
                unit_at[i] = units
                units += width
                at = o + PACKED_HEAD + np.asarray(_REFERENCE_ROWS)[:, None] * width
                unit_index.append(at + np.arange(width))
            hist_rows.append((1, i, PACKED_HEAD + UNIT_ROWS * width, BINS, 0))
            hist_site.append(row[i])  # type: ignore[arg-type]
        sign = np.ones((UNIT_ROWS, 1))
        sign[-1] = -1.0
        ref_plan = _Reference(
            _on(np.stack(heads), device),
            _on(np.concatenate(unit_index, 1), device) if unit_index else None,
            _on(sign, device, torch.float64),
        )
    sites = len(order)
    groups: dict[int, list[tuple[int, int, int, int]]] = {}
    piece_row: list[int] = []
    for k in dict.fromkeys(r[0] for r in hist_rows):
        for (kk, i, first, stride, lead), site_row in zip(hist_rows, hist_site, strict=True):
            if kk == k:
                groups.setdefault(k, []).append((i, first, stride, lead))
                piece_row.append(site_row)
    hist_groups = tuple(
        (k, pieces[0][2] - pieces[0][3], tuple(pieces)) for k, pieces in groups.items()
    )
    half = None
    if half_rows:
        table = fused.FORMATS[torch.float16].buckets()
        half = (_on(np.asarray(half_rows), device), _on(table, device))
    in_order = piece_row == list(range(sites))
    return _Plan(fused_plan, ref_plan, hist_groups,
                 None if in_order else _on(np.asarray(piece_row), device), half, sites, row,
                 unit_at)  # fmt: skip


def _make_fused(kinds, sites, offsets, zero, device, unit_at, hist_rows, hist_site, half_rows):
    """The fused sites' cells (site, slab, unit in that order), their units and histograms."""
    gather, n, base, threshold, fmt_of, tracked, site_of = [], [], [], [], [], [], []
    single, norms, norm_site = [], [], []
    unit_cells: list[int] = []
    later: dict[int, tuple[list[int], list[int]]] = {}
    cells = units = 0
    for s, i in enumerate(sites):
        layout: fused.Layout = kinds[i][0]
        k, c, fmt = layout.rows, layout.width, layout.fmt
        (a, b), (na, nb) = fmt.positive, fmt.negative
        single.append(layout.single)
        if fmt.name == "float16":
            half_rows.append(s)
        if c:
            unit_at[i] = units
        at = int(offsets[i])
        for slab, (rows, per_unit) in enumerate(zip(layout.slab_rows, layout.per_unit,
                                                    strict=True)):  # fmt: skip
            size = layout._size(rows)
            width = max(c, 1)
            if c:
                stride = size // k  # (a row of the slab's block: K rows, bins padded to K)
                lead = 3 * c + (0 if layout.single else rows)
                u = np.arange(c)
                rows_at = at + np.arange(k)[:, None] * stride
                ext, var, mean = rows_at + u, rows_at + c + u, rows_at + 2 * c + u
                if not layout.single:
                    norms.append(at + lead - rows + np.arange(rows))  # (row 0's norms)
                    norm_site.append(np.full(rows, s))
                hist = (k, i, at - int(offsets[i]), stride, lead)
            else:  # flat: K extremes, K variances, K means, then the histogram
                ext, var, mean = (at + np.arange(j * k, (j + 1) * k)[:, None] for j in range(3))
                bins = fused._bins(k)
                hist = (k, i, at - int(offsets[i]) + 3 * k, bins // k, 0)
            means = np.full((_MEANS, width), zero)
            means[: min(k, _MEANS)] = mean[:_MEANS]
            gather.append(np.concatenate([ext[1:5], var[[0, 2, 4]], means]))
            n.append(np.full(width, float(per_unit)))
            base.append(np.repeat(np.array([[b], [a], [nb], [na]], np.float64), width, 1))
            threshold.append(np.repeat(np.array([[a - b], [na - nb]], np.float64), width, 1))
            fmt_of += [fmt.name] * width
            tracked.append(np.full(width, float(layout.tracked)))
            site_of.append(np.full(width, s))
            if c and slab == 0:
                unit_cells += range(cells, cells + c)
            elif c:
                sel, dest = later.setdefault(slab, ([], []))
                sel += range(cells, cells + c)
                dest += range(units, units + c)
            cells += width
            hist_rows.append(hist)
            hist_site.append(s)
            at += size
        units += c
    names = tuple(dict.fromkeys(fmt_of))
    fmts = np.asarray(fmt_of)
    formats = tuple(
        (name, None if len(names) == 1 else _on(fmts == name, device, torch.bool)) for name in names
    )
    tracks = np.concatenate(tracked)
    f64 = torch.float64
    plan = _Fused(
        _on(np.concatenate(gather, 1), device),
        _on(np.concatenate(n), device, f64),
        _on(np.concatenate(base, 1), device, f64),
        _on(np.array([[1.0], [-1.0], [1.0], [-1.0]]), device, f64),
        _on(np.concatenate(threshold, 1), device, f64),
        formats,
        _on(tracks, device, f64) if tracks.any() else None,
        _on(np.concatenate(site_of), device),
        len(sites),
        _on(np.asarray(single), device, torch.bool),
        _on(np.concatenate(norms), device) if norms else None,
        _on(np.concatenate(norm_site), device) if norms else None,
        None if unit_cells == list(range(cells)) else _on(np.asarray(unit_cells), device),
        tuple(
            (_on(np.asarray(sel), device), _on(np.asarray(dest), device))
            for _, (sel, dest) in sorted(later.items())
        ),  # fmt: skip
    )
    return plan, units


def _decode(patterns: torch.Tensor, name: str) -> torch.Tensor:
    """`fused._Format.values` on the device: bit patterns (whole numbers in float64) as values
    (int64 to a narrower integer wraps, as the patterns' two's complement)."""
    p = patterns.to(torch.int64)
    if name == "float16":
        return p.to(torch.int16).view(torch.float16).to(torch.float64)
    if name == "bfloat16":
        p = p.bitwise_left_shift(16)
    return p.to(torch.int32).view(torch.float32).to(torch.float64)


def _read_fused(flat: torch.Tensor, p: _Fused) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(heads (S, HEAD), units (6, U) or None) of the fused sites: `fused.Layout._slab`'s
    arithmetic over all cells at once, then each site's cells summed (its slabs merged)."""
    g = flat.index_select(0, p.gather.view(-1)).view(14, -1)
    n = p.n
    sums = g[7:14] * n  # (per z row and cell)
    level_means = g[9:12:2]  # (z rows 2 and 4)
    squares = (g[5:7] + level_means * level_means) * n
    fin = torch.round((squares[0] - squares[1]) / 0.75)
    infinite = torch.round(squares[0] - fin)
    plus = torch.round((infinite + sums[4] - 0.5 * fin) / 2)
    minus = infinite - plus
    positive = torch.round((sums[2] + fin + minus - plus) / 2)
    negative = torch.round((fin + plus - minus - sums[3]) / 2)
    value_sums = sums[0]
    unit_mean = torch.where(fin > 0, value_sums / fin.clamp_min(1), 0.0)
    unit_m2 = (g[4] * n - unit_mean**2 * fin * (n - fin) / n).clamp_min(0.0)
    lows, highs = _extremes(g[0:4], p)
    if p.tracked is not None:
        below = torch.round((fin + plus - minus - sums[5]) / 2)
        above = torch.round((sums[6] + fin + minus - plus) / 2)
        saturated = (below + above) * p.tracked
    else:
        saturated = torch.zeros_like(fin)
    # per site: its cells' sums, then the moments about its mean
    site, sites = p.site, p.sites
    infs = plus + minus
    parts = torch.stack([fin, value_sums, unit_m2, 2 * sums[1] - value_sums, infs,
                         n - fin - infs, fin - positive - negative])  # fmt: skip
    total, value_sum, m2, abs_sum, inf_count, nan_count, zeros = fin.new_zeros(7, sites).index_add_(
        1, site, parts
    )
    mean = torch.where(total > 0, value_sum / total.clamp_min(1), 0.0)
    spread = fin * (unit_mean - mean.index_select(0, site)).square()
    m2 = m2 + fin.new_zeros(sites).index_add_(0, site, spread)
    l2 = abs_sum
    if p.norms is not None and p.norm_site is not None:
        row_norms = fin.new_zeros(sites).index_add_(0, p.norm_site, flat.index_select(0, p.norms))
        l2 = torch.where(p.single, abs_sum, row_norms)
    low, high = _first_extremes(torch.stack([lows, -highs]), site, sites)
    heads = torch.stack([total, mean, m2, low, -high, abs_sum, zeros, nan_count, inf_count, l2],
                        1)  # fmt: skip
    rows = torch.stack([fin, value_sums, positive, saturated, lows, -highs])
    if p.unit_cells is None and not p.later:
        return heads, rows
    units = rows if p.unit_cells is None else rows.index_select(1, p.unit_cells)
    for cells, dest in p.later:  # a later slab merged into its units, as UnitStats.merge
        have, new = units.index_select(1, dest), rows.index_select(1, cells)
        least = torch.where(have[4:] < new[4:], have[4:], new[4:])  # (numpy's minimum)
        units = units.index_copy(1, dest, torch.cat([have[:4] + new[:4], least]))
    return heads, units


def _extremes(ext: torch.Tensor, p: _Fused) -> tuple[torch.Tensor, torch.Tensor]:
    """`fused.Layout._extremes` over all cells: each unit's lowest and highest finite value."""
    has = ext[0::2] >= p.threshold  # (positive values, negative values)
    patterns = torch.where(has[[0, 0, 1, 1]], p.base + p.sign * ext, 0.0)
    values = None
    for name, mask in p.formats:
        decoded = _decode(patterns, name)
        values = decoded if values is None or mask is None else torch.where(mask, decoded, values)
    assert values is not None  # (a cell has a format)
    pos_max, pos_min, neg_min, neg_max = values
    has_pos, has_neg = has
    highs = torch.where(has_pos, pos_max, torch.where(has_neg, neg_max, -torch.inf))
    lows = torch.where(has_neg, neg_min, torch.where(has_pos, pos_min, torch.inf))
    return lows, highs


def _first_extremes(values: torch.Tensor, site: torch.Tensor, sites: int):
    """Per site (rows of `values`: lows and negated highs) the least of its cells' values as
    the first cell holding it has it (a zero's sign: the host takes the first unit's)."""
    cells = values.shape[1]
    index = site.expand(2, -1)
    least = values.new_full((2, sites), torch.inf).scatter_reduce_(1, index, values, "amin")
    hit = values == least.index_select(1, site)
    order = torch.arange(cells, device=values.device).expand(2, -1)
    first = torch.full((2, sites), cells, dtype=torch.int64, device=values.device)
    first.scatter_reduce_(1, index, torch.where(hit, order, cells), "amin")
    found = values.gather(1, first.clamp_max(max(cells - 1, 0)))
    low, high = torch.where(first < cells, found, least)
    return low, high
