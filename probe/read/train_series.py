"""A watched training's statistics over the steps, as its figures draw them: `run.train_series()`.

    frames = probe.open_run("runs/w").train_series()
    frames["std (output)"]          # steps down, modules across: the std of each module's output

`series(table, order)` turns train.csv's rows (one per step, layer and site) into one step x
module frame per statistic, those the run holds the sites of:

- `abs_mean (output)`, `std (output)`, `dead_frac (output)`: of each module's output (a tuple
  output's first tensor, `output.0`; the module's first call);
- `grad norm (grad_output)`: the norm of the output's gradient;
- `grad norm (param_grad)`: the norm of a module's parameters' gradients together (the root of
  the sum of their squared norms);
- `update / weight`: the norm of a module's `param_update.*` over that of its `param.*` (the
  parameters it holds both of), as a root of sums of squares each.

Modules run in the model's order (`order`: watch.yaml's `modules`), then any others in the
order the table first names them; a step a module has no value at is NaN.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from probe.site_keys import parse_or_none

OUTPUT_STATS = ("abs_mean (output)", "std (output)", "dead_frac (output)")
GRAD_OUTPUT_NORM = "grad norm (grad_output)"
PARAM_GRAD_NORM = "grad norm (param_grad)"
UPDATE_RATIO = "update / weight"


def site_keys(table: pd.DataFrame) -> pd.Series:
    """The SiteKey of each row's site (None for a name that is no site's), parsed once a name."""
    keys = {name: parse_or_none(name) for name in table["site"].unique()}
    return table["site"].map(keys)


def first_sites(table: pd.DataFrame, kind: str) -> pd.DataFrame:
    """The rows of each layer's first site of `kind` (output, grad_output) at its first call
    (no @): `output`, or a tuple output's first tensor `output.0`."""
    keys = site_keys(table)
    rows = table[
        keys.map(lambda k: k is not None and k.family == kind and k.call == 0).astype(bool)
    ]
    if rows.empty:
        return rows
    first = rows.groupby("layer", sort=False)["site"].first()
    return rows[rows["site"] == rows["layer"].map(first)]


def wide(rows: pd.DataFrame, values: pd.Series, layers: list[str]) -> pd.DataFrame:
    """A step x layer frame of `values` (indexed like `rows`), layers in the order given."""
    frame = pd.DataFrame({"step": rows["step"].to_numpy(), "layer": rows["layer"].to_numpy(),
                          "v": values.to_numpy(dtype=float)})  # fmt: skip
    out = frame.pivot_table(index="step", columns="layer", values="v", aggfunc="first")
    return out.reindex(columns=[c for c in layers if c in out.columns])


def param_norms(table: pd.DataFrame, kind: str) -> pd.DataFrame:
    """Per (step, layer, parameter name) the norm of a parameter site of `kind`."""
    keys = site_keys(table)
    wanted = keys.map(lambda k: k is not None and k.family == kind).astype(bool)
    rows = table[wanted]
    names = keys[wanted].map(lambda k: k.parameter)
    return rows.assign(param=names)[["step", "layer", "param", "norm"]]


def series(table: pd.DataFrame, order: list[str] | None = None) -> dict[str, pd.DataFrame]:
    """{statistic: step x module frame} of the statistics the table holds (see the module),
    modules in `order` and then the table's."""
    layers = list(dict.fromkeys([*(order or []), *table["layer"]])) if not table.empty else []
    out = {}
    outputs = first_sites(table, "output")
    if not outputs.empty:
        out["abs_mean (output)"] = wide(outputs, outputs["abs_mean"], layers)
        out["std (output)"] = wide(outputs, outputs["std"], layers)
    grads = first_sites(table, "grad_output")
    if not grads.empty:
        out[GRAD_OUTPUT_NORM] = wide(grads, grads["norm"], layers)
    pgrad = param_norms(table, "param_grad")
    if not pgrad.empty:
        summed = pgrad.assign(sq=pgrad["norm"] ** 2).groupby(["step", "layer"], sort=False)["sq"]
        total = summed.sum().reset_index()
        out[PARAM_GRAD_NORM] = wide(total, np.sqrt(total["sq"]), layers)
    update, weight = param_norms(table, "param_update"), param_norms(table, "param")
    if not update.empty and not weight.empty:
        both = update.merge(weight, on=["step", "layer", "param"], suffixes=("_u", "_w"))
        if not both.empty:
            both = both.assign(u=both["norm_u"] ** 2, w=both["norm_w"] ** 2)
            sums = both.groupby(["step", "layer"], sort=False)[["u", "w"]].sum().reset_index()
            out[UPDATE_RATIO] = wide(sums, np.sqrt(sums["u"]) / np.sqrt(sums["w"]), layers)
    if not outputs.empty and outputs["dead_frac"].notna().any():
        out["dead_frac (output)"] = wide(outputs, outputs["dead_frac"], layers)
    return {k: v for k, v in out.items() if not v.empty and v.notna().to_numpy().any()}
