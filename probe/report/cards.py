"""Feature cards: per unit or SAE latent, what makes it fire. Its top (and quantile) examples as
highlighted token text or image thumbnails with the maximum marked, a histogram of its active
values, its frequency, and for SAE latents the tokens its decoder direction promotes.

    python -m probe.analyze RUN topk --layer transformer.h.3 [--site sae.latents]
        [--units 3 17] [--order frequency|max] [--cards 32]

writes `cards_<layer>_<site>.html` in the run directory; `probe.report` shows a few per site.
Cards follow `--order` and stop at `--cards` (a page budget): each holds at most the run's K
examples and the quantile groups' rows.
"""

from __future__ import annotations

import argparse
import html
import io
import sys
from pathlib import Path

import numpy as np

from probe.errors import ProbeError

HIST_BYTES = 64 << 20  # rows read for a card's histogram

ORDERS = ("frequency", "max")


def card_units(run, layer: str, site: str, units, order: str, limit: int) -> list[int]:
    """The units to draw: those asked, else the most frequent (or largest) active ones."""
    table = run.units(layer, site)
    if units:
        bad = [u for u in units if not 0 <= int(u) < len(table)]
        if bad:
            raise ValueError(
                f"--units {' '.join(map(str, bad))}: {layer!r} {site} has units 0 to "
                f"{len(table) - 1}; give units in that range"
            )
        return [int(u) for u in units][:limit]
    if table.empty:
        raise KeyError(f"{run.h5_path} holds no per-unit statistics of {layer!r} {site}")
    key = "frac_positive" if order == "frequency" else "max"
    table = table[table["frac_positive"] > 0].sort_values(key, ascending=False, kind="stable")
    return table["unit"].astype(int).tolist()[:limit]


def cards_html(run, layer: str, site: str = "output", units=None, order: str = "frequency",
               limit: int = 32) -> str:  # fmt: skip
    """The cards of one (layer, site) as HTML sections."""
    if order not in ORDERS:
        raise ValueError(f"order={order!r} is unknown; choose {' or '.join(ORDERS)}")
    picked = card_units(run, layer, site, units, order, limit)
    stats = run.units(layer, site).set_index("unit")
    top = run.topk(layer, site, unit=picked)
    try:
        sampled = run.topk(layer, site, unit=picked, kind="quantiles")
    except KeyError:
        sampled = None
    promoted = _promoted(run, layer) if site == "sae.latents" else None
    parts = [f"<h3>Feature cards: {html.escape(layer)} {html.escape(site)} (by {order})</h3>"]
    for u in picked:
        s = stats.loc[u]
        head = (f"unit {u}: active on {100 * s['frac_positive']:.2f}% of rows, max "
                f"{s['max']:.4g}, mean {s['mean']:.4g}")  # fmt: skip
        body = [_examples(run, top[top["unit"] == u])]
        rows = None if sampled is None else sampled[sampled["unit"] == u]
        if rows is not None and len(rows):
            body.append("<p>quantile samples (highest group first):</p>" + _examples(run, rows))
        values = rows["value"].to_numpy() if rows is not None and len(rows) else None
        body.append(_histogram(run, layer, site, u, values))
        if promoted is not None and u < len(promoted):
            body.append(f"<p>promotes: {html.escape(', '.join(promoted[u]))}</p>")
        parts.append(f'<div class="card"><h4>{html.escape(head)}</h4>{"".join(body)}</div>')
    return "".join(parts)


def _examples(run, rows) -> str:
    """One line per example: its value and context (the token in <mark>), or its sample and
    place (an image's thumbnail with the place marked, where the run names the image)."""
    lines = []
    for _, r in rows.iterrows():
        where = f"{r['value']:.4g}"
        if "context" in rows and isinstance(r.get("context"), str):
            text = html.escape(r["context"]).replace("[[", "<mark>").replace("]]", "</mark>")
            lines.append(f"<li><code>{where}</code> {text}</li>")
        elif "path" in rows and isinstance(r.get("path"), str) and "y" in rows:
            lines.append(f"<li><code>{where}</code> {_thumbnail(run, r)}</li>")
        else:
            place = (
                f"y={int(r['y'])}, x={int(r['x'])}"
                if "y" in rows
                else f"position {int(r['position'])}"
            )
            lines.append(f"<li><code>{where}</code> sample {int(r['sample'])}, {place}</li>")
    return "<ul>" + "".join(lines) + "</ul>"


def _thumbnail(run, r) -> str:
    """The image (imagefolder root + path), 96 px, a red box on the map cell of the maximum."""
    from PIL import Image, ImageDraw

    from probe.report.html_parts import data_uri

    root = run.config.get("dataset", {}).get("root")
    try:
        image = Image.open(Path(str(root)) / r["path"]).convert("RGB")
    except (OSError, TypeError):
        return html.escape(f"{r['path']} (not readable here)")
    image.thumbnail((96, 96))
    draw = ImageDraw.Draw(image)
    height, width = r.get("map_height", 0), r.get("map_width", 0)
    if height and width:
        cell_h, cell_w = image.height / height, image.width / width
        box = [r["x"] * cell_w, r["y"] * cell_h, (r["x"] + 1) * cell_w, (r["y"] + 1) * cell_h]
        draw.rectangle(box, outline=(255, 0, 0), width=2)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    name = html.escape(str(r["path"]))
    return f'<img alt="{name}" title="{name}" src="{data_uri(buf.getvalue())}">'


def _stored_column(run, layer: str, site: str, unit: int) -> np.ndarray | None:
    """The unit's stored values over the first rows (at most HIST_BYTES of rows read), along its
    unit axis; for latents stored in slots, the values of the slots that hold it. None where the
    run stored no rows."""
    from probe.read.latents import SparseLatents
    from probe.store import stats_file

    try:
        lazy = run.array(layer, site)
    except KeyError:
        return None
    row_bytes = max(1, int(np.prod(lazy.shape[1:], dtype=np.int64)) * lazy.dtype.itemsize)
    rows = max(1, min(len(lazy), HIST_BYTES // row_bytes))
    if isinstance(lazy, SparseLatents):  # (never dense: the slots that name the unit)
        return np.asarray(lazy.values[:rows][lazy.indices[:rows] == unit], np.float64)
    info = stats_file.read(run.file).get((layer, site))
    axis = info.stats.unit_axis if info is not None else 1
    return np.take(np.asarray(lazy[:rows]), unit, axis=axis).astype(np.float64).reshape(-1)


def _histogram(run, layer: str, site: str, unit: int, sampled) -> str:
    """Active values of the unit: its stored column (a full run), else the seeded sample."""
    import matplotlib.pyplot as plt

    from probe.report.html_parts import figure_png, img

    values = _stored_column(run, layer, site, unit)
    if values is None:
        values = sampled
    if values is None:
        return ""
    values = values[np.isfinite(values) & (values > 0)]
    if not len(values):
        return "<p>(never active)</p>"
    fig, ax = plt.subplots(figsize=(3.2, 1.6))
    ax.hist(values, bins=30)
    ax.set_title(f"active values ({len(values)})", fontsize=7)
    ax.tick_params(labelsize=6)
    fig.tight_layout()
    return img(figure_png(fig), f"unit {unit} histogram")


def _promoted(run, layer: str):
    """Decoded tokens each latent promotes (sae_tokens.npz of the run), or None."""
    path = run.path / "sae_tokens.npz"
    if not path.is_file():
        return None
    with np.load(path) as found:
        if f"{layer}/ids" not in found:
            return None
        ids = found[f"{layer}/ids"]
    from probe.read.example_rows import _decoder

    decode = _decoder(run, None)
    return [[decode([int(i)]) for i in row] for row in ids]


def write_cards(path, layer: str, site: str, units=None, order="frequency", limit=32) -> Path:
    from probe.read.runs import open_run
    from probe.report.html_parts import page

    with open_run(path) as run:
        body = cards_html(run, layer, site, units, order, limit)
        out = run.path / f"cards_{layer.replace('/', '_')}_{site}.html"
    out.write_text(page(f"Feature cards: {layer} {site}", body), encoding="utf-8")
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m probe.analyze RUN topk", description=__doc__.splitlines()[0]
    )
    parser.add_argument("path", type=Path)
    parser.add_argument("analysis", choices=["topk"])
    parser.add_argument("--layer", required=True)
    parser.add_argument("--site", default="output")
    parser.add_argument("--units", nargs="*", type=int, default=None)
    parser.add_argument("--order", choices=ORDERS, default="frequency")
    parser.add_argument("--cards", type=int, default=32, help="at most this many cards")
    args = parser.parse_args(argv)
    try:
        print(write_cards(args.path, args.layer, args.site, args.units, args.order, args.cards))
    except (ProbeError, KeyError, ValueError) as e:
        print(f"probe.analyze: error: {e}", file=sys.stderr)
        return 2
    return 0
