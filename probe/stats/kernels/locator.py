"""numba's disk cache for this package, checked against all of its modules at once.

numba checks a function's cached machine code against the file the function is defined in only,
but a caller's code has its callees compiled in: with the passes in several modules, a change to
one (say `segments`) would leave the old pass cached inside its callers (`rows.reduce_rows`,
`gomp.team_batch`). The locators here give every function defined in this package one source
stamp, the hash of every module's contents and of the statistics' declaration (`COMPILED_IN`,
whose slot offsets the passes compile in), so a change to any of them recompiles them all. They
are put ahead of numba's own (`install`, run by the package's `__init__` before any module here
compiles) and decline every file outside this package. Where NUMBA_CACHE_LOCATOR_CLASSES names
numba's locators instead, they are not used.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

from numba.core import caching

HERE = Path(__file__).resolve().parent
COMPILED_IN = (HERE.parent / "stat_columns.py",)  # read by the passes outside the package


def modules() -> list[Path]:
    """The package's modules in a fixed order, then COMPILED_IN."""
    return sorted(HERE.glob("*.py")) + list(COMPILED_IN)


def package_stamp() -> str:
    """The hash of every module's name and contents (hashed again only when one's mtime or size
    changes)."""
    return _digest(tuple((str(p), s.st_mtime_ns, s.st_size) for p in modules() for s in [p.stat()]))


@functools.lru_cache(maxsize=8)
def _digest(signature: tuple[tuple[str, int, int], ...]) -> str:
    h = hashlib.sha256()
    for path, _, _ in signature:
        h.update(Path(path).name.encode() + b"\0")
        h.update(hashlib.sha256(Path(path).read_bytes()).digest())
    return h.hexdigest()


if TYPE_CHECKING:  # the mixin goes ahead of one of numba's locators (`locators`)
    _Locator = caching._CacheLocator
else:
    _Locator = object


class _WholePackage(_Locator):
    """A locator for this package's functions only, whose source stamp covers every module."""

    @classmethod
    def from_function(cls, py_func, py_file):
        if Path(os.path.realpath(py_file)).parent != HERE:
            return None
        return super().from_function(py_func, py_file)

    def get_source_stamp(self):
        return package_stamp()


@functools.lru_cache(maxsize=1)
def locators() -> list[type]:
    """Ours, one per numba locator, in numba's own order (under NUMBA_CACHE_DIR when it is set,
    in the package's __pycache__ when it can be written, else numba's user-wide directory); none
    where this numba names its locators otherwise."""
    names = ("UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator")
    found = []
    for name in names:
        base = getattr(caching, name, None) or getattr(caching, "_" + name, None)
        if base is None:
            return []
        found.append(type(f"Package{name}", (_WholePackage, base), {}))
    return found


def install() -> bool:
    """Put the locators ahead of numba's (once). Where this numba keeps its locators elsewhere,
    numba's own stay, checking each module on its own: a change to one module then needs the
    cache cleared (`python -m probe.stats.kernel_cache` compiles afresh after that)."""
    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl", None)
    classes = getattr(impl, "_locator_classes", None)
    ours = locators()
    if not isinstance(classes, list) or not ours:
        return False
    if ours[0] not in classes:
        classes[:0] = ours
    return True
