"""The passes over the data that every statistic comes from, compiled with numba.

A chain of torch or numpy reductions reads an activation a dozen times and allocates as many
temporaries; these passes read each (row, unit) segment twice while it sits in the L1 cache, and
release the GIL so that threads can share a batch. Their disk cache is checked against every module
here (`locator`, installed below first), since a caller holds the passes it calls compiled in.
"""

from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, cast

from numba import extending

from probe.stats.kernels import locator

locator.install()

_Args = ParamSpec("_Args")


def intrinsic(fn: Callable[Concatenate[Any, _Args], object]) -> Callable[_Args, Any]:
    """numba's `intrinsic` of `fn` (whose first argument is the typing context), typed as
    compiled code calls it: without the typing context, returning a compiled value. numba's own
    types describe a call from Python, which only raises."""
    return cast("Callable[_Args, Any]", extending.intrinsic(fn))
