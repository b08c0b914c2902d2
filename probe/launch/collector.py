"""Python's garbage collector in a `python -m probe` process: none while it starts, none over its
start-up's objects once the loop runs, none as it exits.

Importing torch, torchvision and the rest makes about a million objects that live as long as the
process, and creates almost no garbage; yet Python's collector traverses all of them again and
again as they appear (about a fifth of the imports' time), in every full collection of the run,
and several times more as the interpreter exits (seconds of a short run). So the command line
(`probe.__main__.cli`, one run per process) holds collections from its start (`hold`), and the run
releases them as its loop starts (`release`): one full collection then (whatever the start-up
left in reference cycles, a loaded checkpoint's temporaries say, is freed before the loop), the
objects still alive frozen (`gc.freeze`, the permanent generation: never traversed again, never
collected), and collection resumes for what the loop makes. At exit what is alive is frozen
again: the operating system takes the memory back.

`probe.run` and the other entry points (a caller's process) never hold: `release` does nothing
there. Neither does a sweep (`-m`): its jobs run one after another in the process, and an earlier
job's objects must be collectable.
"""

from __future__ import annotations

import atexit
import gc

_held = False


def hold() -> None:
    """No collections until `release` (the loop's start), and none as the process exits."""
    global _held
    if not _held and gc.isenabled():
        gc.disable()
        _held = True
        atexit.register(gc.freeze)


def release() -> None:
    """Collections again, over what is made from now on, where `hold` held them: the start-up's
    garbage collected once, what is alive frozen."""
    global _held
    if _held:
        _held = False
        gc.collect()
        gc.freeze()
        gc.enable()
