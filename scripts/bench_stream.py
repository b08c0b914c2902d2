"""Benchmark: reading a run's token rows for training, shuffled, against a plain sequential read.

    python scripts/bench_stream.py                       # 2048 x 128 tokens of width 256 (256 MB)
    python scripts/bench_stream.py --samples 512 --rounds 3 --out docs/bench/stream.md

A GPT-2-shaped model (bench_common) runs over seeded random ids through the pipeline (probes:
residual of one block, rows: tokens) into probe.h5. Then, each in a fresh subprocess, interleaved
per round, one epoch over the same rows (all in the page cache, so the figures are the readers'
own cost): `sequential`, the plain h5py read a user writes (`ds[lo:lo + 4096]`, a new array per
batch); `sequential_slab`, whole chunks into one reused array (the floor of any reader); `stream`, `run.dataset(layer, batch_size=4096)` shuffled with its default 64 MB buffer;
`stream_in_order` (shuffle=False); `stream_2_workers` (a DataLoader with two workers); and
`saelens`, SAELens's ActivationsStore over its own cache (a datasets folder of the same
activations, written once beforehand), train_batch_size_tokens 4096, the same buffer rows, where
sae_lens is installed. Per variant: the median rows/s, the median of per-round ratios to
`sequential`, and the peak RSS above the process after its imports. Target: the shuffled stream
at >= 0.5x sequential and faster than SAELens, its RSS bounded by the buffer, not the file.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_common as bc  # first: it puts the repository root on sys.path

LAYER, HOOK = "transformer.h.3", "blocks.3.hook_resid_post"
POSITIONS, BATCH = 128, 4096
BUFFER_BYTES = 64 << 20


def build(root: Path, samples: int, seed: int) -> Path:
    """The run: probes=residual on one block of the GPT-2-shaped model, rows: tokens."""
    import torch

    bc.save_gpt2(root / "model", POSITIONS, seed)
    g = torch.Generator().manual_seed(seed)
    torch.save(torch.randint(bc.VOCAB - 1, (samples, POSITIONS), generator=g), root / "ids.pt")
    out = subprocess.run(
        [sys.executable, "-m", "probe", "print_summary=false", "progress=false", "model=hf",
         f"model.name={root / 'model'}", "model.task=causal_lm", "dataset=tokens",
         f"dataset.path={root / 'ids.pt'}", "dataset.batch_size=32", "probes=residual",
         f"probes.residual.layers=[{LAYER}]", f"hydra.run.dir={root / 'run'}"],
        cwd=bc.ROOT, capture_output=True, text=True,
    )  # fmt: skip
    if out.returncode:
        raise SystemExit(out.stderr[-2000:])
    return root / "run"


def saelens_cache(run_dir: Path, cache: Path) -> None:
    """The same activations as SAELens's cache: a datasets folder, one (context, d_in) array
    per sequence in the column named by the hook."""
    import datasets
    import h5py

    from probe.store.fileformat import layer_path

    path, name = str(run_dir / "probe.h5"), layer_path(LAYER, "output")
    with h5py.File(path, "r") as f:
        width = f[name].shape[1]
    features = datasets.Features(
        {HOOK: datasets.Array2D(shape=(POSITIONS, width), dtype="float32")}
    )
    datasets.Dataset.from_generator(
        _sequences, features=features, gen_kwargs={"path": path, "name": name}
    ).save_to_disk(str(cache))


def _sequences(path: str, name: str):
    import h5py

    with h5py.File(path, "r") as f:
        ds = f[name]
        for lo in range(0, len(ds), POSITIONS * 64):
            for seq in ds[lo : lo + POSITIONS * 64].reshape(-1, POSITIONS, ds.shape[1]):
                yield {HOOK: seq}


# -- the variants, each run in a child process -------------------------------------------------
def child(variant: str, run_dir: Path, cache: Path) -> dict:
    import h5py
    import numpy as np
    import torch

    import probe
    import probe.read.runs  # noqa: F401  (imports, pandas among them, are not reading)
    import probe.read.stream  # noqa: F401

    torch.randperm(1 << 14)  # (torch's set-up on first use is not the reader's memory)
    with probe.open_run(run_dir) as run:
        rows_total = run.array(LAYER, "output").shape[0]
        width = run.array(LAYER, "output").shape[1]
    buffer_rows = BUFFER_BYTES // (4 * width)
    if variant == "saelens":
        store = _saelens_store(cache, width, rows_total, buffer_rows)
    bc.reset_peak()
    base = bc.status_mb("VmRSS")
    start, seen = time.perf_counter(), 0
    if variant == "sequential":  # what a user writes: a batch at a time, each a new array
        with h5py.File(run_dir / "probe.h5", "r") as f:
            ds = f[_path()]
            for lo in range(0, rows_total, BATCH):
                seen += len(torch.from_numpy(ds[lo : lo + BATCH]))
    elif variant == "sequential_slab":  # the floor: whole chunks into one reused array
        with h5py.File(run_dir / "probe.h5", "r") as f:
            ds = f[_path()]
            chunk = ds.chunks[0]
            slab = np.empty((chunk, width), ds.dtype)
            for lo in range(0, rows_total, chunk):
                hi = min(rows_total, lo + chunk)
                ds.read_direct(slab, np.s_[lo:hi], np.s_[: hi - lo])
                seen += hi - lo
    elif variant.startswith("stream"):
        with probe.open_run(run_dir) as run:
            stream = run.dataset(LAYER, batch_size=BATCH, shuffle=variant != "stream_in_order")
            workers = 2 if variant == "stream_2_workers" else 0
            loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=workers)
            for rows, _ in loader:
                seen += len(rows)
    else:
        while seen < rows_total - BATCH * 2:  # (the store serves whole batches, endlessly)
            seen += len(store.next_batch())
    wall = time.perf_counter() - start
    return {"rows": seen, "wall": wall, "rows_per_s": seen / wall,
            "rss_mb": bc.peak_rss_mb() - base}  # fmt: skip


def _path() -> str:
    from probe.store.fileformat import layer_path

    return layer_path(LAYER, "output")


def _saelens_store(cache: Path, width: int, rows: int, buffer_rows: int):
    import warnings

    from sae_lens.training.activations_store import ActivationsStore

    warnings.filterwarnings("ignore")
    return ActivationsStore(
        model=None, dataset=None, streaming=False, hook_name=HOOK, hook_head_index=None,
        context_size=POSITIONS, d_in=width, n_batches_in_buffer=buffer_rows // POSITIONS,
        total_training_tokens=rows, store_batch_size_prompts=32, train_batch_size_tokens=BATCH,
        prepend_bos=False, normalize_activations="none", device="cpu", dtype="float32",
        cached_activations_path=str(cache),
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tmp", default=None)
    p.add_argument("--out", default=None, help="also write the results as markdown to OUT")
    p.add_argument("--child", nargs=3, metavar=("VARIANT", "RUN", "CACHE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], Path(args.child[1]), Path(args.child[2]))))
        return
    root = Path(tempfile.mkdtemp(prefix="bench_stream_", dir=args.tmp))
    run_dir = build(root, args.samples, args.seed)
    variants = ["sequential", "sequential_slab", "stream", "stream_in_order", "stream_2_workers"]
    if importlib.util.find_spec("sae_lens") is not None:
        saelens_cache(run_dir, root / "saelens_cache")
        variants.append("saelens")
    results: dict[str, list[dict]] = {v: [] for v in variants}
    script = str(Path(__file__).resolve())
    for _ in range(args.rounds):
        for v in variants:
            results[v].append(
                bc.child_json([script, "--child", v, str(run_dir), str(root / "saelens_cache")])
            )
    rows = []
    for v in variants:
        runs = results[v]
        if any("error" in r for r in runs):
            rows.append((v, None, None, None, next(r["error"] for r in runs if "error" in r)))
            continue
        ratio = statistics.median(
            r["rows_per_s"] / s["rows_per_s"]
            for r, s in zip(runs, results["sequential"], strict=True)
        )
        rows.append((v, f"{statistics.median(r['rows_per_s'] for r in runs):,.0f}", f"{ratio:.2f}",
                     f"{max(r['rss_mb'] for r in runs):.0f}", runs[0]["rows"]))  # fmt: skip
    nbytes = os.path.getsize(run_dir / "probe.h5")
    head = [
        f"# bench_stream ({datetime.date.today()}, {platform.machine()}, {os.cpu_count()} cores)",
        "",
        f"{args.samples} x {POSITIONS} token rows of width {bc.WIDTH} (float32), file "
        f"{nbytes / 2**20:.0f} MB, batch {BATCH}, buffer {BUFFER_BYTES >> 20} MB, "
        f"{args.rounds} rounds, medians.",
    ]
    notes = ["ratio: rows/s over the sequential read's in the same round (median of rounds)",
             "RSS: peak above the process after its imports, the largest of the rounds"]  # fmt: skip
    text = bc.markdown(head, ["variant", "rows/s", "ratio", "RSS MB", "rows"], rows, notes)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
