"""Activation patching and steering: a site's value replaced by the value it has on another input
(the other half of a pair, the unedited input) or in an earlier run, or moved along a direction,
at chosen token positions, units and attention heads.

Values from another input come from a source pass over the same batch just before the edited one
(`probe.intervene.passes`); values from a run are read from its probe.h5, rows aligned by sample index.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from probe.config import PATCH_SOURCES as SOURCES  # else the path of an earlier run
from probe.errors import ConfigError, DataError
from probe.layout import TokenBatch, unit_axis
from probe.site_keys import SiteKey
from probe.store import stats_file, swmr
from probe.store.fileformat import layer_path, read_progress


def first_item(key: str, site: str) -> bool:
    """Whether dataset `key` is the site's tensor or the first element of its tuple (at any
    call): the one a patch or a steering vector edits."""
    parsed = SiteKey.parse(key)
    return parsed.family == site and parsed.path in ("", ".0")


def run_file(path: str, label: str) -> Path:
    """probe.h5 of a run directory, or the file itself."""
    p = Path(path)
    p = p / "probe.h5" if p.is_dir() else p
    if not p.is_file():
        raise DataError(f"{label}: {path!r} is neither a run directory nor a probe.h5 file")
    return p


@dataclass
class Region:
    """Where an edit acts: token positions (negative ones count back from each sample's last
    real token), units along the unit axis, attention heads (slices of the unit axis)."""

    label: str
    class_axis: str | None = None
    positions: list[int] | None = None
    units: list[int] | None = None
    heads: list[int] | None = None
    n_heads: int | None = None

    def mask(self, x: torch.Tensor, tokens: TokenBatch | None) -> torch.Tensor | None:
        """A boolean mask broadcastable to x, or None for all of it."""
        if self.positions is None and self.units is None and self.heads is None:
            return None
        mask = torch.ones((1,) * x.ndim, dtype=torch.bool, device=x.device)
        if self.positions is not None:
            mask = mask & self._positions(x, tokens)
        if self.units is not None or self.heads is not None:
            mask = mask & self._features(x)
        return mask

    def _positions(self, x: torch.Tensor, tokens: TokenBatch | None) -> torch.Tensor:
        if tokens is None or x.ndim < 2 or x.shape[1] != tokens.length:
            raise ConfigError(
                f"{self.label}: positions need token inputs and a token axis at axis 1, but the "
                f"value has shape {tuple(x.shape)}; drop positions or edit another site"
            )
        n, t = x.shape[:2]
        picked = torch.zeros((n, t), dtype=torch.bool, device=x.device)
        rows = torch.arange(n, device=x.device)
        last = tokens.last.to(x.device)
        assert self.positions is not None  # (mask asks only when there are positions)
        for p in self.positions:
            index = last + 1 + p if p < 0 else torch.full_like(last, p)
            bad = (index < 0) | (index >= t)
            if bool(bad.any()):
                i = int(bad.nonzero()[0])
                raise ConfigError(
                    f"{self.label}: position {p} is outside sample {i}'s {int(last[i]) + 1} "
                    f"tokens; give positions in [-{int(last[i]) + 1}, {t})"
                )
            picked[rows, index] = True
        return picked.reshape(n, t, *(1,) * (x.ndim - 2))

    def _features(self, x: torch.Tensor) -> torch.Tensor:
        """The units picked on the unit axis: `units`, within `heads` when both are given."""
        axis = unit_axis("auto", self.class_axis, x.ndim, self.label)
        width = x.shape[axis]
        chosen = torch.ones(width, dtype=torch.bool, device=x.device)
        if self.units is not None:
            units = torch.zeros(width, dtype=torch.bool, device=x.device)
            units[self._indices(self.units, width, "units", "unit")] = True
            chosen &= units
        if self.heads is not None:
            n_heads = self.n_heads
            if not n_heads or width % n_heads:
                raise ConfigError(
                    f"{self.label}: heads need the model's number of attention heads dividing "
                    f"the {width} units (found {n_heads}); patch an attention output projection's "
                    "input (e.g. attn.c_proj, self_attn.o_proj) of a transformers model"
                )
            heads = torch.zeros(n_heads, width // n_heads, dtype=torch.bool, device=x.device)
            heads[self._indices(self.heads, n_heads, "heads", "head")] = True
            chosen &= heads.reshape(width)
        shape = [1] * x.ndim
        shape[axis] = width
        return chosen.reshape(shape)

    def _indices(self, picked: list[int], size: int, key: str, what: str) -> list[int]:
        bad = [i for i in picked if not -size <= i < size]
        if bad:
            raise ConfigError(
                f"{self.label}: {key} {bad} are out of range for {size} {what}s; give indices "
                f"below {size}"
            )
        return list(picked)


@dataclass
class Recorded:
    """The values of the patched sites on the current batch's source input, by (layer, dataset),
    set by the source pass (`probe.intervene.passes`) before each edited forward."""

    values: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)


class Patch:
    """op: patch: the site's value where `region` says, from `recorded` (pair, clean) or from
    the run file at `source`."""

    def __init__(self, label: str, module_name: str, site: str, region: Region, source: str):
        self.label, self.module_name, self.site = label, module_name, site
        self.region, self.source = region, source
        self.recorded = Recorded() if source in SOURCES else None
        self.file = None if source in SOURCES else run_file(source, label)

    def __call__(self, x, start, key, ch, tokens):
        if not first_item(key, self.site):
            return x
        src = self._value(x, start, key).to(device=x.device, dtype=x.dtype)
        mask = self.region.mask(x, tokens)
        if mask is None:
            return torch.where(torch.ones_like(x, dtype=torch.bool), src, x)
        return torch.where(mask, src, x)

    def _value(self, x: torch.Tensor, start: int, key: str) -> torch.Tensor:
        if self.recorded is not None:
            value = self.recorded.values.get((self.module_name, key))
            if value is None:
                raise ConfigError(f"{self.label}: no source value of {self.module_name!r} {key}")
            return value
        assert self.file is not None  # (a source that is not recorded is a run file)
        return read_rows(self.file, self.module_name, key, start, x, self.label)


def read_rows(path: Path, layer: str, key: str, start: int, x: torch.Tensor, label: str):
    """Rows [start, start + len(x)) of an earlier run's capture of `layer` `key`, checked against
    x's shape; errors name both files."""
    name = layer_path(layer, key)
    with swmr.open_read(path) as f:
        ds = f.get(name)
        here = f"this run's {layer!r} {key} of shape {tuple(x.shape[1:])}"
        if ds is None:
            raise DataError(
                f"{label}: {str(path)!r} holds no {name}; patch from a run that captured "
                f"{key.split('.')[0]} of {layer!r} (rows: samples, reduce: none) for {here}"
            )
        if ds.attrs.get("row_unit") == "tokens" or ds.shape[1:] != x.shape[1:]:
            raise DataError(
                f"{label}: {str(path)!r} holds {name} of shape {tuple(ds.shape[1:])} per row "
                f"({ds.attrs.get('row_unit', 'samples')}), not {here}; capture it with "
                "rows: samples and reduce: none, on inputs of the same length"
            )
        valid = read_progress(f).valid_rows(ds, key)
        if start + len(x) > valid:
            raise DataError(
                f"{label}: {str(path)!r} holds {valid} samples of {name}, fewer than this run's "
                f"{start + len(x)}; patch from a run over at least as many samples"
            )
        return torch.from_numpy(np.ascontiguousarray(ds[start : start + len(x)]))


class Steer:
    """op: add with a vector: x + factor * vector where `region` says; the vector lies along the
    unit axis ((C,)) or the token and unit axes ((T, C))."""

    def __init__(self, label: str, site: str, region: Region, factor: float, vector):
        self.label, self.site, self.region, self.factor = label, site, region, factor
        self.vector = vector  # a tensor, or a function of the dataset key giving one

    def __call__(self, x, start, key, ch, tokens):
        if not first_item(key, self.site):
            return x
        v = self.vector(key) if callable(self.vector) else self.vector
        shape = [1] * x.ndim
        axis = unit_axis("auto", self.region.class_axis, x.ndim, self.label)
        if v.ndim == 2:
            shape[1] = v.shape[0]
        shape[axis] = v.shape[-1]
        if (v.ndim == 2 and x.ndim < 3) or tuple(
            x.shape[a] for a in range(x.ndim) if shape[a] > 1
        ) != tuple(s for s in shape if s > 1):
            raise ConfigError(
                f"{self.label}: the vector of shape {tuple(v.shape)} does not fit the value of "
                f"shape {tuple(x.shape)} (units on axis {axis}); give (C,) or (T, C)"
            )
        moved = x + self.factor * v.to(device=x.device, dtype=x.dtype).reshape(shape)
        mask = self.region.mask(x, tokens)
        return moved if mask is None else torch.where(mask, moved, x)


def load_vector(path: str, label: str) -> torch.Tensor:
    """A steering vector from a .pt (tensor) or .npy file."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{label}: vector={path!r} does not exist; give a .pt or .npy file")
    try:
        v = torch.from_numpy(np.load(p)) if p.suffix == ".npy" else torch.load(p, weights_only=True)
    except Exception as e:
        raise DataError(
            f"{label}: vector={path!r} cannot be read ({type(e).__name__}: {e})"
        ) from None
    if not isinstance(v, torch.Tensor) or v.ndim not in (1, 2) or not v.is_floating_point():
        raise DataError(
            f"{label}: vector={path!r} must hold a floating tensor of shape (C,) or (T, C)"
        )
    return v.float()


def mean_diff(plus: str, minus: str, layer: str, label: str):
    """The difference of two runs' exact per-unit means of a site (their /stats), as a function
    of the site's dataset key."""
    files = [run_file(run, f"{label}: {side}") for run, side in ((plus, "plus"), (minus, "minus"))]
    cache: dict[str, torch.Tensor] = {}

    def means(path: Path, key: str) -> np.ndarray:
        with swmr.open_read(path) as f:
            info = stats_file.read(f).get((layer, key))
            if info is None or info.stats.units is None:
                raise DataError(
                    f"{label}: {str(path)!r} holds no statistics of {layer!r} {key}; run a probe "
                    f"capturing it there first"
                )
            units = info.stats.units
            return units.sum / np.maximum(units.count, 1)

    def vector(key: str) -> torch.Tensor:
        if key not in cache:
            a, b = (means(p, key) for p in files)
            if a.shape != b.shape:
                raise DataError(
                    f"{label}: plus={plus!r} has {a.size} units of {layer!r} {key}, "
                    f"minus={minus!r} {b.size}; give runs of the same model"
                )
            cache[key] = torch.from_numpy(a - b).float()
        return cache[key]

    return vector
