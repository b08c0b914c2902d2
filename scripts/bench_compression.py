"""Which HDF5 compression pays for itself on real activations: size ratio and MB/s per filter.

    python scripts/bench_compression.py [--model resnet18] [--probes all_convs] [--batch 16]
                                        [--image-size 112] [--threads 1,2]
    pip install -e '.[bench]'      # optional: hdf5plugin's Blosc, Blosc2, LZ4 and Bitshuffle

One batch's captures (the conv outputs of resnet18 by default, copied in plain forward hooks) are
written to a new file once per filter, one chunk per dataset as the writer chunks them, best of
three; `ratio` is raw bytes over file bytes, `ms_per_batch` the time to compress and write them
(page cache, not fsync'ed: the CPU cost, which on two busy cores is what a filter takes from the
forward). Filters from hdf5plugin are skipped with a note when it is not installed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import bench_common  # noqa: F401 - first: it puts the repository root on sys.path
import h5py
import torch

from probe.testing.oracles import hooked, make_setup


def filters() -> dict[str, dict]:
    found = {
        "none": {},
        "lzf": {"compression": "lzf"},
        "gzip-1": {"compression": "gzip", "compression_opts": 1},
    }
    try:
        import hdf5plugin as p
    except ImportError:
        print("note: hdf5plugin is not installed; only HDF5's own filters are measured")
        return found
    found.update(
        {
            "blosc-lz4-shuffle": p.Blosc(cname="lz4", clevel=5, shuffle=p.Blosc.SHUFFLE),
            "blosc-lz4-bitshuffle": p.Blosc(cname="lz4", clevel=5, shuffle=p.Blosc.BITSHUFFLE),
            "blosc-zstd1-shuffle": p.Blosc(cname="zstd", clevel=1, shuffle=p.Blosc.SHUFFLE),
            "blosc2-lz4-shuffle": p.Blosc2(cname="lz4", clevel=5, filters=p.Blosc2.SHUFFLE),
            "lz4": p.LZ4(),
            "bitshuffle-lz4": p.Bitshuffle(cname="lz4"),
        }
    )
    return found


def captures(args) -> dict:
    setup = make_setup(
        [
            f"model={args.model}",
            f"probes={args.probes}",
            f"dataset.batch_size={args.batch}",
            f"dataset.num_samples={args.batch}",
            f"dataset.image_size={args.image_size}",
        ]
    )
    kept = {}
    keep = hooked(setup, lambda n, o: kept.__setitem__(n, o.clone().numpy()))
    with keep, torch.inference_mode():
        setup.model(setup.base.batches.items[0].inputs)
    return kept


def write_seconds(path: Path, arrays: dict, options: dict) -> float:
    best = float("inf")
    for _ in range(3):
        path.unlink(missing_ok=True)
        t = time.perf_counter()
        with h5py.File(path, "w") as f:
            for name, a in arrays.items():
                f.create_dataset(name, data=a, chunks=a.shape, **options)
        best = min(best, time.perf_counter() - t)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--probes", default="all_convs")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=112)
    parser.add_argument("--threads", default="1,2", help="BLOSC_NTHREADS values to try")
    args = parser.parse_args()
    arrays = captures(args)
    raw = sum(a.nbytes for a in arrays.values())
    print(f"{len(arrays)} datasets, {raw / 2**20:.1f} MB per batch")
    print(f"{'threads':>7} {'filter':22} {'ratio':>6} {'MB/s':>7} {'ms_per_batch':>12}")
    candidates = filters()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.h5"
        for threads in args.threads.split(","):
            os.environ["BLOSC_NTHREADS"] = threads  # read by Blosc at each compression
            for name, options in candidates.items():
                seconds = write_seconds(path, arrays, options)
                ratio = raw / path.stat().st_size
                mb_s = raw / 2**20 / seconds
                print(f"{threads:>7} {name:22} {ratio:6.3f} {mb_s:7.0f} {seconds * 1e3:12.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
