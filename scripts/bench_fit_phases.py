"""Where `python -m probe.fit`'s CPU goes: the process CPU seconds of each phase of one fit.

    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/bench_fit_phases.py RUN --activation topk \
        --width 256 --k 8 --epochs 4 --batch-size 1024 --workers 1 --out OUT

The arguments are probe.fit's. The fit runs in this process as `python -m probe.fit` runs it
(the garbage collector off while it starts, where the checkout has probe.analysis.fit.startup),
with timers around the fit's functions (time.process_time) and around every collection
(gc.callbacks); the table lists each phase's CPU seconds (nested: Fit.__init__ holds run_model
and left_out_rows, Fit.fit_layer holds train_step, evaluate and the checkpoint saves, Fit.write
holds the loss measures) and the whole process's. docs/bench/transcoders.md has its figures for
the code before and after the fit's fixed cost was cut (run it with PYTHONPATH at each checkout).
"""

from __future__ import annotations

import functools
import gc
import sys
import time

START = time.process_time()
SPENT: dict[str, float] = {}
COLLECTIONS = {"seconds": 0.0, "count": 0, "since": 0.0}


def _collection(phase: str, info: dict) -> None:
    if phase == "start":
        COLLECTIONS["since"] = time.process_time()
    else:
        COLLECTIONS["seconds"] += time.process_time() - COLLECTIONS["since"]
        COLLECTIONS["count"] += 1


def timed(owner, name: str, label: str) -> None:
    """owner.name wrapped: its CPU seconds added to SPENT[label]."""
    f = getattr(owner, name)

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        t = time.process_time()
        try:
            return f(*args, **kwargs)
        finally:
            SPENT[label] = SPENT.get(label, 0.0) + time.process_time() - t

    setattr(owner, name, wrapper)


def main() -> None:
    gc.callbacks.append(_collection)
    try:
        from probe.analysis.fit.startup import begin
    except ImportError:  # (a checkout before the start-up without the collector)
        begin = None
    if begin is not None:
        begin()
    import torch  # noqa: F401

    SPENT["import torch"] = time.process_time() - START
    t = time.process_time()
    import probe.analysis.fit.fitting as fitting
    import probe.fit

    SPENT["import probe.fit and its fit modules"] = time.process_time() - t
    for name in ("run_model", "left_out_rows", "evaluate", "_save_atomic", "train_step",
                 "loss_measures"):  # fmt: skip
        timed(fitting, name, name)
    for name in ("__init__", "fit_layer", "write"):
        timed(fitting.Fit, name, f"Fit.{name}")
    probe.fit.main(sys.argv[1:])
    total = time.process_time() - START
    for label, seconds in sorted(SPENT.items(), key=lambda kv: -kv[1]):
        print(f"{seconds:7.2f}  {label}")
    print(f"{COLLECTIONS['seconds']:7.2f}  garbage collection ({COLLECTIONS['count']} collections, "
          "inside the phases above)")  # fmt: skip
    print(f"{total:7.2f}  the whole process")


if __name__ == "__main__":
    main()
