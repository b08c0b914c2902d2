"""What the global gradient norms of a watched training cost per recorded step, before and after
probe.train.grad_norms: the one norm's time on a model's gradients (the float64 norm the watch
computed before, its float32 norm now, and torch.nn.utils.get_total_norm for reference), timed
side by side in one process (alternating, median of `--repeats`), each value's relative
difference from the float64 norm, and the norms a recorded step measures under gradient
accumulation 2 (counted in a watched loop of 3 steps: without a clip, clipping by hand, clipping
with the norm handed over; before, every backward's and the step's: 3).

    python scripts/bench_norms.py [--model gpt2,llama135m] [--repeats 7] [--threads 1]

The models are scripts/bench_watch.py's (their gradients from one real backward).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import bench_common
from bench_watch import SHAPES, float64_norm, setup


def counts(make, optimizer, batches, loss, probes, clip, hand_over) -> list[int]:
    """The norm calls of each of 3 recorded steps of 2 micro-batches."""
    import torch

    import probe
    from probe.train import grad_norms

    model = make()
    opt = optimizer(model)
    steps: list[int] = []
    real = grad_norms.global_norm
    with tempfile.TemporaryDirectory() as tmp:
        w = probe.watch(model, probes, out=Path(tmp) / "w", optimizer=opt)

        def counted(grads):
            steps.append(w.step_count)
            return real(grads)

        grad_norms.global_norm = counted
        try:
            with w:
                for step in range(3):
                    opt.zero_grad()
                    for batch in batches[2 * step : 2 * step + 2]:
                        (loss(model, batch) / 2).backward()
                    if clip:
                        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                        if hand_over:
                            w.clipped(norm)
                    opt.step()
        finally:
            grad_norms.global_norm = real
    return [steps.count(s) for s in range(3)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2,llama135m")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    import torch

    from probe.train.grad_norms import global_norm

    torch.set_num_threads(args.threads)
    for name in args.model.split(","):
        make, optimizer, batches, loss, probes = setup(name, 6)
        torch.manual_seed(0)
        model = make()
        loss(model, batches[0]).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        values = sum(g.numel() for g in grads)
        ways = {"float64 (before)": float64_norm, "grad_norms.global_norm (after)": global_norm,
                "torch get_total_norm (float32)": torch.nn.utils.get_total_norm}  # fmt: skip
        times: dict[str, list[float]] = {k: [] for k in ways}
        got = {}
        for _ in range(args.repeats):
            for label, f in ways.items():
                t0 = time.perf_counter()
                got[label] = float(f(grads))
                times[label].append(time.perf_counter() - t0)
        exact = got["float64 (before)"]
        rows = [[label, f"{statistics.median(times[label]) * 1000:.1f}",
                 f"{got[label] / exact - 1:+.1e}"] for label in ways]  # fmt: skip
        print(bench_common.markdown(
            [f"### {name}: {SHAPES[name]}", "",
             f"{len(grads)} gradients, {values / 1e6:.1f}M values; one norm, median of "
             f"{args.repeats}, {args.threads} torch thread(s), side by side"],
            ["norm", "ms", "relative to float64"], rows, []), flush=True)  # fmt: skip
        rows = []
        for case, clip, hand in (("no clip", False, False), ("clip_grad_norm_ by hand", True, False),
                                 ("clip, norm handed over (w.clipped)", True, True)):  # fmt: skip
            n = counts(make, optimizer, batches, loss, probes, clip, hand)
            rows.append([case, "3, 3, 3", ", ".join(map(str, n))])
        print(bench_common.markdown(
            ["norms measured per recorded step, steps 0-2, gradient accumulation 2 (plain loop)"],
            ["loop", "before", "after"], rows, []), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
