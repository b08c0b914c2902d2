"""Figures of a run's attribution sites: CAM maps over the input images, attribution by depth,
and token attributions as coloured text.

Maps are stored raw and signed at the layer's resolution; here they are drawn on a diverging
scale symmetric about zero, one scale per map (its colour bar says it), stretched over the image.
The inputs are rebuilt from the run's config (samples are visited in a fixed order); a run of
the Python API on the caller's batches has none to rebuild, and its maps are drawn alone.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from probe.attribute.table import base_site, is_attribution  # noqa: E402
from probe.site_keys import CAM_SITES  # noqa: E402

SAMPLES = 6  # first samples drawn
MAX_MAPS = 4  # CAM (layer, site) columns
MAX_TOKENS = 48  # tokens shown per sample


def first_inputs(config, count: int = SAMPLES):
    """The run's first `count` inputs rebuilt from its config: images (N, C, H, W) scaled to
    [0, 1] for display, or {"input_ids", "attention_mask"}; None where they cannot be rebuilt."""
    dataset = config.get("dataset") or {}
    if dataset.get("name") in (None, "python"):
        return None
    try:
        import torch
        from omegaconf import open_dict

        from probe.data.batches import build_batches

        if dataset.get("name") == "random_tokens" and dataset.get("vocab_size") is None:
            from transformers import AutoConfig  # the model's vocabulary, from its config file

            with open_dict(config):
                config.dataset.vocab_size = AutoConfig.from_pretrained(
                    str(config.model.name), local_files_only=True
                ).vocab_size
        inputs = []
        for batch in build_batches(config.dataset, config.model, int(config.seed)):
            inputs.append(batch.inputs)
            if sum(len(x["input_ids"] if isinstance(x, dict) else x) for x in inputs) >= count:
                break
    except Exception:  # noqa: BLE001 - a dataset moved away: the maps are drawn alone
        return None
    first = inputs[0]  # (every batch of one dataset is of its kind)
    if isinstance(first, dict):
        token_batches = [x for x in inputs if isinstance(x, dict)]
        return {k: torch.cat([x[k] for x in token_batches])[:count] for k in first if k != "labels"}
    images = torch.cat([x for x in inputs if isinstance(x, torch.Tensor)])[:count].float().numpy()
    lo = images.min(axis=(1, 2, 3), keepdims=True)
    span = np.maximum(images.max(axis=(1, 2, 3), keepdims=True) - lo, 1e-12)
    return (images - lo) / span


def cam_keys(run) -> list[tuple[str, str]]:
    """(layer, site) of the run's stored CAM maps (N, H, W), in the run's order."""
    return [
        (layer, site)
        for layer, site in run.keys
        if base_site(site) in CAM_SITES and is_attribution(site) and _stored(run, layer, site)
    ][:MAX_MAPS]


def _stored(run, layer: str, site: str) -> bool:
    from probe.store.fileformat import layer_path

    return layer_path(layer, site) in run.file and len(run.array(layer, site)) > 0


def cam_figure(run, images, title: str = "") -> plt.Figure | None:
    """One row per sample: the input, then each CAM map over it on its own symmetric scale."""
    keys = cam_keys(run)
    if not keys:
        return None
    n = min(SAMPLES, run.num_samples)
    fig, axes = plt.subplots(
        n, len(keys) + 1, figsize=(2.2 * (len(keys) + 1) + 0.6, 2.1 * n + 0.6), squeeze=False
    )
    for i in range(n):
        ax = axes[i, 0]
        ax.axis("off")
        if images is not None and i < len(images):
            ax.imshow(_displayable(images[i]), interpolation="nearest")
        ax.set_title(f"sample {i}", fontsize=7)
        for j, (layer, site) in enumerate(keys, start=1):
            ax = axes[i, j]
            ax.axis("off")
            m = np.asarray(run.array(layer, site)[i], dtype=np.float32)
            limit = float(np.nanmax(np.abs(m))) or 1.0
            height, width = m.shape if images is None else images[i].shape[-2:]
            if images is not None and i < len(images):
                ax.imshow(_displayable(images[i]), interpolation="nearest")
            shown = ax.imshow(
                m, cmap="RdBu_r", vmin=-limit, vmax=limit, alpha=0.55 if images is not None else 1,
                interpolation="bilinear", extent=(-0.5, width - 0.5, height - 0.5, -0.5),
            )  # fmt: skip
            bar = fig.colorbar(shown, ax=ax, fraction=0.046, pad=0.02)
            bar.ax.tick_params(labelsize=5)
            ax.set_title(f"{layer} {site}", fontsize=6)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def _displayable(image: np.ndarray) -> np.ndarray:
    """(C, H, W) in [0, 1] as imshow takes it: (H, W, 3) or (H, W)."""
    if image.shape[0] == 1:
        return image[0]
    return np.moveaxis(image[:3], 0, -1)


def depth_figure(table: pd.DataFrame, title: str = "") -> plt.Figure | None:
    """Mean |attribution| and the per-sample sum (mean +- std) by layer, one line per site."""
    if table is None or not len(table):
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    for site, part in table.groupby(table["site"].map(base_site), sort=False):
        x = np.arange(len(part))
        axes[0].plot(x, part["abs_mean"], marker="o", label=site)
        mean, std = part["sum_mean"].astype(float), part["sum_std"].astype(float)
        axes[1].errorbar(x, mean, yerr=std, marker="o", capsize=3, label=site)
    layers = list(dict.fromkeys(table["layer"]))
    for ax, label in zip(axes, ("mean |attribution|", "per-sample sum"), strict=True):
        ax.set_xticks(range(len(layers)), layers, rotation=60, ha="right", fontsize=6)
        ax.set_ylabel(label, fontsize=8)
        ax.legend(fontsize=6)
    axes[0].set_yscale("log")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def token_scores(run, layer: str, site: str, mask) -> list[np.ndarray]:
    """Each of the first samples' attribution per real token (summed over its features), from
    (N, T, C) rows of samples or from token rows (/tokens/sample)."""
    from probe.store.fileformat import layer_path

    array = run.array(layer, site)
    n = min(SAMPLES, len(mask))
    if run.file[layer_path(layer, site)].attrs.get("row_unit") != "tokens":
        rows = [np.asarray(array[i], dtype=np.float64).sum(-1) for i in range(n)]
        return [r[np.asarray(mask[i]).astype(bool)] for i, r in enumerate(rows)]
    sample = run.file["tokens/sample"][: len(array)]
    out = []
    for i in range(n):
        at = np.flatnonzero(sample == i)
        out.append(np.asarray(array[at[0] : at[-1] + 1], dtype=np.float64).sum(-1))
    return out


def token_figure(tokens: list[list[str]], scores: list[np.ndarray], title: str = ""):
    """Tokens as text on a diverging background per sample (one scale per sample)."""
    if not tokens:
        return None
    fig, ax = plt.subplots(figsize=(12, 0.5 + 0.9 * len(tokens)))
    ax.axis("off")
    cmap = plt.get_cmap("RdBu_r")
    for row, (words, values) in enumerate(zip(tokens, scores, strict=False)):
        limit = float(np.abs(values).max()) or 1.0
        x = 0.0
        for word, v in list(zip(words, values, strict=False))[:MAX_TOKENS]:
            colour = cmap(0.5 + 0.5 * float(v) / limit)
            ax.text(x, -row, word, fontsize=8, family="monospace", va="center",
                    bbox={"facecolor": colour, "edgecolor": "none", "pad": 1.5})  # fmt: skip
            x += 0.012 * max(len(word), 1) + 0.012
        ax.text(-0.01, -row, f"{row}", fontsize=7, ha="right", va="center")
    ax.set_xlim(-0.03, 1.0)
    ax.set_ylim(-len(tokens) + 0.5, 0.5)
    if title:
        ax.set_title(title, fontsize=9)
    return fig


def decode(config, ids) -> list[list[str]]:
    """Each row of ids as token strings through the run's tokenizer, where one loads."""
    name = (config.get("dataset") or {}).get("tokenizer") or (config.get("model") or {}).get("name")
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(name), local_files_only=True)
    except Exception:  # noqa: BLE001 - no tokenizer: the ids themselves
        return [[str(int(i)) for i in row] for row in ids]
    rows = [[int(i) for i in row] for row in ids]  # (an id the tokenizer lacks: the id itself)
    return [
        [
            t if t is not None else str(i)
            for t, i in zip(tok.convert_ids_to_tokens(r), r, strict=True)
        ]
        for r in rows
    ]


def attribution_figures(run, table: pd.DataFrame | None, title: str) -> dict:
    """{file name: Figure} of a run's attributions (none without attribution sites)."""
    figures = {}
    depth = depth_figure(table, f"attribution by depth: {title}")
    if depth is not None:
        figures["attribution.png"] = depth
    inputs = first_inputs(run.config) if cam_keys(run) or _token_sites(run) else None
    images = inputs if isinstance(inputs, np.ndarray) else None
    cams = cam_figure(run, images, f"CAM maps (per-map scale): {title}")
    if cams is not None:
        figures["cams.png"] = cams
    if isinstance(inputs, dict):
        mask = inputs.get("attention_mask")
        ids = inputs["input_ids"].numpy()
        mask = np.ones_like(ids) if mask is None else mask.numpy()
        for layer, site in _token_sites(run)[:2]:
            words = decode(
                run.config, [row[m.astype(bool)] for row, m in zip(ids, mask, strict=True)]
            )
            scores = token_scores(run, layer, site, mask)
            name = f"tokens_{layer.replace('/', '_')}_{site}.png"
            figures[name] = token_figure(words, scores, f"{layer} {site}: {title}")
    return figures


def _token_sites(run) -> list[tuple[str, str]]:
    """Stored attribution sites per token of a token model's run: (N, T, C) rows of samples, or
    token rows."""
    from probe.config import TOKEN_DATASETS

    if (run.config.get("dataset") or {}).get("name") not in (*TOKEN_DATASETS, "pairs"):
        return []
    return [
        (layer, site)
        for layer, site in run.keys
        if base_site(site) in ("grad_x_output", "grad_x_input", "ig_output")
        and is_attribution(site)
        and _stored(run, layer, site)
        and len(run.array(layer, site).shape) in (2, 3)
    ]
