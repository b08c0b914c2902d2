"""Threads that share a compiled, GIL-free pass with the calling thread, one per spare core.

Used where torch's own threads cannot take the pass (`probe.stats.team`: not the thread running the
model, or no OpenMP runtime found), such as the summarizer and the writer thread. Torch's workers
keep spinning for a moment after each operation, so beside a running model threads of our own
compete with them: the default takes half the cores this process may use. PROBE_STATS_THREADS sets
the threads, the caller included.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class Threads:
    def __init__(self, total: int):
        self.pool: ThreadPoolExecutor | None = None
        self.resize(total)

    def resize(self, total: int) -> None:
        """Use `total` threads (the caller included) from now on."""
        old = self.pool
        self.total = max(1, total)
        self.pool = ThreadPoolExecutor(self.total - 1, "probe-stats") if self.total > 1 else None
        self.pid = os.getpid()
        if old is not None:
            old.shutdown(wait=True)

    def _helpers(self) -> ThreadPoolExecutor:
        """The pool of helper threads, which a run of more than one call needs."""
        assert self.pool is not None, f"{self.total} thread(s): no helpers for more calls"
        return self.pool

    def run(self, fn, calls: list[tuple]) -> None:
        """fn(*args) for every args of `calls` (at most `total`): the first on this thread; all
        of them in a forked child, where the pool's threads do not exist."""
        if self.pid != os.getpid():
            for args in calls:
                fn(*args)
            return
        futures = [self._helpers().submit(fn, *args) for args in calls[1:]]
        try:
            fn(*calls[0])
        finally:  # the helpers' arrays are the caller's: never return while they are in use
            for f in futures:
                f.result()


def configured() -> int:
    """PROBE_STATS_THREADS, or 0 when it is not set."""
    return int(os.environ.get("PROBE_STATS_THREADS", "0"))


threads = Threads(configured() or usable_cores() // 2)
