"""A sparse autoencoder on a layer's output (a probe's `sae` key): its latents and its error as
sites of the layer, and optionally the layer's output replaced by the reconstruction (`splice`,
with the error added back by `error_term`, leaving the model exact).

Latents are computed where the output lives, in float32 (the SAE's weights moved there once),
over the probe's unit axis. While recording, the sums of the SAE's report accumulate on that
device (real tokens only): rows, squared error, the feature sums and squares (so the fraction of
variance unexplained is 1 - sum|x - x_hat|^2 / sum|x - mean x|^2, SAELens's definition), active
latents per row (L0) and per latent (dead ones); one host copy at the end.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from probe.errors import ConfigError
from probe.layout import unit_axis
from probe.models.sae import SAE, check_width, load_sae
from probe.plan import SaeSpec

MAX_ACTIVE = 128  # slots a row for a standard or JumpReLU SAE's sparse latents (TopK: its k)
MODES = ("observe", "splice", "off", "zero")  # off: the layer as it is; zero: its output zeroed


def sae_site(selection) -> SaeSite | None:
    """The SAE a selection's probe names (its SaeSpec, probe.plan), loaded (errors name the
    file), or None."""
    if isinstance(selection.sae, SaeSite) or selection.sae is None:
        return selection.sae
    return SaeSite(selection.name, selection.sae)


def load_saes(selections: list) -> list:
    """The selections with their SAEs loaded (errors name the file). A spliced SAE is refused
    beside gradient sites: the reconstruction is made from the detached output, so no
    gradient would flow back through the spliced layer."""
    from probe.site_keys import BACKWARD_SITES

    selections = [dataclasses.replace(s, sae=sae_site(s)) for s in selections]
    spliced = [s for s in selections if s.sae is not None and s.sae.spec.splice]
    backward = sorted({site for s in selections for site in s.sites if site in BACKWARD_SITES})
    if spliced and backward:
        raise ConfigError(
            f"probe {spliced[0].probe!r}: sae.splice=true on layer {spliced[0].name!r} with "
            f"gradient sites in the run ({', '.join(backward)}): gradients do not flow through "
            "a spliced SAE here; splice in a run without them, or take the gradients unspliced"
        )
    return selections


def take_sae(batch, layer: str, site: SaeSite, x: torch.Tensor, sel) -> torch.Tensor:
    """The layer's output through its SAE: `sae.latents` and `sae.error` taken as sites while
    recording; returns what the model goes on with."""
    axis = unit_axis(sel.unit_axis, sel.class_axis, x.ndim, f"probe {sel.probe!r} layer {layer!r}")
    sparse = not site.spec.dense and sel.reduce == "none"  # (a mean over positions is not sparse)
    slotted = sparse and batch.keep_values  # the rows stored as slots
    onward, latents, error = site.apply(x, axis, batch.tokens, batch.recording, slotted)
    if latents is not None and batch.recording:
        if sparse:  # statistics and examples of the latents; their rows as slots
            batch.take((layer, "sae.latents"), latents, sel, store=False)
            if batch.keep_values:
                index, value = active_slots(latents, axis, site.slots)
                for name, t in (("sae.latents.index", index), ("sae.latents.value", value)):
                    batch.take_plain((layer, name), t, sel, d_sae=site.sae.d_sae)
        else:
            dense = dataclasses.replace(sel, dtype="float16") if site.spec.dense else sel
            batch.take((layer, "sae.latents"), latents, dense)
        batch.take((layer, "sae.error"), error, sel)
    return onward


def active_slots(latents: torch.Tensor, axis: int, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A row's active latents, largest first, in `slots` places on the unit axis: (indices int32,
    -1 in an empty slot; values, 0 there). Rows with more active latents keep their largest."""
    z = latents.movedim(axis, -1)
    values, index = torch.topk(z, min(slots, z.shape[-1]), dim=-1)
    active = values > 0
    index = torch.where(active, index, -1).to(torch.int32)
    return index.movedim(-1, axis), torch.where(active, values, 0.0).movedim(-1, axis)


class SaeSite:
    """One SAE on one layer's output, its mode (what the model goes on with) and its sums."""

    def __init__(self, layer: str, spec: SaeSpec):
        self.layer, self.spec = layer, spec
        self.sae: SAE = load_sae(spec.path)
        self.mode = "splice" if spec.splice else "observe"
        self.placed: dict[torch.device, SAE] = {}
        self.sums: dict[str, torch.Tensor] = {}
        k = self.sae.k if self.sae.architecture == "topk" else 0
        self.slots = spec.max_active or k or MAX_ACTIVE  # sparse latents' places a row
        self.slotted = False  # latents were stored in slots

    def on(self, device: torch.device) -> SAE:
        if device not in self.placed:
            self.placed[device] = self.sae.to(device=device, dtype=torch.float32)
        return self.placed[device]

    def apply(self, x: torch.Tensor, axis: int, tokens, recording: bool, slotted: bool = False):
        """(what the model goes on with, latents, error): latents and error laid out as x, with
        d_sae and d_in units on `axis`."""
        if self.mode == "off":
            return x, None, None
        if self.mode == "zero":
            return torch.zeros_like(x), None, None
        units = x.detach().movedim(axis, -1)
        check_width(self.sae, units.shape[-1], f"probe sae on layer {self.layer!r}")
        sae = self.on(x.device)
        u = units.float()
        z = sae.encode(u)
        rebuilt = sae.decode(z)
        error = u - rebuilt
        if recording:
            self._add(u, z, error, tokens, self.slots if slotted else 0)
            self.slotted = self.slotted or slotted
        out = x
        if self.mode == "splice":
            spliced = rebuilt + error if self.spec.error_term else rebuilt
            out = spliced.to(x.dtype).movedim(-1, axis)
        return out, z.movedim(-1, axis), error.movedim(-1, axis)

    def _add(
        self, u: torch.Tensor, z: torch.Tensor, error: torch.Tensor, tokens, slots: int
    ) -> None:
        """The report's sums over this batch's real rows, in float64 on the device (padding
        weighted 0: no indexing by a mask, so no host sync); with `slots`, the rows whose active
        latents did not all fit them."""
        padded = tokens is not None and tokens.mask is not None and u.ndim >= 3
        padded = padded and u.shape[1] == tokens.length  # (N, T, ..., units): real tokens only
        u, z, error = (t.reshape(-1, t.shape[-1]) for t in (u, z, error))
        weight = torch.ones(len(u), dtype=torch.float64, device=u.device)
        if padded:
            real = tokens.mask.to(u.device).reshape(-1, 1).expand(-1, len(u) // tokens.mask.numel())
            weight = real.reshape(-1).double()
        u64 = u.double()
        batch = {
            "rows": weight.sum(),
            "squared_error": (error.double().pow(2).sum(1) * weight).sum(),
            "sum": (u64 * weight[:, None]).sum(0),
            "sum_squares": (u64.pow(2).sum(1) * weight).sum(),
            "active": ((z > 0).double() * weight[:, None]).sum(0),
        }
        if slots:
            batch["truncated_rows"] = (((z > 0).sum(1) > slots).double() * weight).sum()
        for k, v in batch.items():
            self.sums[k] = self.sums[k] + v if k in self.sums else v

    def report(self) -> dict:
        """rows, l0, fvu, dead_latents, dead_frac of what was recorded (NaN-free zeros if none)."""
        s = {k: v.double().cpu() for k, v in self.sums.items()}
        if not s:  # (the layer never ran while recording)
            return {"rows": 0, "l0": math.nan, "fvu": math.nan, "dead_latents": 0,
                    "dead_frac": math.nan, "d_sae": self.sae.d_sae,
                    "architecture": self.sae.architecture, "slots": 0, "truncated_rows": 0}  # fmt: skip
        n = float(s["rows"])
        spread = float(s["sum_squares"]) - float(s["sum"].pow(2).sum()) / n
        return {
            "rows": int(n),
            "l0": float(s["active"].sum()) / n,
            "fvu": float(s["squared_error"]) / spread if spread > 0 else float("nan"),
            "dead_latents": int((s["active"] == 0).sum()),
            "dead_frac": float((s["active"] == 0).double().mean()),
            "d_sae": self.sae.d_sae,
            "architecture": self.sae.architecture,
            "slots": self.slots if self.slotted else 0,
            "truncated_rows": int(s["truncated_rows"]) if "truncated_rows" in s else 0,
        }
