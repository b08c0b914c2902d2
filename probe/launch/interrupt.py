"""Graceful stop on SIGINT/SIGTERM: finish the unit in flight (a batch of the loop, a batch or
a prompt of a pass after it), then close the file as partial.

One flag (`StopFlag`) for the whole run, its loop and its passes, and one exception
(`Interrupted`) saying what was done. The handlers are installed only while a run works and the
previous ones are restored after, so a library caller's own handlers are untouched. A second
signal while stopping raises KeyboardInterrupt at once (the sink is still drained and closed by
the run's `finally`).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from probe.errors import ProbeError

SIGNALS = (signal.SIGINT, signal.SIGTERM)
# what signal.signal takes and gives back: a function, SIG_DFL or SIG_IGN, or None (a handler
# not installed from Python)
Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class Interrupted(ProbeError):
    """The run was stopped by a signal; `done` says how far it got ("after 8 samples", "while
    scoring edges after 1 of 3 batches"), all of it in its file, `num_samples` the loop's rows."""

    def __init__(self, signum: int, path, done: str, num_samples: int = 0):
        self.signum, self.num_samples, self.path, self.done = signum, num_samples, path, done
        super().__init__(
            f"stopped by {signal.Signals(signum).name} {done}; {str(path)!r} is closed with "
            "complete=false and holds them all. Run again with resume=true and the same "
            "hydra.run.dir to continue"
        )

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopFlag:
    """Context manager: `requested` becomes the signal number once SIGINT or SIGTERM arrives."""

    def __init__(self):
        self.requested: int | None = None
        self._previous: dict[int, Handler] = {}

    def __enter__(self) -> StopFlag:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        while self._previous:
            sig, handler = self._previous.popitem()
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)

    def _handle(self, signum, frame) -> None:
        if self.requested is not None:
            raise KeyboardInterrupt
        self.requested = signum


@contextlib.contextmanager
def file_size_errors():
    """Writes past the file size limit (RLIMIT_FSIZE) fail with an error the writer reports,
    instead of SIGXFSZ ending the process with no message (main thread, where it exists)."""
    sig = getattr(signal, "SIGXFSZ", None)
    if sig is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(sig, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(sig, signal.SIG_DFL if previous is None else previous)
