"""Host buffers that CPU captures are copied into: aligned to ALIGN, so that the writer can hand
whole chunks of them to the disk without a copy (O_DIRECT, probe.store.direct), and pooled, so
that a batch reuses the memory of one already written instead of faulting in fresh pages."""

from __future__ import annotations

import numpy as np
import torch

ALIGN = 4096  # the block size O_DIRECT requires on common file systems (512 would do on some)


def aligned_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor whose memory starts on an ALIGN boundary."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    start = -raw.data_ptr() % ALIGN
    return raw[start : start + nbytes].view(dtype).view(shape)


class AlignedPool:
    """Aligned buffers for captures, reused once their batch is written: fresh memory for every
    batch costs page faults (on a virtual machine, pages obtained from the host) in the forward's
    thread. It holds at most the buffers of the batches in flight, as allocating them would."""

    def __init__(self):
        self.free: dict[tuple, list[torch.Tensor]] = {}

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        stack = self.free.get((tuple(shape), dtype))
        return stack.pop() if stack else aligned_empty(shape, dtype)

    def give(self, buffers: list[torch.Tensor]) -> None:
        """Called by the writer thread once it wrote them (list operations are atomic)."""
        for t in buffers:
            self.free.setdefault((tuple(t.shape), t.dtype), []).append(t)
