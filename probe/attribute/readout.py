"""Which reader of the residual stream a run has (`lens=logit|tuned|dla`), built from the
model's anatomy, and the tables its rows make: lens.csv (layer x metric) and dla.csv."""

from __future__ import annotations

import logging

import numpy as np
import pandas as pd

from probe.attribute.dla import DirectLogit
from probe.attribute.lens import ANSWER, PER_TOKEN, Lens
from probe.errors import ConfigError
from probe.hooks.module_select import block_names, match_modules, warn_nested
from probe.models.anatomy import anatomy
from probe.plan import LensSpec, Selector

log = logging.getLogger("probe")


def build_readout(cfg: LensSpec, model, has_answers: bool):
    """A Lens or a DirectLogit for a run plan's `lens.*` (None for lens=none); errors name what
    the model or the data lacks."""
    if cfg.name == "none":
        return None
    body = anatomy(model, block_names(model))
    modules = dict(model.named_modules())
    if body.unembed is None or body.final_norm is None:
        raise ConfigError(
            f"lens={cfg.name} decodes the residual stream through the final norm and the "
            f"unembedding, and this {body.family!r} model has "
            f"{'no unembedding (an LM head)' if body.unembed is None else 'no final norm'}: load "
            "it with its head (model.task=causal_lm or masked_lm), or name them with "
            "model.anatomy.final_norm=NAME model.anatomy.unembed=NAME"
        )
    norm, unembed = modules[body.final_norm], modules[body.unembed]
    if cfg.name == "dla":
        if not has_answers and not cfg.tokens:
            raise ConfigError(
                "lens=dla projects onto answer minus wrong, and this dataset gives no answers: "
                "use dataset=pairs with answer and wrong, or lens.tokens=[ANSWER_ID,WRONG_ID]"
            )
        tokens = list(cfg.tokens) if cfg.tokens else None
        return DirectLogit(model, body, norm, unembed, tokens)
    layers = match_modules(model, "lens.layers", Selector(layers=cfg.layers))
    warn_nested("lens.layers", list(cfg.layers), [n for n, _ in layers])
    body.width = int(getattr(unembed, "in_features", unembed.weight.shape[1]))
    return Lens(cfg, layers, norm, unembed, body)


def lens_table(f) -> pd.DataFrame | None:
    """lens.csv from a run file's /lens: per layer, each metric's mean over real tokens (the
    next token's cross-entropy over tokens followed by one; answer metrics over samples)."""
    if "lens" not in f or "lens/kl" not in f:
        return None
    layers = [n.decode() if isinstance(n, bytes) else str(n) for n in f["lens/layers"][:]]
    tokens, follows = f["lens/tokens"][:, 0], f["lens/next_tokens"][:, 0]
    table = {"layer": layers}
    for m in PER_TOKEN:
        table[m] = (f[f"lens/{m}"][:] * tokens[:, None]).sum(0) / max(tokens.sum(), 1)
    table["next_ce"] = (f["lens/next_ce"][:] * follows[:, None]).sum(0) / max(follows.sum(), 1)
    for m in ANSWER:
        if f"lens/{m}" in f:
            table[m] = f[f"lens/{m}"][:].mean(0)
    return pd.DataFrame(table)


def dla_table(f) -> pd.DataFrame | None:
    """dla.csv: per component (and layer, head) the mean and deviation over samples."""
    if "dla/values" not in f:
        return None
    values = f["dla/values"][:].astype(np.float64)
    names = [n.decode() if isinstance(n, bytes) else str(n) for n in f["dla/components"][:]]
    rows = []
    for j, name in enumerate(names):
        component, layer, head = name.split("|")
        rows.append(
            {"component": component, "layer": layer, "head": int(head),
             "mean": values[:, j].mean(), "std": values[:, j].std()}
        )  # fmt: skip
    total = values.sum(1)
    rows.append({"component": "total", "layer": "", "head": -1, "mean": total.mean(),
                 "std": total.std()})  # fmt: skip
    own = f["dla/logit_diff"][:, 0].astype(np.float64)
    rows.append({"component": "logit_diff", "layer": "", "head": -1, "mean": own.mean(),
                 "std": own.std()})  # fmt: skip
    return pd.DataFrame(rows)


def write_readout_tables(h5_path, run_dir) -> None:
    """lens.csv and dla.csv of a finished run, from its file."""
    import h5py

    with h5py.File(h5_path, "r") as f:
        for name, table in (("lens.csv", lens_table(f)), ("dla.csv", dla_table(f))):
            if table is not None:
                table.to_csv(run_dir / name, index=False)
                log.info("wrote %s", run_dir / name)
