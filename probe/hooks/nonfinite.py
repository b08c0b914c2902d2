"""NaN and Inf in captures: counted by the statistics, reported after the run, optionally fatal."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from probe.errors import ModelError
from probe.hooks.record import Record

log = logging.getLogger("probe")


def check_batch(record: Record, counted: Mapping[tuple[str, str], Any]) -> None:
    """ModelError naming the first capture, in execution order, that holds NaN or Inf. Captures
    whose batch statistics are already taken (`counted`) are judged by them, the others by
    their values."""
    if record.ready is not None:  # host copies of GPU tensors are readable once their copy ran
        record.ready.synchronize()
    for key, t in [*record.values.items(), *record.per_batch.items()]:
        if key in counted:
            nan, inf = counted[key].nan_count, counted[key].inf_count
        elif t.is_floating_point():
            nan = int(torch.isnan(t).sum())
            inf = int(torch.isinf(t).sum())
        else:
            continue
        if nan or inf:
            raise ModelError(
                f"layer {key[0]!r} {key[1]} produced {nan} NaN and {inf} Inf values in the batch "
                f"that starts at sample {record.start} (the first layer to do so); the batches up "
                "to and including it are written. Check the model and inputs, or set "
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
