"""The fixed sets of values some config keys take, as enums the schema (probe.config) types
them with, so Hydra refuses any other value as it composes. Kept free of Hydra and torch: the
statistics backend reads its names here in processes that never compose a config (summarize)."""

from __future__ import annotations

from enum import Enum


class Choice(str, Enum):
    """A config value from a fixed set: Hydra rejects any other at compose time, naming the key
    and the choices. It is its string everywhere else (compared, formatted, hashed, dumped)."""

    __str__ = str.__str__

    def __format__(self, format_spec: str) -> str:
        return str.__format__(self, format_spec)

    def __hash__(self) -> int:
        return str.__hash__(self)


class Precision(Choice):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class ModelOutput(Choice):
    auto = "auto"
    full = "full"
    last = "last"
    none = "none"


class StatsBackend(Choice):
    auto = "auto"
    torch = "torch"
    numba = "numba"


class StatsDuring(Choice):
    run = "run"
    close = "close"
    none = "none"


class StoreMode(Choice):
    full = "full"
    stats = "stats"


class Compression(Choice):
    none = "none"
    lzf = "lzf"
    gzip = "gzip"


PRECISIONS = tuple(m.value for m in Precision)  # probe.hooks.device maps them to torch dtypes
STATS_BACKENDS = tuple(m.value for m in StatsBackend)
# said where numba is asked for and not installed (probe.checks for the config's stats.backend,
# probe.stats.backend for PROBE_STATS_BACKEND)
NUMBA_MISSING = (
    "stats.backend=numba needs numba, which is not installed: pip install -e '.[fast]', or use "
    "stats.backend=torch"
)
