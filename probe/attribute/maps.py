"""Attribution maps from an activation and the objective's gradient, computed where they live.

gradient x activation (Captum's LayerGradientXActivation) keeps the activation's layout; the CAM
family reduces the unit axis of an (N, C, H, W) map (a token layout (N, T, C) through its probe's
`cam_grid`) and is kept raw and signed at the layer's resolution: no ReLU, no min-max, no resize,
which happen when a map is drawn. Formulas as pytorch-grad-cam writes them (FIELD-NOTES).
Every site also gets `SITE.sum`, each sample's total (for grad x activation at a layer that
feeds a linear head through average pooling: the logit minus its bias), and channel sites
`SITE.units`, each sample's sum of |attribution| per unit: their statistics are attribution.csv.
"""

from __future__ import annotations

import dataclasses

import torch

from probe.errors import ConfigError
from probe.layout import unit_axis
from probe.site_keys import CAM_SITES, SiteKey

EPS_PP, EPS_X = 1e-6, 1e-7  # pytorch-grad-cam's GradCAM++ and XGradCAM epsilons


def grid(x: torch.Tensor, sel, where: str) -> torch.Tensor:
    """x as (N, C, H, W): an image layout as it is, a token layout (N, T, C) through cam_grid."""
    if sel.cam_grid is not None and x.ndim == 3:
        h, w = sel.cam_grid
        skip = sel.cam_skip_tokens
        if x.shape[1] - skip != h * w:
            raise ConfigError(
                f"{where}: cam_grid={[h, w]} holds {h * w} tokens but the layer has "
                f"{x.shape[1]} tokens ({x.shape[1] - skip} after cam_skip_tokens={skip}); give a "
                "grid whose height x width is the patch tokens' count"
            )
        return x[:, skip:].reshape(len(x), h, w, -1).permute(0, 3, 1, 2)
    if x.ndim == 4 and sel.cam_grid is None:
        return x
    raise ConfigError(
        f"{where}: a CAM needs a (N, C, H, W) layout, and this layer's is {tuple(x.shape)}; for a "
        "token layout (N, T, C) set the probe's cam_grid: [height, width] (and cam_skip_tokens: 1 "
        "for a class token), or capture grad_x_output instead"
    )


def cam(site: str, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The (N, H, W) map of CAM `site` from (N, C, H, W) activation and gradient."""
    if site == "hirescam":
        return (g * a).sum(1)
    if site == "layercam":
        return (g.clamp(min=0) * a).sum(1)
    if site == "gradcam":
        weights = g.mean((2, 3))
    elif site == "gradcam_pp":
        g2 = g * g
        alpha = g2 / (2 * g2 + a.sum((2, 3))[:, :, None, None] * g2 * g + EPS_PP)
        weights = (g.clamp(min=0) * torch.where(g != 0, alpha, 0)).sum((2, 3))
    else:  # xgradcam
        weights = (g * a / (a.sum((2, 3))[:, :, None, None] + EPS_X)).sum((2, 3))
    return (weights[:, :, None, None] * a).sum(1)


def attribution_maps(item, tokens) -> dict[str, tuple[torch.Tensor, object]]:
    """{dataset name: (values, the selection to keep them by)} for what `item` (a
    probe.hooks.backward.Attributed) explains, except ig_output (probe.attribute.integrated)."""
    a, g, sel = item.value.float(), item.grad.float(), item.selection
    where = f"probe {sel.probe!r} layer {item.layer!r}"
    out = {}
    for site in item.sites:
        if site == "ig_output":
            continue
        is_cam = site in CAM_SITES
        values = cam(site, grid(a, sel, where), grid(g, sel, where)) if is_cam else g * a
        key = dataclasses.replace(item.key, family=site)  # at the value's path and call
        out.update(with_totals(key, values, sel, tokens, is_cam, where))
    return out


def with_totals(key: SiteKey, values, sel, tokens, is_map: bool, where: str) -> dict:
    """The values, each sample's total and, for channel layouts, each sample's |values| per unit;
    padding left out of both."""
    flat = dataclasses.replace(sel, reduce="none", rows="samples", unit_axis=1)
    out = {str(key): (values, flat if is_map else sel)}
    masked = values
    padded = tokens is not None and tokens.mask is not None
    if padded and values.ndim >= 2 and not is_map and values.shape[1] == tokens.length:
        shape = (*tokens.mask.shape, *([1] * (values.ndim - 2)))
        masked = values * tokens.mask.to(values.device).view(shape)
    out[str(dataclasses.replace(key, derived="sum"))] = (
        masked.reshape(len(masked), -1).sum(1),
        flat,
    )
    if not is_map and values.ndim >= 2:
        axis = unit_axis(sel.unit_axis, sel.class_axis, values.ndim, where)
        rest = [d for d in range(1, values.ndim) if d != axis]
        units = masked.abs().sum(rest) if rest else masked.abs()
        out[str(dataclasses.replace(key, derived="units"))] = (units, flat)
    return out


def take_maps(batch, tokens) -> None:
    """Every attribution map of the batch's explained values into the batch's captures."""
    for item in batch.attributed:
        if item.grad is None:
            continue
        for key, (values, sel) in attribution_maps(item, tokens).items():
            batch.take((item.layer, key), values, sel)
