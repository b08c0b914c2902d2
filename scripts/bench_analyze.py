"""Benchmark `python -m probe.analyze` (linear probes and CKA) on a run file several times larger
than the memory the analyses are given: peak RSS against the bound and the file's size.

    python scripts/bench_analyze.py --gb 1 --memory 64,256 [--dir /tmp/bench_analyze] [--keep]

Writes the run with `probe.launch.run` (a small conv net over planted data: two conv layers' full
outputs, and a 3072-wide linear layer, count-sketched to --max-features), then in a child process
per bound (torch is never imported there) runs both analyses with `--memory` set to it and reads
the child's own peak RSS (VmHWM); an import-only child gives the interpreter's floor.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench_common import ROOT  # the repository root, put on sys.path there

HWM = """
print([int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")][0])
"""
CHILD_IMPORT = "import probe.analysis.streamed_analyses\nprint(0.0)\n" + HWM
LINEAR = ["layer", "features", "source_features", "accuracy", "chance", "samples_train"]
CKA = ["layer_a", "layer_b", "cka", "method"]
CHILD_ANALYZE = (
    """
import sys, time
from probe.analysis.streamed_analyses import main
t = time.perf_counter()
assert main([sys.argv[1], "all", "--memory", sys.argv[2], "--max-features", sys.argv[3]]) == 0
assert "torch" not in sys.modules
print(time.perf_counter() - t)
"""
    + HWM
)


def write_run(out: Path, gigabytes: float, batch: int = 64) -> int:
    """A complete run of about `gigabytes` through probe.launch.run; returns the file's size."""
    import torch
    from torch import nn

    import probe

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(3, 32, 3, padding=1)
            self.conv2 = nn.Conv2d(32, 64, 3, stride=2, padding=1)
            self.fc = nn.Linear(64 * 16 * 16, 3072)
            self.head = nn.Linear(3072, 4)

        def forward(self, x):
            h = torch.relu(self.conv2(torch.relu(self.conv1(x))))
            return self.head(torch.relu(self.fc(h.flatten(1))))

    per_sample = (32 * 32 * 32 + 64 * 16 * 16 + 3072) * 4
    batches = max(1, round(gigabytes * 2**30 / per_sample / batch))
    corners = torch.tensor([[1.0, 1, -1], [1, -1, 1], [-1, 1, 1], [-1, -1, -1]])

    def data():
        g = torch.Generator().manual_seed(0)
        for _ in range(batches):
            y = torch.randint(0, 4, (batch,), generator=g)
            x = torch.randn(batch, 3, 32, 32, generator=g) + corners[y][:, :, None, None]
            yield x, y

    torch.manual_seed(0)
    probes = {"bench": {"layers": ["conv1", "conv2", "fc"]}}
    probe.run(Net(), data(), probes, out=out, progress=False).close()
    return (out / "probe.h5").stat().st_size


def child(code: str, *args: str) -> tuple[float, float, str]:
    """(seconds, peak RSS in MB, stderr) of a child process."""
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True
    )
    if out.returncode:
        raise SystemExit(f"child failed:\n{out.stderr[-3000:]}")
    words = out.stdout.split()
    return float(words[-2]), int(words[-1]) / 1024, out.stderr


def sketch_check(run: Path) -> str:
    """The sketched pairs of cka.csv beside the exact CKA of the same features held in memory."""
    import numpy as np
    import pandas as pd

    from probe.analysis.cka import linear_cka
    from probe.store.runfile import open_probe_file

    table = pd.read_csv(run / "cka.csv")
    table = table[table.method == "sketch"].copy()
    with open_probe_file(run / "probe.h5") as f:

        def features(layer):
            a = f[f"layers/{layer}/output"][:]
            return a.mean(axis=(2, 3), dtype=np.float64) if a.ndim == 4 else a.astype(np.float64)

        table["exact"] = [
            linear_cka(features(a), features(b))
            for a, b in zip(table.layer_a, table.layer_b, strict=True)
        ]
    table["error"] = table.cka - table.exact
    return table[["layer_a", "layer_b", "cka", "exact", "error"]].to_string(index=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0, help="run file size in GiB (default 1)")
    parser.add_argument("--memory", default="64,256", help="bounds in MB, comma-separated")
    parser.add_argument("--max-features", type=int, default=2048, help="wider: sketched")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/bench_analyze"))
    parser.add_argument("--keep", action="store_true", help="keep the run afterwards")
    parser.add_argument(
        "--check", action="store_true", help="also the exact CKA of sketched pairs, in memory"
    )
    args = parser.parse_args()
    bounds = [float(b) for b in args.memory.split(",")]
    run = args.dir / "run"
    if args.dir.exists():
        shutil.rmtree(args.dir)
    t = time.perf_counter()
    size = write_run(run, args.gb)
    print(f"wrote {run / 'probe.h5'}: {size / 2**20:.0f} MB in {time.perf_counter() - t:.1f} s")
    _, floor, _ = child(CHILD_IMPORT)
    rows = []
    for bound in bounds:
        seconds, peak, _ = child(CHILD_ANALYZE, str(run), str(bound), str(args.max_features))
        rows.append((bound, peak, seconds))
    import pandas as pd

    for name, columns in (("linear_probes", LINEAR), ("cka", CKA)):
        print(pd.read_csv(run / f"{name}.csv")[columns].to_string(index=False))
    print(f"import-only floor (numpy, h5py, pandas; no torch): {floor:.0f} MB peak RSS")
    print(
        "| file MB | bound MB | peak RSS MB | peak - floor MB | file / bound | file / peak "
        "| (peak - floor) / bound | seconds |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    mb = size / 2**20
    for bound, peak, seconds in rows:
        print(
            f"| {mb:.0f} | {bound:.0f} | {peak:.0f} | {peak - floor:.0f} | {mb / bound:.1f} "
            f"| {mb / peak:.1f} | {(peak - floor) / bound:.2f} | {seconds:.1f} |"
        )
    if args.check:
        print(sketch_check(run))
    if not args.keep:
        shutil.rmtree(args.dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
