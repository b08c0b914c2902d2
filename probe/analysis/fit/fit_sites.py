"""Where a fit reads: each block's MLP input (or its norm's input) and output among a run's
captures, which samples are held out, and which rows it leaves out (position 0 and special
tokens, whose outlier activations would dominate a fit and its measures, as the field leaves
them out)."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from probe.errors import DataError
from probe.models.anatomy import MLP_MODULES as MLP_NAMES
from probe.models.anatomy import MLP_NORM_MODULES as NORM_NAMES

log = logging.getLogger("probe.fit")


def held_out(samples: np.ndarray, num_samples: int, fraction: float, seed: int) -> np.ndarray:
    """Which rows are held out: those of samples `s` with `default_rng(seed).random(n)[s] <
    fraction` (whole samples, so no sequence gives rows to both sides)."""
    draws = np.random.default_rng(seed).random(max(num_samples, int(samples.max(initial=-1)) + 1))
    return draws[np.asarray(samples, np.int64)] < fraction


def special_token_ids(config: Any) -> frozenset[int] | None:
    """The special token ids of a run's tokenizer (dataset.tokenizer, else model.name); None
    where no tokenizer loads (a run of bare ids)."""
    from probe.data.text import _tokenizer
    from probe.errors import ProbeError

    named = (config.get("dataset") or {}).get("tokenizer")
    name = named or (config.get("model") or {}).get("name")
    if not name:
        return None
    try:
        return frozenset(int(i) for i in _tokenizer(str(name), named is not None).all_special_ids)
    except ProbeError:
        return None


def left_out(position, token, special: frozenset[int] | None) -> np.ndarray:
    """Which token rows a fit leaves out: position 0 and the special tokens (`special`; None:
    position 0 only)."""
    out = np.asarray(position) == 0
    if special:
        out |= np.isin(np.asarray(token), np.fromiter(special, np.int64, len(special)))
    return out


def left_out_rows(run, keep_special: bool) -> tuple[frozenset[int] | None, int]:
    """(the special token ids a fit of `run` leaves out, None where no tokenizer loads or with
    `keep_special`; how many of its token rows it leaves out), with a warning where no tokenizer
    loads (position 0 alone is left out then)."""
    if keep_special:
        return None, 0
    special = special_token_ids(run.config)
    if special is None:
        log.warning(
            "no tokenizer loads for %s: position-0 rows are left out, special tokens elsewhere "
            "are not known and stay in (--keep-special keeps position 0 too)",
            run.path,
        )
    tokens = run.tokens()
    return special, int(left_out(tokens["position"], tokens["id"], special).sum())


@dataclass(frozen=True)
class LayerSites:
    """Where block `layer`'s transcoder reads and what it predicts: (layer, site) of the run."""

    layer: int
    inputs: tuple[str, str]
    outputs: tuple[str, str]


def _site(keys: set, layer: str, names: tuple[str, ...]) -> str | None:
    return next((s for s in names if (layer, s) in keys), None)


def find_sites(keys: list[tuple[str, str]], reads: str, mlp: str | None = None,
               norm: str | None = None) -> dict[int, LayerSites]:  # fmt: skip
    """Block index -> its MLP's input (or its norm's input) and output among a run's keys; the
    block's MLP is `<blocks>.<i>.<mlp>` (default: the MLP names the anatomy knows)."""
    have = set(keys)
    mlps, norms = (mlp,) if mlp else MLP_NAMES, (norm,) if norm else NORM_NAMES
    found: dict[int, dict] = {}
    pattern = re.compile(r"^(?:.*\.)?(\d+)\.(.+)$")
    for layer in dict.fromkeys(lay for lay, _ in keys):
        m = pattern.match(layer)
        if not m:
            continue
        block, suffix = int(m.group(1)), m.group(2)
        if suffix in mlps:
            found.setdefault(block, {})["mlp"] = layer
        elif suffix in norms:
            found.setdefault(block, {})["norm"] = layer
    out = {}
    for block, names in sorted(found.items()):
        if "mlp" not in names:
            continue
        output = _site(have, names["mlp"], ("output", "output.0"))
        source = names["mlp"] if reads == "mlp_in" else names.get("norm")
        inp = _site(have, source, ("input", "input.0")) if source else None
        if output and inp and source:  # (inp only where a source)
            out[block] = LayerSites(block, (source, inp), (names["mlp"], output))
    if not out:
        wanted = (
            f"each block's MLP ({' or '.join(mlps)}) input and output"
            if reads == "mlp_in"
            else f"each block's MLP output and its norm's ({' or '.join(norms)}) input"
        )
        stored = ", ".join(f"{lay} {s}" for lay, s in keys[:8]) or "nothing"
        raise DataError(
            f"the run holds no {reads} pairs: a fit needs {wanted} as token rows (run with "
            f"probes=mlp_io{' and a probe of the norm input' if reads == 'resid_mid' else ''}, or "
            f"name the modules with --mlp/--norm); it stores: {stored}"
            f"{' ...' if len(keys) > 8 else ''}"
        )
    return out
