"""The GPU path, kept small: captures leave the GPU through pinned host buffers filled by
non-blocking copies, and a CUDA event recorded after them is what the writer thread waits on, so
the forward pass never waits for the disk. Optional autocast (`precision=bf16|fp16`).

On the CPU every function here hands its input back unchanged, so the CPU path is the same code.
"""

from __future__ import annotations

import contextlib

import torch

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device, precision: str):
    """`torch.autocast` in the asked dtype (CPU supports bf16 and fp16 too); fp32: no autocast."""
    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def to_host(*groups: dict) -> tuple[list[dict], torch.cuda.Event | None]:
    """Each dict of tensors with its GPU tensors replaced by pinned host copies issued without
    waiting, and the event recorded after the last copy (None when nothing was on a GPU: then the
    dicts come back as they are). The host tensors may only be read after `event.synchronize()`."""
    if not any(t.is_cuda for g in groups for t in g.values()):
        return list(groups), None
    out = []
    for group in groups:
        host = {}
        for key, t in group.items():
            if t.is_cuda and t.numel() == 0:  # a layout (statistics-only run): nothing to copy
                host[key] = torch.empty(t.shape, dtype=t.dtype)
            elif t.is_cuda:
                # torch's caching host allocator reuses pinned blocks once the writer drops them;
                # the GPU tensor stays valid until the copy ran (same stream, caching allocator).
                host[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host[key].copy_(t, non_blocking=True)
            else:
                host[key] = t
        out.append(host)
    event = torch.cuda.Event()
    event.record()
    return out, event
