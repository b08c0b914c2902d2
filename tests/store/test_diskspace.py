"""The space guard's estimate covers what a batch really adds to the file."""

from __future__ import annotations

import torch

from probe.hooks.record import Record
from probe.hooks.step_context import Outputs
from probe.plan import StoreSpec
from probe.store.diskspace import METADATA_MARGIN, bytes_needed
from tests.helpers import sink_of


def test_estimate_covers_the_growth_of_the_file(tmp_path):
    path = tmp_path / "probe.h5"
    writer = sink_of(path, StoreSpec(chunk_bytes=1 << 16), module_types={"conv": "Conv2d"})
    try:
        for i in range(3):
            record = Record(
                start=4 * i,
                size=4,
                batch_index=i,
                values={("conv", "output"): torch.randn(4, 8, 16, 16)},
                per_batch={("conv", "param_grad.weight"): torch.randn(1, 8, 3, 3, 3)},
                targets=torch.arange(4),
                outputs=Outputs(samples={"model/output": torch.randn(4, 10)}),
            )
            before = path.stat().st_size
            need = bytes_needed(writer, record)
            writer._take(record)
            grown = path.stat().st_size - before
            assert grown <= need, (i, grown, need)
            if i == 0:  # the first batch allocates chunks that hold at least its own bytes
                assert (
                    need - METADATA_MARGIN >= 4 * 8 * 16 * 16 * 4 + 8 * 27 * 4 + 4 * 8 * 2 + 4 * 40
                )
    finally:
        writer.close(complete=True)
