"""The measures fit.csv reports of a transcoder over held-out rows."""

from __future__ import annotations

import torch

from probe.models.transcoder import Transcoder


@torch.no_grad()
def evaluate(t: Transcoder, batches) -> dict:
    """FVU (sum of squared errors over the sum of squares about the rows' mean, float64), mean
    active features per row and the share of features never active, over `batches` of (x, y)."""
    t = Transcoder(**{n: getattr(t, n).double() for n in ("W_enc", "b_enc", "W_dec", "b_dec")},
                   layer=t.layer, activation=t.activation, k=t.k,
                   threshold=None if t.threshold is None else t.threshold.double(),
                   W_skip=None if t.W_skip is None else t.W_skip.double())  # fmt: skip
    sse = active = rows = 0.0
    total = sq = None
    fired = torch.zeros(t.d_tc, dtype=torch.bool)
    for x, y in batches:
        x, y = x.double(), y.double()
        acts = t.encode(x)
        pred = t.decode(acts) + t.skip(x)
        sse += float((y - pred).pow(2).sum())
        on = acts != 0
        active += float(on.sum())
        fired |= on.any(0)
        total = y.sum(0) if total is None else total + y.sum(0)
        sq = y.pow(2).sum(0) if sq is None else sq + y.pow(2).sum(0)
        rows += len(x)
    if not rows:
        return {"fvu": float("nan"), "l0": float("nan"), "dead": float("nan"), "held_out_rows": 0}
    assert sq is not None and total is not None  # rows were read
    sst = float((sq - total.pow(2) / rows).sum())
    return {"fvu": sse / sst if sst > 0 else float("nan"), "l0": active / rows,
            "dead": 1 - float(fired.double().mean()), "held_out_rows": int(rows)}  # fmt: skip
