"""The fixed sets of values some config keys take, as enums the schema (probe.config) types
them with, so Hydra refuses any other value as it composes. Kept free of Hydra and torch: the
statistics backend reads its names here in processes that never compose a config (summarize)."""

from __future__ import annotations

from enum import Enum


class Choice(str, Enum):
    """A config value from a fixed set: Hydra rejects any other at compose time, naming the key
    and the choices. It is its string everywhere else (compared, formatted, hashed, dumped)."""

    __str__ = str.__str__
    __format__ = str.__format__

    def __hash__(self) -> int:
        return str.__hash__(self)


Precision = Choice("Precision", [(n, n) for n in ("fp32", "bf16", "fp16")])
ModelOutput = Choice("ModelOutput", [(n, n) for n in ("auto", "full", "last", "none")])
StatsBackend = Choice("StatsBackend", [(n, n) for n in ("auto", "torch", "numba")])
StatsDuring = Choice("StatsDuring", [(n, n) for n in ("run", "close", "none")])
StoreMode = Choice("StoreMode", [(n, n) for n in ("full", "stats")])
Compression = Choice("Compression", [(n, n) for n in ("none", "lzf", "gzip")])
PRECISIONS = tuple(m.value for m in Precision)  # probe.hooks.device maps them to torch dtypes
STATS_BACKENDS = tuple(m.value for m in StatsBackend)
# said where numba is asked for and not installed (probe.checks for the config's stats.backend,
# probe.stats.backend for PROBE_STATS_BACKEND)
NUMBA_MISSING = (
    "stats.backend=numba needs numba, which is not installed: pip install -e '.[fast]', or use "
    "stats.backend=torch"
)
