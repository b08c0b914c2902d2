"""Layer integrated gradients (`ig_output`), in activation space as Captum's
LayerIntegratedGradients computes them: (a - a') * sum_k w_k dF/da at a' + alpha_k (a - a').

For each batch and layer the model runs again on the batch repeated once per point, with the
layer's output replaced by the interpolated activation; `attribution.internal_batch_size` bounds
the rows of one pass. The completeness gap, sum(attribution) - (F(x) - F(x')), is stored per
sample as `ig_output.gap` (F(x') from one more forward with the layer at the baseline).
"""

from __future__ import annotations

import dataclasses
import logging
from contextlib import contextmanager

import h5py
import numpy as np
import torch

from probe.attribute.maps import with_totals
from probe.errors import ConfigError
from probe.hooks import device as devices
from probe.hooks.forward import call, to_device
from probe.hooks.hookset import HookSet
from probe.hooks.names import flatten, replace_tensors
from probe.hooks.objective import per_sample
from probe.layout import TokenBatch
from probe.plan import AttributionSpec
from probe.site_keys import ATTRIBUTION_SITES, SiteKey
from probe.store.fileformat import layer_path

log = logging.getLogger("probe")


def points(method: str, steps: int) -> tuple[list[float], list[float]]:
    """(alphas, weights) of the quadrature, as Captum's approximation_parameters gives them."""
    if method == "gausslegendre":
        x, w = np.polynomial.legendre.leggauss(steps)
        return list(0.5 * (x + 1)), list(0.5 * w)
    alphas = np.linspace(0, 1, steps)
    weights = np.full(steps, 1 / (steps - 1))
    weights[[0, -1]] /= 2  # riemann_trapezoid
    return list(alphas), list(weights)


@contextmanager
def replaced(module, key: SiteKey, value: torch.Tensor):
    """The module's output (the tensor its dataset's site `key` names: `output`, `output.0`,
    `output@1` for its 2nd call) replaced by `value` while inside."""
    path, target, calls = key.path, key.call, [0]

    def hook(m, args, output):
        calls[0] += 1
        if calls[0] - 1 != target:
            return None
        return replace_tensors(output, lambda p, t: value if p == path else t)

    with HookSet("ig_output") as hooks:
        hooks.forward(module, hook)
        yield


def _repeat(x, k: int):
    if isinstance(x, dict):
        return {key: _repeat(v, k) for key, v in x.items()}
    if isinstance(x, torch.Tensor):
        return x.repeat(k, *([1] * (x.ndim - 1))) if x.ndim else x
    return x


@dataclasses.dataclass
class Integrated:
    """What every batch's integrated gradients need: the settings and each layer's baseline."""

    steps: int
    method: str
    internal_batch_size: int | None
    baselines: dict[str, torch.Tensor]  # layer -> baseline (broadcast to its output)

    def take(self, batch, step, inputs, targets, tokens, side, f_x) -> None:
        """ig_output (and its totals and gap) of every layer of the batch that asks for it."""
        for item in batch.attributed:
            if "ig_output" not in item.sites:
                continue
            attr, gap = self.integrate(item, step, inputs, targets, tokens, side, f_x)
            where = f"probe {item.selection.probe!r} layer {item.layer!r}"
            ig = dataclasses.replace(item.key, family="ig_output")  # at the output's path and call
            for key, (values, sel) in with_totals(
                ig, attr, item.selection, tokens, False, where
            ).items():
                batch.take((item.layer, key), values, sel)
            flat = dataclasses.replace(item.selection, reduce="none", rows="samples")
            batch.take((item.layer, str(dataclasses.replace(ig, derived="gap"))), gap, flat)

    def integrate(self, item, step, inputs, targets, tokens, side, f_x):
        a = item.value
        base = self.baselines.get(item.layer, torch.zeros((), dtype=a.dtype))
        base = base.to(device=a.device, dtype=a.dtype)
        n = len(a)
        alphas, weights = points(self.method, self.steps)
        per_pass = max(1, (self.internal_batch_size or n) // n)
        total = torch.zeros_like(a, dtype=torch.float32)
        inputs = {k: v.detach() for k, v in inputs.items()} if isinstance(inputs, dict) else inputs
        inputs = inputs.detach() if isinstance(inputs, torch.Tensor) else inputs
        module = item.selection.module
        for lo in range(0, len(alphas), per_pass):
            chunk = alphas[lo : lo + per_pass]
            k = len(chunk)
            scaled = torch.cat([base + alpha * (a - base) for alpha in chunk])
            scaled = scaled.detach().requires_grad_(True)
            more = _repeat(inputs, k)
            ids = more.get("input_ids") if isinstance(more, dict) else None
            layout = None
            if tokens is not None:
                assert ids is not None  # token inputs: a dict holding input_ids
                layout = TokenBatch.of(ids, more.get("attention_mask"))
            autocast = devices.autocast(step.device, step.precision)
            with replaced(module, item.key, scaled), torch.enable_grad(), autocast:
                out = call(step.model, more)
                values = per_sample(
                    step.objective, out, _repeat(targets, k), more, layout, _repeat(side, k)
                )
            (g,) = torch.autograd.grad(values.sum(), scaled)
            for j, w in enumerate(weights[lo : lo + k]):
                total += w * g[j * n : (j + 1) * n].float()
        attr = (a - base).float() * total
        autocast = devices.autocast(step.device, step.precision)
        with replaced(module, item.key, base.expand_as(a)), torch.no_grad(), autocast:
            out = call(step.model, inputs)
            f_base = per_sample(step.objective, out, targets, inputs, tokens, side)
        gap = attr.reshape(n, -1).sum(1) - (f_x.detach().float() - f_base.float())
        return attr, gap


def baselines(
    cfg: AttributionSpec, model, batches, selections, device, precision: str
) -> dict[str, torch.Tensor]:
    """Each ig_output layer's baseline: zeros (nothing stored), the run's mean of the layer (a
    first pass over the data) or an earlier run's mean of its stored output rows. A token
    layout's mean is per feature, over samples and real tokens."""
    layers = {s.name: s for s in selections if "ig_output" in s.sites}
    if not layers or cfg.baseline == "zeros":
        return {}
    if cfg.baseline != "mean":
        return {name: _stored_mean(cfg.baseline, name) for name in layers}
    sums: dict[str, list] = {name: [0.0, 0] for name in layers}
    mask: list = [None]  # the batch's attention mask: a token layout's padding is left out

    def add(name):
        def hook(m, args, out):
            t = next(t for _, t in flatten(out)).detach().double()
            if t.ndim == 3:
                rows = t.reshape(-1, t.shape[-1])
                if mask[0] is not None and mask[0].shape == t.shape[:2]:
                    rows = rows[mask[0].reshape(-1).to(rows.device).bool()]
            else:
                rows = t
            sums[name][0] = sums[name][0] + rows.sum(0)
            sums[name][1] += len(rows)

        return hook

    log.info("attribution.baseline=mean: a first pass over the data for %s", ", ".join(layers))
    with HookSet("attribution.baseline=mean") as hooks:
        for n, s in layers.items():
            hooks.forward(s.module, add(n), name=n)
        with torch.inference_mode(), devices.autocast(device, precision):
            for batch in batches:
                inputs = batch.inputs
                mask[0] = inputs.get("attention_mask") if isinstance(inputs, dict) else None
                call(model, to_device(model, inputs, device))
    return {name: (total / max(count, 1)).float() for name, (total, count) in sums.items()}


def _stored_mean(run_dir: str, layer: str) -> torch.Tensor:
    """The mean over the rows of /layers/LAYER/output in RUN_DIR/probe.h5, read in slabs."""
    with h5py.File(f"{run_dir}/probe.h5", "r") as f:
        name = layer_path(layer, "output")
        if name not in f:
            raise ConfigError(
                f"attribution.baseline={run_dir!r} holds no {layer} output to take the mean of; "
                "give a run that captured it, or attribution.baseline=zeros|mean"
            )
        ds = f[name]
        total, step = np.zeros(ds.shape[1:]), max(1, (64 << 20) // max(ds[0].nbytes, 1))
        for lo in range(0, len(ds), step):
            total += ds[lo : lo + step].astype(np.float64).sum(0)
        return torch.from_numpy(total / max(len(ds), 1)).float()


def check_attribution_run(model, selections, edits, train_mode: bool) -> None:
    """Attribution sites explain one sample at a time: no train-mode BatchNorm (its statistics
    mix the batch), and integrated gradients' extra passes do not run the edits."""
    wanted = [s for s in selections if set(s.sites) & set(ATTRIBUTION_SITES)]
    if not wanted:
        return
    if train_mode:
        norm = next(
            (
                n
                for n, m in model.named_modules()
                if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
            ),
            None,
        )
        if norm is not None:
            raise ConfigError(
                f"train_mode=true with attribution sites ({wanted[0].name}: "
                f"{', '.join(set(wanted[0].sites) & set(ATTRIBUTION_SITES))}): BatchNorm layer "
                f"{norm!r} normalises over the batch in train mode, so one sample's attribution "
                "would depend on the others; use train_mode=false"
            )
    if edits and any("ig_output" in s.sites for s in wanted):
        raise ConfigError(
            "ig_output runs the model again per integration step without the run's edits; "
            "run integrated gradients without intervene edits (intervene=none)"
        )
