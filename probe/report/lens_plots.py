"""Figures of a run's lens and direct logit attribution: at which depth the answer forms.

lens.png: per layer the lens's metrics (lens.csv); lens_positions.png: the probability the lens
gives the final top-1 token, layer by position, for the first samples with their tokens along
the axis; lens_topk.png: the lens's top token per layer and position of the first sample;
dla.png: the mean direct effect of every head (layer by head) beside the MLPs and embeddings.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from probe.report.attribution_plots import decode, first_inputs  # noqa: E402

SAMPLES = 2


def lens_figures(run, title: str) -> dict:
    """{file name: Figure} of the run's /lens and /dla (none where it has neither)."""
    f, figures = run.file, {}
    if "lens/kl" in f:
        layers = [n.decode() if isinstance(n, bytes) else str(n) for n in f["lens/layers"][:]]
        table = lens_frame(run)
        figures["lens.png"] = metrics_figure(table, f"logit lens: {title}")
        inputs = first_inputs(run.config, SAMPLES)
        words = None
        if isinstance(inputs, dict):
            words = decode(run.config, inputs["input_ids"].numpy())
        positions = f["lens/top1_prob_positions"][:SAMPLES]
        figures["lens_positions.png"] = positions_figure(positions, layers, words, title)
        topk = f["lens/topk"][:1]
        if len(topk):
            figures["lens_topk.png"] = topk_figure(topk[0], layers, words, run.config, title)
    if "dla/values" in f:
        table = run.dla
        figures["dla.png"] = dla_figure(table, f"direct logit attribution: {title}")
    return figures


def lens_frame(run) -> pd.DataFrame:
    csv = run.path / "lens.csv"
    if csv.is_file():
        return pd.read_csv(csv)
    from probe.attribute.readout import lens_table

    return lens_table(run.file)


def metrics_figure(table: pd.DataFrame, title: str) -> plt.Figure:
    columns = [c for c in table.columns if c != "layer"]
    fig, axes = plt.subplots(1, len(columns), figsize=(2.3 * len(columns) + 0.5, 3), squeeze=False)
    for ax, c in zip(axes[0], columns, strict=True):
        ax.plot(range(len(table)), table[c], marker="o")
        ax.set_title(c, fontsize=8)
        ax.set_xticks(range(len(table)), table["layer"], rotation=70, fontsize=5)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def positions_figure(values: np.ndarray, layers, words, title: str) -> plt.Figure:
    """(samples, layers, positions) probabilities, one heatmap per sample."""
    fig, axes = plt.subplots(
        len(values), 1, figsize=(1.5 + 0.45 * values.shape[2], 1 + 0.4 * len(layers) * len(values)),
        squeeze=False,
    )  # fmt: skip
    for i, ax in enumerate(axes[:, 0]):
        image = ax.imshow(values[i], vmin=0, vmax=1, cmap="viridis", aspect="auto")
        ax.set_yticks(range(len(layers)), layers, fontsize=6)
        labels = words[i] if words is not None and i < len(words) else range(values.shape[2])
        ax.set_xticks(range(values.shape[2]), [str(w) for w in labels][: values.shape[2]],
                      rotation=70, fontsize=6)  # fmt: skip
        ax.set_title(f"sample {i}: p(final top-1) under the lens", fontsize=7)
        fig.colorbar(image, ax=ax)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    return fig


def topk_figure(topk: np.ndarray, layers, words, config, title: str) -> plt.Figure:
    """The lens's top token per layer (rows) and position (columns) of the first sample."""
    tops = decode(config, topk[..., 0])
    fig, ax = plt.subplots(figsize=(1.5 + 0.9 * topk.shape[1], 0.8 + 0.35 * len(layers)))
    ax.axis("off")
    columns = [str(w) for w in (words[0] if words else range(topk.shape[1]))][: topk.shape[1]]
    table = ax.table(cellText=tops, rowLabels=layers, colLabels=columns, loc="center")
    table.auto_set_font_size(False)
    table.set_fontsize(6)
    ax.set_title(f"the lens's top token, sample 0: {title}", fontsize=8)
    return fig


def dla_figure(table: pd.DataFrame, title: str) -> plt.Figure:
    heads = table[table.component == "attn_head"]
    layers = list(dict.fromkeys(heads.layer))
    grid = heads.pivot_table(index="layer", columns="head", values="mean").loc[layers]
    others = table[table.component.isin(["embed", "attn_bias", "mlp", "norm_bias", "unembed_bias"])]
    fig, axes = plt.subplots(1, 2, figsize=(11, 1.5 + 0.35 * max(len(layers), 4)))
    limit = float(np.abs(grid.to_numpy()).max()) or 1.0
    image = axes[0].imshow(grid.to_numpy(), cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto")
    axes[0].set_yticks(range(len(layers)), layers, fontsize=6)
    axes[0].set_xticks(range(grid.shape[1]), [str(h) for h in grid.columns])
    axes[0].set_xlabel("head")
    axes[0].set_title("each head's direct effect (mean)", fontsize=8)
    fig.colorbar(image, ax=axes[0])
    where = others.layer.fillna("")
    labels = [f"{c} {at}".strip() for c, at in zip(others.component, where, strict=True)]
    axes[1].barh(range(len(others)), others["mean"], xerr=others["std"])
    axes[1].set_yticks(range(len(others)), labels, fontsize=6)
    axes[1].set_title("embeddings, MLPs and biases", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig
