"""The examples a run kept per unit (`stats.topk`, `stats.bottomk`, `stats.topk_quantiles`) as a
table: each row's value, sample and position, what the sample is (its path or document), and for
token data the token and its context decoded with the run's tokenizer.

    run.topk("transformer.h.3", "output", unit=17, context=(8, 4))
"""

from __future__ import annotations

import logging

import numpy as np
import pandas as pd

from probe.stats.topk import POSITION_BITS, quantile_groups
from probe.store import stats_file

log = logging.getLogger("probe")
KIND = {"top": "top", "bottom": "bottom", "quantiles": "sample"}


def examples_table(run, layer: str, site: str = "output", unit=None, kind: str = "top",
                   context: tuple[int, int] = (8, 4), tokenizer=None) -> pd.DataFrame:  # fmt: skip
    """One row per kept example of `unit` (an int, a list, or None: every unit), best first:
    unit, rank, value, sample, position (and y, x for maps; quantile for kind=quantiles), the
    sample's path or document where the run names them, and for token data `token_id`,
    `token`, `context` (L tokens before, R after, the example's token in [[ ]])."""
    if kind not in KIND:
        raise ValueError(f"kind={kind!r} is unknown; choose top, bottom or quantiles")
    info = stats_file.read(run.file).get((layer, site))
    state = None if info is None else info.topk
    if state is None or KIND[kind] not in state.kinds:
        raise KeyError(
            f"{run.h5_path} kept no {kind} examples of {layer!r} {site}: run with stats.topk=K "
            "(stats.bottomk, stats.topk_quantiles)"
        )
    values, keys = state.kinds[KIND[kind]]
    units = range(len(keys)) if unit is None else np.atleast_1d(unit).tolist()
    rows = []
    for u in units:
        groups = (
            quantile_groups(values[u], keys[u], state.spec.quantiles)
            if kind == "quantiles"
            else None
        )
        for rank, (v, key) in enumerate(zip(values[u], keys[u], strict=True)):
            if key < 0:
                continue
            row = {"unit": u, "rank": rank, "value": float(v),
                   "sample": int(key >> POSITION_BITS), "position": int(key & ((1 << POSITION_BITS) - 1))}  # fmt: skip
            if groups is not None:
                row["quantile"] = int(groups[rank])
            rows.append(row)
    columns = ["unit", "rank", "value", "sample", "position"]
    table = pd.DataFrame(rows, columns=columns + (["quantile"] if kind == "quantiles" else []))
    if kind == "quantiles" and len(table):
        table = table.sort_values(["unit", "quantile", "value"], ascending=[True, False, False])
    _locate(table, info)
    _names(table, run)
    _tokens(table, run, context, tokenizer)
    return table.reset_index(drop=True)


def _locate(table: pd.DataFrame, info) -> None:
    """y and x of a map's position (the axes after the unit axis, of a (C, H, W) row)."""
    shape, axis = tuple(info.shape), info.stats.unit_axis
    if info.rows != "samples" or len(shape) != 3 or axis != 1:
        return
    y, x = np.unravel_index(table["position"].to_numpy(), shape[1:])
    table["y"], table["x"] = y, x
    table["map_height"], table["map_width"] = shape[1], shape[2]


def _names(table: pd.DataFrame, run) -> None:
    """The sample's path (imagefolder) or document (text), where the run stored them."""
    f = run.file
    if "samples/index" not in f or not len(table):
        return
    index = f["samples/index"][: run.num_samples]
    at = {int(s): i for i, s in enumerate(index)}
    for name in ("path", "document"):
        if f"samples/{name}" in f:
            stored = f[f"samples/{name}"][: run.num_samples]
            table[name] = [_text(stored[at[s]]) if s in at else None for s in table["sample"]]


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _tokens(table: pd.DataFrame, run, context: tuple[int, int], tokenizer) -> None:
    """token_id, token and context of token-data examples, from /tokens/* (the run's token rows)."""
    f = run.file
    if "tokens/id" not in f or not len(table):
        return
    n = run.num_tokens
    sample, position, ids = (f[f"tokens/{k}"][:n] for k in ("sample", "position", "id"))
    starts = np.searchsorted(sample, table["sample"].to_numpy(), side="left")
    ends = np.searchsorted(sample, table["sample"].to_numpy(), side="right")
    decode = _decoder(run, tokenizer)
    left, right = context
    token_ids: list[int] = []
    tokens: list[str | None] = []
    texts: list[str | None] = []
    for s, e, p in zip(starts, ends, table["position"].to_numpy(), strict=True):
        where = s + np.flatnonzero(position[s:e] == p)
        if not len(where):
            token_ids.append(-1)
            tokens.append(None)
            texts.append(None)
            continue
        i = int(where[0])
        token_ids.append(int(ids[i]))
        tokens.append(decode([int(ids[i])]))
        before, after = ids[max(s, i - left) : i], ids[i + 1 : min(e, i + 1 + right)]
        texts.append(f"{decode(before.tolist())}[[{tokens[-1]}]]{decode(after.tolist())}")
    table["token_id"], table["token"], table["context"] = token_ids, tokens, texts


def _decoder(run, tokenizer):
    """The run's tokenizer's decode (dataset.tokenizer, else model.name), or ids as `<id>`."""
    if tokenizer is None:
        from probe.data.text import _tokenizer
        from probe.errors import ProbeError

        cfg = run.config
        named = cfg.get("dataset", {}).get("tokenizer")
        name = named or cfg.get("model", {}).get("name")
        try:
            tokenizer = _tokenizer(str(name), named is not None) if name else None
        except ProbeError as e:  # an example table still helps without text
            log.info("no tokenizer for %s (%s): token ids shown", run.h5_path, e)
    if tokenizer is None:
        return lambda ids: " ".join(f"<{i}>" for i in ids)
    return lambda ids: tokenizer.decode(ids)
