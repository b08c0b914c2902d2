"""Same outputs before and after a change that promises behaviour unchanged: run a fixed set of
runs with one checkout, again with another, and compare what they wrote.

    python scripts/same_outputs.py run OUT_A [--repo CHECKOUT_A] [--fixtures DIR]
    python scripts/same_outputs.py run OUT_B [--repo CHECKOUT_B] [--fixtures DIR]
    python scripts/same_outputs.py compare OUT_A OUT_B

The runs: the default job (resnet18, every convolution), a token run (a tiny GPT-2's residual
stream, one row per token), the patching grid with attribution patching, the CAM family, the
logit lens, direct logit attribution, a circuit (EAP beside exact), attribution graphs through a
random transcoder set and a watched training
(`python -m probe.train`). Each runs as `python -m ...` in `--repo` (default: this checkout) with
that checkout first on PYTHONPATH; the fixtures (a tiny GPT-2 saved with save_pretrained, a pairs
file) are made once under `--fixtures` and shared by both sides, so the inputs are the same bytes.

`compare` checks every dataset of each run's HDF5 files byte for byte (dtype, shape, bytes) with
its attributes, and every CSV table cell for cell; what differs by nature between two runs (times,
paths, library versions, the config text naming the run directory) is listed in VOLATILE and
left out. Exit status 1 when anything else differs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pandas as pd

HERE = Path(__file__).resolve().parent.parent

# attributes and columns that differ between any two runs of the same code
VOLATILE = {
    "config",
    "created",
    "finished",
    "versions",
    "library_versions",
    "hostname",
    "host",
    "pid",
    "elapsed_s",
    "seconds",
    "started",
    "updated",
    "path",
    "run_dir",
    "resolved_config",
    "provenance",
    "sha256",
}


def cases(fx: Path) -> dict[str, list[str]]:
    """Each run's command: a module and its overrides."""
    gpt2 = f"model.name={fx / 'gpt2'}"
    pairs = ["model=hf", gpt2, "model.task=causal_lm", "dataset=pairs",
             f"dataset.path={fx / 'pairs.pt'}", "dataset.batch_size=2", "probes=none"]  # fmt: skip
    return {
        "default": ["probe", "dataset.num_samples=8", "dataset.batch_size=4"],
        "stats": [
            "probe",
            "dataset.num_samples=8",
            "dataset.batch_size=4",
            "store=stats",
            "store.flush_seconds=600",  # (one flush: the slot it fills does not depend on time)
            "stats.topk=3",
        ],  # fmt: skip
        "tokens": [
            "probe",
            "model=hf",
            gpt2,
            "model.task=causal_lm",
            "dataset=random_tokens",
            "dataset.num_samples=6",
            "dataset.seq_len=8",
            "dataset.batch_size=3",
            "probes=residual",
        ],  # fmt: skip
        "grid": [
            "probe",
            *pairs,
            "intervene=patch_grid",
            "intervene.grid.method=[exact,atp]",
            "intervene.metrics=[logit_diff,kl]",
        ],  # fmt: skip
        "cams": [
            "probe",
            "probes=cams",
            "objective=logit",
            "objective.index=predicted",
            "dataset.num_samples=4",
            "dataset.batch_size=2",
        ],  # fmt: skip
        "lens": ["probe", *pairs, "lens=logit"],
        "dla": ["probe", *pairs, "lens=dla"],
        "circuit": ["probe", *pairs, "circuit.method=[eap,exact]", "circuit.sizes=[10,50]"],
        "graph": [
            "probe",
            "model=hf",
            gpt2,
            "model.task=causal_lm",
            "dataset=tokens",
            f"dataset.path={fx / 'prompts.pt'}",
            "dataset.batch_size=2",
            "probes=none",
            f"graph.transcoders={fx / 'transcoders'}",
        ],  # fmt: skip
        "watch": [
            "probe.train",
            "train.steps=4",
            "watch.every=1",
            "dataset.num_samples=16",
            "dataset.batch_size=4",
        ],  # fmt: skip
    }


def make_fixtures(fx: Path) -> None:
    """A tiny GPT-2 (vocabulary 50), 5 pairs of 6 tokens, as the tests' `lm` fixture, 3 prompts
    of 5 tokens and a random transcoder set of its two MLPs."""
    if (fx / "prompts.pt").is_file():
        return
    import torch

    sys.path.insert(0, str(HERE))
    from probe.models.transcoder_files import save_transcoders
    from probe.testing.random_transcoders import random_transcoders
    from probe.testing.tiny_lms import make_tiny

    fx.mkdir(parents=True, exist_ok=True)
    make_tiny("gpt2", fx / "gpt2", vocab_size=50)
    g = torch.Generator().manual_seed(3)
    clean = torch.randint(3, 50, (5, 6), generator=g)
    corrupt = clean.clone()
    corrupt[:, 2] = torch.randint(3, 50, (5,), generator=g)
    pairs = {"clean_ids": clean, "corrupt_ids": corrupt,
             "answer": torch.randint(3, 50, (5,), generator=g),
             "wrong": torch.randint(3, 50, (5,), generator=g)}  # fmt: skip
    torch.save(pairs, fx / "pairs.pt")
    torch.save(torch.randint(3, 50, (3, 5), generator=g), fx / "prompts.pt")
    save_transcoders(random_transcoders(width=32, layers=2, seed=1), fx / "transcoders")


def run_all(out: Path, repo: Path, fx: Path, only: list[str] | None, backend: str) -> int:
    make_fixtures(fx)
    env = {**os.environ, "PYTHONPATH": str(repo), "HYDRA_FULL_ERROR": "1",
           "PROBE_STATS_BACKEND": backend}  # fmt: skip
    failed = 0
    for name, (module, *overrides) in cases(fx).items():
        if only and name not in only:
            continue
        start = time.perf_counter()
        if module == "probe":  # (the watch reads PROBE_STATS_BACKEND)
            overrides = [*overrides, f"stats.backend={backend}"]
        cmd = [sys.executable, "-m", module, *overrides, f"hydra.run.dir={out / name}"]
        done = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
        took = time.perf_counter() - start
        print(f"{name:10s} rc={done.returncode} {took:6.1f} s")
        if done.returncode != 0:
            failed += 1
            print(done.stderr[-3000:])
    return failed


def _plain(value, f: h5py.File):
    """An attribute's or an object dataset's value with HDF5 references as the names they point
    to and strings decoded, so that two files compare by meaning, not by addresses."""
    if isinstance(value, h5py.Reference):
        return f[value].name if value else None
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, np.ndarray) and (value.dtype == object or value.dtype.names):
        return [_plain(v, f) for v in value.tolist()]
    if isinstance(value, (list, tuple)):
        return [_plain(v, f) for v in value]
    if isinstance(value, np.ndarray):
        return value.tobytes() + str(value.dtype).encode() + str(value.shape).encode()
    return value


def _attrs(obj, f: h5py.File) -> dict:
    return {k: _plain(v, f) for k, v in obj.attrs.items() if k not in VOLATILE}


def compare_h5(a: Path, b: Path) -> list[str]:
    """Every dataset and group of two HDF5 files: names, dtypes, shapes, bytes, attributes."""
    diffs: list[str] = []
    with h5py.File(a, "r") as fa, h5py.File(b, "r") as fb:
        names_a, names_b = [], []
        fa.visit(names_a.append)
        fb.visit(names_b.append)
        if sorted(names_a) != sorted(names_b):
            only_a = sorted(set(names_a) - set(names_b))[:5]
            only_b = sorted(set(names_b) - set(names_a))[:5]
            diffs.append(f"{a.name}: names differ (only before: {only_a}, only after: {only_b})")
        for name in [""] + sorted(set(names_a) & set(names_b)):
            oa, ob = (fa[name], fb[name]) if name else (fa, fb)
            at_a, at_b = _attrs(oa, fa), _attrs(ob, fb)
            if at_a.keys() != at_b.keys():
                diffs.append(f"{a.name}:/{name} attribute names {sorted(at_a)} != {sorted(at_b)}")
            for k in at_a.keys() & at_b.keys():
                if at_a[k] != at_b[k]:
                    diffs.append(f"{a.name}:/{name} attribute {k}: {at_a[k]!r} != {at_b[k]!r}")
            if isinstance(oa, h5py.Dataset):
                if oa.dtype != ob.dtype or oa.shape != ob.shape:
                    diffs.append(f"{a.name}:/{name} {oa.dtype}{oa.shape} != {ob.dtype}{ob.shape}")
                elif oa.dtype == object or oa.dtype.names or h5py.check_string_dtype(oa.dtype):
                    if _plain(oa[()], fa) != _plain(ob[()], fb):
                        diffs.append(f"{a.name}:/{name} values differ")
                elif oa[()].tobytes() != ob[()].tobytes():
                    diffs.append(f"{a.name}:/{name} bytes differ")
    return diffs


def compare_csv(a: Path, b: Path) -> list[str]:
    ta, tb = pd.read_csv(a), pd.read_csv(b)
    keep = [c for c in ta.columns if c not in VOLATILE]
    if list(ta.columns) != list(tb.columns):
        return [f"{a.name}: columns {list(ta.columns)} != {list(tb.columns)}"]
    try:
        pd.testing.assert_frame_equal(ta[keep], tb[keep], check_exact=True)
    except AssertionError as e:
        return [f"{a.name}: {str(e).splitlines()[0]} ({str(e).splitlines()[-1][:200]})"]
    return []


def compare(a: Path, b: Path) -> int:
    rows, bad = [], 0
    for run_a in sorted(p for p in a.iterdir() if p.is_dir()):
        run_b = b / run_a.name
        files = sorted(
            p.relative_to(run_a)
            for p in run_a.rglob("*")
            if p.suffix in (".h5", ".csv") and ".hydra" not in p.parts
        )
        diffs: list[str] = []
        for rel in files:
            if not (run_b / rel).is_file():
                diffs.append(f"{rel}: missing after")
            elif rel.suffix == ".h5":
                diffs += compare_h5(run_a / rel, run_b / rel)
            else:
                diffs += compare_csv(run_a / rel, run_b / rel)
        extra = sorted(
            p.relative_to(run_b)
            for p in run_b.rglob("*")
            if p.suffix in (".h5", ".csv") and ".hydra" not in p.parts
        )
        diffs += [f"{rel}: new after" for rel in extra if rel not in files]
        bad += bool(diffs)
        rows.append((run_a.name, len(files), "same" if not diffs else f"{len(diffs)} differ"))
        for d in diffs[:20]:
            print(f"  {run_a.name}: {d}")
    print(f"{'run':10s} {'files':>5s}  result")
    for name, n, result in rows:
        print(f"{name:10s} {n:5d}  {result}")
    return 1 if bad else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("out", type=Path)
    r.add_argument("--repo", type=Path, default=HERE)
    r.add_argument("--fixtures", type=Path, default=Path("outputs/same_outputs_fixtures"))
    r.add_argument("--only", nargs="*", default=None)
    r.add_argument("--backend", default="numba", help="stats.backend of every run (torch|numba)")
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    args = p.parse_args(argv)
    if args.command == "run":
        return 1 if run_all(args.out.resolve(), args.repo.resolve(), args.fixtures.resolve(),
                            args.only, args.backend) else 0  # fmt: skip
    return compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
