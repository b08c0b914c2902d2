"""What the benchmark scripts share: the repository root on sys.path, timing of interleaved rounds,
medians and per-round ratios, peak RSS, a child process's JSON answer, markdown tables and the
small GPT-2 of the token benchmarks.

A script imports it as `import bench_common` (a script's own folder is sys.path[0], from whatever
directory it is started); importing it puts the repository root on sys.path, so that `probe` and
the oracles the tests use too (`from probe.testing import oracles`: a setup of model and batches,
the pipeline over it, the reference values and hand-written captures) import from a checkout. Only the standard
library is imported here: torch and the rest load where a function needs them.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


# -- timing ------------------------------------------------------------------------------------
def sync_device() -> None:
    """Wait for queued GPU work, so a timing covers it (where torch is loaded and has a GPU)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.synchronize()


def fsync_tree(out: Path) -> int:
    """fsync every file under `out` (a buffered write leaves its bytes in the page cache, and
    their writeback must not land in the next case's timing); the bytes they hold."""
    files = [f for f in out.rglob("*") if f.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return sum(f.stat().st_size for f in files)


def timed(fn: Callable, out: Path) -> dict:
    """One run of `fn(out)` into a fresh `out`: wall and process CPU seconds (queued GPU work
    included), kernel CPU seconds and minor page faults, the seconds until what it wrote is on
    disk (every file fsync'ed) and the bytes it wrote."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    gc.collect()
    sync_device()
    u0 = resource.getrusage(resource.RUSAGE_SELF)
    c0, t0 = time.process_time(), time.perf_counter()
    fn(out)
    sync_device()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    u1 = resource.getrusage(resource.RUSAGE_SELF)
    size = fsync_tree(out)
    return {
        "wall": wall,
        "cpu": cpu,
        "sys": u1.ru_stime - u0.ru_stime,  # kernel time: page faults, copies into the page cache
        "faults": u1.ru_minflt - u0.ru_minflt,
        "durable": time.perf_counter() - t0,
        "bytes": size,
    }


def warm_up(
    variants: dict[str, Callable],
    tmp: Path,
    keep: Iterable[str] = (),
    after: Callable[[str], None] | None = None,
) -> dict:
    """One untimed run of each variant in turn, into tmp/warm-NAME (`after(name)` follows each);
    {name: what it returned}. The directories of variants in `keep` stay (fsync'ed, so their
    writeback is not in a later timing); the others are deleted."""
    keep, results = set(keep), {}
    for name, fn in variants.items():
        out = tmp / f"warm-{name}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        results[name] = fn(out)
        if name in keep:
            fsync_tree(out)
        else:
            shutil.rmtree(out, ignore_errors=True)
        if after is not None:
            after(name)
    return results


def rounds(variants: dict[str, Callable], n: int, tmp: Path, threads: int | None = None) -> dict:
    """`n` rounds of every variant in turn (A B C ... A B C ...), each into tmp/NAME, deleted
    after it; {name: [timed(), ...]}. With `threads`, prints each run's seconds and its
    CPU time / (threads x wall)."""
    got = {name: [] for name in variants}
    for r in range(n):
        for name, fn in variants.items():
            t = timed(fn, tmp / name)
            shutil.rmtree(tmp / name, ignore_errors=True)
            got[name].append(t)
            if threads:
                print(
                    f"  round {r + 1}/{n} {name:<20} {t['wall']:7.2f} s  cpu/(threads x wall) "
                    f"{t['cpu'] / (threads * t['wall']):.2f}",
                    flush=True,
                )
    return got


def median(runs: list[dict], key: str = "wall") -> float:
    return statistics.median(r[key] for r in runs)


def ratios(runs: list[dict], floor: list[dict], key: str = "wall") -> list[float]:
    """Per round, a variant's `key` over the floor's in the same round."""
    return [r[key] / f[key] for r, f in zip(runs, floor, strict=True)]


# -- peak RSS and child processes --------------------------------------------------------------
def status_mb(field: str) -> float | None:
    """A field of /proc/self/status (VmRSS, VmHWM) in MB; None where there is none."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def peak_rss_mb() -> float:
    """This process's own peak RSS. VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the
    parent at fork, so a child of a big parent would report the parent's peak."""
    peak = status_mb("VmHWM")
    if peak is None:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return peak


def reset_peak() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux >= 4.0), so a peak taken later is the
    peak of what ran in between."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def child_json(argv: list[str]) -> dict:
    """Run this interpreter on `argv` from the repository root; the last JSON line it printed,
    or {"error": its last line of stderr}."""
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=ROOT)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode or not lines:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(lines[-1])


# -- tables ------------------------------------------------------------------------------------
def table_lines(cols: list[str], rows: Iterable[Iterable]) -> list[str]:
    """A markdown table, each column padded to its widest cell; None is an empty cell."""
    cells = [[str(c) for c in cols]]
    cells += [["" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    return [
        "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
        for row in cells[:1] + [["-" * w for w in widths]] + cells[1:]
    ]


def markdown(head: list[str], cols: list[str], rows: Iterable[Iterable], notes: list[str]) -> str:
    """`head`'s lines, the table and the notes as a list."""
    lines = [*head, "", *table_lines(cols, rows), ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


# -- the token benchmarks: their options and their model ---------------------------------------
def token_parser(doc: str, rounds: int) -> argparse.ArgumentParser:
    """The options bench_tokens.py and bench_patching.py share; each adds its own."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--rounds", type=int, default=rounds, help=f"interleaved rounds (default {rounds})"
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tmp", default=None, help="where the variants write (default: the system's)")
    p.add_argument("--out", default=None, help="also write the results as markdown to OUT")
    return p


LAYERS, WIDTH, HEADS, VOCAB = 6, 256, 4, 5000  # the FIELD-NOTES' token figures were measured on it


def save_gpt2(model_dir: Path, positions: int, seed: int) -> None:
    """A GPT-2-shaped causal LM of that shape, seeded random init, written with save_pretrained
    (the global torch RNG is left as it was)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=LAYERS,
        n_embd=WIDTH,
        n_head=HEADS,
        vocab_size=VOCAB,
        n_positions=positions,
        bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        GPT2LMHeadModel(config).save_pretrained(model_dir)
