"""Benchmark `python -m probe.summarize` on a big probe.h5: peak RSS and read throughput against a
raw h5py chunked read of the same file, measured side by side.

    python scripts/bench_summarize.py --gb 2 [--dir /tmp/bench_summarize] [--keep]
    python scripts/bench_summarize.py --gb 1 --shapes 4096,4096,1000    # linear layers' outputs

Writes a complete probe.h5 of about GB gigabytes (by default conv-like float32 datasets; per-sample
shapes from --shapes; post-ReLU values, chunked as the writer chunks them), then in child
processes: a raw read of every dataset in chunk-aligned slabs, and `probe.read.summaries` on the run
directory, each twice and timed the second time (the first warms the page cache, and may compile
the statistics kernels into numba's disk cache). Targets: summarize peak RSS under 500 MB,
throughput within 2x of the raw read.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench_common import ROOT  # the repository root, put on sys.path there

SHAPES = "64x56x56,128x28x28,256x14x14"  # per-sample shapes of the datasets

# The child's own peak RSS (VmHWM): ru_maxrss of children carries over the forking parent's.
HWM = """
print([int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")][0])
"""

CHILD_RAW = (
    """
import sys, time, h5py
from probe.read.slabs import SLAB_BYTES
t = time.perf_counter(); total = 0
with h5py.File(sys.argv[1]) as f:
    n = int(f.attrs["num_samples"])
    for name in [f"layers/{l}/{s}" for l in f["layers"] for s in f["layers"][l]]:
        ds = f[name]
        step = max(1, SLAB_BYTES // (ds[0].nbytes * ds.chunks[0])) * ds.chunks[0]
        for lo in range(0, n, step):  # plain h5py, the same slabs of whole chunks
            total += ds[lo : lo + step].nbytes
print(total, time.perf_counter() - t)
"""
    + HWM
)

CHILD_IMPORT = (
    """
import time
t = time.perf_counter()
import probe.read.summaries  # numpy, numba, h5py, pandas: the floor of any summarize process
print(0, time.perf_counter() - t)
"""
    + HWM
)

CHILD_SUMMARIZE = (
    """
import sys, time
from probe.read.summaries import main
t = time.perf_counter()
code = main([sys.argv[1]])
print(-1, time.perf_counter() - t)
"""
    + HWM
    + """
sys.exit(code)
"""
)


def write_file(path: Path, gigabytes: float, shapes: list[tuple[int, ...]]) -> int:
    import h5py
    import numpy as np

    from probe.store.fileformat import FORMAT_VERSION

    per_sample = sum(int(np.prod(s)) * 4 for s in shapes)
    rows = max(1, int(gigabytes * 2**30 / per_sample))
    rng = np.random.default_rng(0)
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as f:
        f.attrs.update(format_version=FORMAT_VERSION, store_mode="full", config="{}")
        for i, shape in enumerate(shapes):
            row_bytes = int(np.prod(shape)) * 4
            chunk_rows = max(1, (1 << 20) // row_bytes)
            g = f.create_group(f"layers/layer{i + 1}.conv")
            g.attrs.update(module_type="Conv2d" if len(shape) == 3 else "Linear", order=i)
            ds = g.create_dataset(
                "output", shape=(rows, *shape), dtype="f4", chunks=(chunk_rows, *shape)
            )
            block = np.maximum(rng.standard_normal((64, *shape), dtype=np.float32), 0)
            for lo in range(0, rows, 64):
                hi = min(rows, lo + 64)
                ds[lo:hi] = block[: hi - lo] * (1 + lo / rows)
        f.attrs["num_samples"] = rows
        f.attrs["complete"] = True
    return path.stat().st_size


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    """'64x56x56,4096' -> [(64, 56, 56), (4096,)]."""
    try:
        shapes = [tuple(int(n) for n in s.split("x")) for s in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(n < 1 for s in shapes for n in s):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a list of per-sample shapes; write them like 64x56x56,4096"
        )
    return shapes


def child(code: str, arg: Path) -> tuple[float, float, int]:
    """(seconds of work, peak RSS in MB, exit code) of a child process."""
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code, str(arg)], env=env, capture_output=True, text=True
    )
    words = out.stdout.split()
    return float(words[-2]), int(words[-1]) / 1024, out.returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=2.0, help="file size in GiB (default 2)")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/bench_summarize"))
    parser.add_argument("--keep", action="store_true", help="keep the file afterwards")
    parser.add_argument(
        "--shapes",
        type=parse_shapes,
        default=SHAPES,
        help=f"per-sample shapes, comma-separated (default {SHAPES})",
    )
    args = parser.parse_args()
    h5 = args.dir / "probe.h5"
    t = time.perf_counter()
    size = write_file(h5, args.gb, args.shapes)
    print(f"wrote {h5}: {size / 2**30:.2f} GiB in {time.perf_counter() - t:.1f} s")
    _, import_rss, _ = child(CHILD_IMPORT, h5)
    raw_s, raw_rss, _ = child(CHILD_RAW, h5)  # warms the page cache for both
    raw_s, raw_rss, _ = child(CHILD_RAW, h5)
    # the first summarize may compile the statistics kernels (numba caches them on disk)
    first_s, _, _ = child(CHILD_SUMMARIZE, args.dir)
    sum_s, sum_rss, code = child(CHILD_SUMMARIZE, args.dir)
    result = {
        "shapes": ",".join("x".join(map(str, s)) for s in args.shapes),
        "file_gib": round(size / 2**30, 3),
        "raw_read_mb_s": round(size / 2**20 / raw_s, 1),
        "summarize_mb_s": round(size / 2**20 / sum_s, 1),
        "summarize_time_over_raw": round(sum_s / raw_s, 2),
        "first_summarize_s": round(first_s, 2),
        "summarize_s": round(sum_s, 2),
        "import_only_peak_rss_mb": round(import_rss, 1),
        "raw_peak_rss_mb": round(raw_rss, 1),
        "summarize_peak_rss_mb": round(sum_rss, 1),
        "summarize_exit": code,
    }
    print(json.dumps(result, indent=1))
    if not args.keep:
        shutil.rmtree(args.dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
