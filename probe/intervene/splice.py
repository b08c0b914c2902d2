"""What a sparse autoencoder costs the model it is spliced into: `sae.csv`, one row per layer with
an SAE (probe.hooks.sae_site).

Per layer: rows (real tokens), L0 (active latents a row), the fraction of variance unexplained
(FVU), dead latents, and for a spliced SAE on a language model the next-token loss with that SAE
alone spliced, with that layer's output zeroed, and clean, each from its own forward with the
hooks recording nothing; `ce_loss_recovered = (ce_zero - ce_spliced) / (ce_zero - ce_clean)`
(SAELens's ce_loss_score) and `delta_loss = ce_spliced - ce_clean`. The run's own forward
splices every spliced layer at once (what its captures saw).
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict

import numpy as np
import pandas as pd
import torch

from probe.hooks.forward import call, first_output
from probe.hooks.objective import build_objective
from probe.plan import ObjectiveSpec

log = logging.getLogger("probe")
PROMOTED_BLOCK = 256  # latents scored against the vocabulary at a time (256 x 256k: 256 MB)

COLUMNS = [
    "layer", "architecture", "d_sae", "spliced", "error_term", "rows", "l0", "fvu",
    "dead_latents", "dead_frac", "ce_clean", "ce_spliced", "ce_zero", "ce_loss_recovered",
    "delta_loss", "slots", "truncated_rows",
]  # fmt: skip


class SpliceReport:
    """The SAEs of a run's hooks and the loss sums of their extra forwards."""

    def __init__(self, capture):
        self.capture = capture
        self.sites = [(t.name, t.sae) for t in capture.hooked if t.sae is not None]
        self.spliced = [(name, s) for name, s in self.sites if s.spec.splice]
        self.loss: dict[tuple[str, str], list] = defaultdict(lambda: [0.0, 0.0])  # (sum, count)
        self.lm_loss = build_objective(ObjectiveSpec(name="lm_loss"), False)

    def measure(self, model, inputs, tokens, size: int, start: int, precision_ctx) -> None:
        """The extra forwards of one batch: each spliced SAE alone, its layer zeroed, clean."""
        if not self.spliced or not isinstance(inputs, dict) or "input_ids" not in inputs:
            return
        modes = {name: s.mode for name, s in self.sites}
        try:
            for name, _ in self.spliced:
                for mode in ("splice", "zero"):
                    self._set(name, mode)
                    self._forward(model, inputs, tokens, size, start, precision_ctx, (name, mode))
            self._set(None, "off")
            self._forward(model, inputs, tokens, size, start, precision_ctx, ("", "clean"))
        finally:
            for name, s in self.sites:
                s.mode = modes[name]

    def _set(self, layer: str | None, mode: str) -> None:
        for name, s in self.sites:
            s.mode = mode if name == layer else "off"

    def _forward(self, model, inputs, tokens, size, start, precision_ctx, key) -> None:
        self.capture.begin(size, start, tokens, recording=False)
        try:
            with torch.inference_mode(), precision_ctx():
                out = first_output(call(model, inputs))
        finally:
            self.capture.end()
        if out.ndim != 3:  # (not a language model's logits: no loss to report)
            return
        losses = self.lm_loss(out, None, inputs, tokens)  # (summed on the device: no sync)
        n, t = inputs["input_ids"].shape[:2]
        masked = tokens is not None and tokens.mask is not None
        held = self.loss[key]
        held[0] = held[0] + losses.double().sum()
        held[1] = held[1] + (tokens.mask[:, 1:].sum().double() if masked else float(n * (t - 1)))

    def table(self) -> pd.DataFrame:
        rows = []
        clean = self._mean(("", "clean"))
        for name, s in self.sites:
            row = {"layer": name, **s.report(), "spliced": s.spec.splice,
                   "error_term": s.spec.error_term, "ce_clean": clean}  # fmt: skip
            if row["truncated_rows"]:
                log.warning(
                    "layer %r: %d rows had more active SAE latents than the %d stored a row "
                    "(their smallest are not in sae.latents.value; statistics and examples saw "
                    "them all): raise sae.max_active or set sae.dense=true",
                    name, row["truncated_rows"], s.slots,
                )  # fmt: skip
            if s.spec.splice:
                spliced, zero = self._mean((name, "splice")), self._mean((name, "zero"))
                row.update(ce_spliced=spliced, ce_zero=zero, delta_loss=spliced - clean)
                gap = zero - clean
                row["ce_loss_recovered"] = (zero - spliced) / gap if gap else math.nan
            rows.append(row)
        return pd.DataFrame(rows, columns=COLUMNS)

    def promoted(self, model, top: int = 10) -> dict[str, np.ndarray]:
        """Per SAE, the tokens each latent's decoder direction promotes most through the
        model's unembedding (W_dec @ W_U^T, the final norm left out as SAE dashboards do):
        `<layer>/ids` and `<layer>/weights`, (d_sae, top); empty without an unembedding."""
        unembed = getattr(model, "get_output_embeddings", lambda: None)()
        weight = getattr(unembed, "weight", None)
        if weight is None or weight.ndim != 2:
            return {}
        out = {}
        for name, s in self.sites:
            if weight.shape[1] != s.sae.d_in:
                continue
            unembed_t = weight.detach().float().cpu().T
            ids, weights = [], []
            with torch.no_grad():  # (latents a block at a time: never d_sae x vocab at once)
                for block in s.sae.W_dec.float().split(PROMOTED_BLOCK):
                    found = torch.topk(block @ unembed_t, min(top, unembed_t.shape[1]), dim=1)
                    ids.append(found.indices)
                    weights.append(found.values)
            out[f"{name}/ids"], out[f"{name}/weights"] = (
                torch.cat(ids).numpy(),
                torch.cat(weights).numpy(),
            )
        return out

    def _mean(self, key) -> float:
        total, count = (float(v) for v in self.loss.get(key, (0.0, 0.0)))
        return total / count if count else math.nan
