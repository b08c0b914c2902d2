"""`/topk` in probe.h5: per (layer, site) the rows probe.stats.topk keeps, beside `/stats`.

`/topk/<layer>/<site>/<kind>_values` (float64) and `<kind>_keys` (int64, `sample * 2**20 +
position`, -1 empty), each (2, units, n): the same two slots as `/stats`, written with them and
chosen by `/progress`, so a kill leaves one whole flush. Attributes say the spec (`top`,
`bottom`, `quantiles`, `seed`, `position_bits`).
"""

from __future__ import annotations

import h5py
import numpy as np

from probe.stats.topk import POSITION_BITS, TopKSpec, TopKState
from probe.store.fileformat import encode


def path(layer: str, site: str) -> str:
    return f"topk/{encode(layer)}/{encode(site)}"


def create(file: h5py.File, layer: str, site: str, state: TopKState) -> None:
    """The group and its empty slots (before SWMR mode)."""
    g = file.require_group(path(layer, site))
    spec = state.spec
    g.attrs.update(top=spec.top, bottom=spec.bottom, quantiles=spec.quantiles, seed=spec.seed,
                   position_bits=POSITION_BITS, name=layer, site=site)  # fmt: skip
    for kind, n in spec.sizes().items():
        g.create_dataset(f"{kind}_values", shape=(2, state.units, n), dtype="<f8")
        g.create_dataset(f"{kind}_keys", data=np.full((2, state.units, n), -1, np.int64))


def write(file: h5py.File, layer: str, site: str, state: TopKState, slot: int) -> None:
    """Into `slot` (a run resumed with stats.topk it did not have keeps none: no group)."""
    g = file.get(path(layer, site))
    if g is None:
        return
    for kind, (values, keys) in state.kinds.items():
        g[f"{kind}_values"][slot] = values
        g[f"{kind}_keys"][slot] = keys


def read(file: h5py.File, layer: str, site: str, slot: int) -> TopKState | None:
    """The state of one slot; None where the run kept no examples for this site."""
    g = file.get(path(layer, site))
    if g is None or slot < 0:
        return None
    a = g.attrs
    spec = TopKSpec(int(a["top"]), int(a["bottom"]), int(a["quantiles"]), int(a["seed"]))
    state = TopKState(spec)
    for kind in spec.sizes():
        values, keys = g[f"{kind}_values"], g[f"{kind}_keys"]
        if file.swmr_mode:
            values.refresh()
            keys.refresh()
        state.kinds[kind] = (values[slot], keys[slot])
    return state
