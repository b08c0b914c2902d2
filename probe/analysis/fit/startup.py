"""A fit command's start-up without Python's cyclic garbage collector.

Importing torch and transformers and building the run's model make about half a million
long-lived objects; while they are made the collector scans them over and over (about a second
of CPU on the bench of docs/bench/transcoders.md), and every collection later in the fit scans
them again. `python -m probe.fit` (and each worker process) turns the collector off while it
starts (`begin`); `end` then freezes what exists (gc.freeze: later collections leave those objects
alone, the pattern Python's gc documentation gives for long-lived start-up state) and turns the
collector back on. Cycles that became garbage during the start-up stay in memory (about 14,000
objects on the bench), which a final gc.collect() would free at about half a second. A caller of
`probe.fit.main()` that leaves the collector on sees no change: `end` acts only where it is off.
"""

from __future__ import annotations

import gc


def begin() -> None:
    """The collector off until `end`."""
    gc.disable()


def end() -> None:
    """The objects made so far frozen out of later collections and the collector back on, where
    `begin` (or the caller) turned it off; nothing otherwise."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()
