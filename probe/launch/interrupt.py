"""Graceful stop on SIGINT/SIGTERM: finish the current batch, then close the file as partial.

The handlers are installed only while a run loops and the previous ones are restored after, so a
library caller's own handlers are untouched. A second signal while stopping raises
KeyboardInterrupt at once (the writer is still drained and closed by the run's `finally`).
"""

from __future__ import annotations

import contextlib
import signal
import threading

from probe.errors import ProbeError

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(ProbeError):
    """The run was stopped by a signal after `num_samples` samples were written."""

    def __init__(self, signum: int, num_samples: int, path):
        self.signum, self.num_samples, self.path = signum, num_samples, path
        super().__init__(
            f"stopped by {signal.Signals(signum).name} after {num_samples} samples; {str(path)!r} "
            "is closed with complete=false and holds them all. Run again with resume=true and the "
            "same hydra.run.dir to continue"
        )

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopFlag:
    """Context manager: `requested` becomes the signal number once SIGINT or SIGTERM arrives."""

    def __init__(self):
        self.requested: int | None = None
        self._previous: dict[int, object] = {}

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
