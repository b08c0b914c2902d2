"""NaN and Inf in captures: counted by the statistics, reported after the run, optionally fatal."""

from __future__ import annotations

import logging

import torch

from probe.errors import ModelError
from probe.store import Record

log = logging.getLogger("probe")


def check_batch(record: Record) -> None:
    """ModelError naming the first capture, in execution order, that holds NaN or Inf."""
    if record.ready is not None:  # host copies of GPU tensors are readable once their copy ran
        record.ready.synchronize()
    for (layer, site), t in [*record.values.items(), *record.per_batch.items()]:
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            nan = int(torch.isnan(t).sum())
            raise ModelError(
                f"layer {layer!r} {site} produced {nan} NaN and {int(t.numel() - nan - torch.isfinite(t).sum())} "
                f"Inf values in the batch that starts at sample {record.start} (the first layer to do so); "
                "the batches up to and including it are written. Check the model and inputs, or set "
                "fail_on_nonfinite=false to count them and go on"
            )


def report(datasets) -> None:
    """Warn once per run about every (layer, site) whose values were not all finite."""
    bad = [i for i in datasets if i.stats.nan_count or i.stats.inf_count]
    for info in bad:
        log.warning(
            "layer %r %s: %d NaN and %d Inf values (counted apart from the statistics); "
            "fail_on_nonfinite=true stops at the first such layer",
            info.layer,
            info.site,
            info.stats.nan_count,
            info.stats.inf_count,
        )
