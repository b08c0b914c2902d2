"""The pieces of a self-contained HTML page (style, PNG figures as data URIs, the page itself),
shared by the run report and the feature cards."""

from __future__ import annotations

import base64
import html
import io

STYLE = (
    "body{font-family:sans-serif;margin:2em;max-width:1400px}table{border-collapse:collapse;"
    "font-size:12px}td,th{border:1px solid #ccc;padding:2px 6px;text-align:right;white-space:nowrap}"
    ".wide{overflow-x:auto}img{max-width:100%}pre{background:#f6f6f6;padding:1em;font-size:12px}"
)


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def figure_png(fig) -> bytes:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def img(png: bytes, alt: str) -> str:
    return f'<figure><img alt="{html.escape(alt)}" src="{data_uri(png)}"></figure>'


def page(title: str, body: str) -> str:
    t = html.escape(title)
    return (
        f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{t}</title>'
        f"<style>{STYLE}</style></head><body><h1>{t}</h1>{body}</body></html>\n"
    )
