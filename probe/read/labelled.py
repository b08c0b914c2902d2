"""A captured dataset as an xarray.DataArray: the dimension names the file carries (HDF5
dimension scales, what `xarray.open_dataset(..., engine="h5netcdf")` reads too) and the rows'
coordinates, which that reader cannot attach across groups. xarray is the optional `xarray` extra.
"""

from __future__ import annotations

import numpy as np

from probe.errors import ConfigError


def _import_xarray():
    try:
        import xarray
    except ImportError:
        raise ConfigError(
            "run.xarray needs xarray: pip install 'probe[xarray]' (or pip install xarray h5netcdf)"
        ) from None
    return xarray


def dim_names(ds) -> list[str]:
    """The name of each axis of `ds`: its label, else its scale's name, else dim_i."""
    out = []
    for i, dim in enumerate(ds.dims):
        name = dim.label
        if not name and len(dim):
            name = dim[0].name.rsplit("/", 1)[-1]
        out.append(name or f"dim_{i}")
    return out


def data_array(run, layer: str, site: str, rows: slice):
    xr = _import_xarray()
    ds = run._dataset(layer, site)
    view = run.array(layer, site)
    lo, hi, step = rows.indices(len(view))
    picked = np.arange(lo, hi, step)
    values = view[lo:hi:step] if step > 0 else view[picked]
    dims = dim_names(ds)
    f = run.file
    coords: dict = {}
    if dims[0] == "sample":
        coords["sample"] = (dims[0], f["samples/index"][: len(view)][picked])
        for name, item in f.get("samples", {}).items():
            if name != "index" and item.shape[:1] == f["samples/index"].shape[:1]:
                column = item[: len(view)][picked]
                if column.dtype.kind == "O":
                    column = np.array([v.decode() if isinstance(v, bytes) else v for v in column])
                coords[name] = (dims[0], column)
    elif dims[0] == "token" and "tokens" in f:
        for name in ("sample", "position", "id"):
            coords[f"token_{name}"] = (dims[0], f[f"tokens/{name}"][: len(view)][picked])
    else:
        coords[dims[0]] = (dims[0], picked)
    attrs = {
        "layer": layer,
        "site": site,
        "module_type": str(ds.parent.attrs.get("module_type", "")),
        "run": str(run.path),
        "state": run.state,
    }
    seen = run.seen(layer, site)[picked]
    if not seen.all():
        coords["seen"] = (dims[0], seen)
    return xr.DataArray(values, dims=dims, coords=coords, name=f"{layer}.{site}", attrs=attrs)
