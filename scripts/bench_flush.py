"""What the flush after every batch costs, side by side with the same writer not flushing.

    python scripts/bench_flush.py [--batches 1000] [--datasets 20] [--row 64]

Tiny batches (one sample of `row` floats per dataset) are the worst case for a per-batch flush;
the ratio printed is (flush every batch) / (no flush) wall time for the same records.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from probe.hooks.record import Record
from probe.plan import StoreSpec
from probe.store.sink import RunFile, Sink


def write(path: Path, records: list[Record], flush: bool) -> float:
    writer = Sink(RunFile(path), StoreSpec(queue_batches=4))
    if not flush:
        writer.file.flush = lambda: None  # the comparison point: HDF5 flushes only on close
    t = time.perf_counter()
    for r in records:
        writer.put(r)
    writer.close(complete=True)
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", type=int, default=1000)
    p.add_argument("--datasets", type=int, default=20)
    p.add_argument("--row", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=1)
    a = p.parse_args()
    g = torch.Generator().manual_seed(0)
    records = [
        Record(
            i * a.batch_size,
            a.batch_size,
            i,
            {
                (f"m{k}", "output"): torch.randn(a.batch_size, a.row, generator=g)
                for k in range(a.datasets)
            },
        )
        for i in range(a.batches)
    ]
    with tempfile.TemporaryDirectory() as d:
        times = {}
        for rep in range(2):  # alternate, keep the best of two
            for flush in (True, False):
                t = write(Path(d) / f"{flush}{rep}.h5", records, flush)
                times[flush] = min(times.get(flush, t), t)
    per = {k: v / a.batches * 1e3 for k, v in times.items()}
    print(
        f"{a.batches} batches x {a.datasets} datasets x {a.batch_size}x{a.row} float32: "
        f"flush every batch {per[True]:.3f} ms/batch, no flush {per[False]:.3f} ms/batch, "
        f"ratio {times[True] / times[False]:.2f}"
    )


if __name__ == "__main__":
    main()
