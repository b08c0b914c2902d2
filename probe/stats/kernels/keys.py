"""Order keys: integers that sort as the floats whose bit patterns they are, so a pass keeps its
extremes with integer min/max, which run in SIMD lanes where float min/max (NaN rules) do not;
and `same_width`, which keeps that integer work at the keys' own width. Shared by both passes
(`segments`, `columns`) and by `packing.combine`, which turns the keys back into values.
"""

from __future__ import annotations

import numba
from numba.extending import overload
from numba.np.numpy_support import as_dtype


@numba.njit(nogil=True, cache=True)
def order_key(x, low_bits):
    """An integer that sorts as the float whose bit pattern is x (`low_bits` = all bits but the
    sign): negative floats have their magnitude bits flipped. It is its own inverse. Integer
    min/max run in SIMD lanes where float min/max (NaN rules) do not."""
    return x ^ low_bits if x < 0 else x


def same_width(x, like):
    """x as an integer of like's type (numba promotes int32 arithmetic to int64)."""
    return type(like)(x)


# numba's stub leaves jit's `cache` option out of jit_options
@overload(same_width, jit_options={"cache": True})  # type: ignore[typeddict-unknown-key]
def _same_width(x, like):
    kind = as_dtype(like).type
    return lambda x, like: kind(x)
