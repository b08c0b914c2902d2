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


class Ready:
    """The CUDA events recorded after a batch's copies, one per GPU that held some (a model
    split over GPUs copies from each on that GPU's stream): `synchronize` waits for them all."""

    def __init__(self, devices):
        self.events = []
        for device in devices:
            with torch.cuda.device(device):
                event = torch.cuda.Event()
                event.record()  # on the device's current stream, where its copies were queued
                self.events.append(event)

    def synchronize(self) -> None:
        for event in self.events:
            event.synchronize()


def to_host(*groups: dict) -> tuple[list[dict], Ready | None]:
    """Each dict of tensors with its GPU tensors replaced by pinned host copies issued without
    waiting, and the events recorded after the last copies (None when nothing was on a GPU: then
    the dicts come back as they are). The host tensors may only be read after
    `ready.synchronize()`. Each tensor is copied from its own device, wherever a map put it."""
    gpus = {t.device for g in groups for t in g.values() if t.is_cuda}
    if not gpus:
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
    return out, Ready(sorted(gpus, key=str))


class HostCopy:
    """One tensor on its way to the host: a pinned buffer filled by a non-blocking copy and the
    event recorded after it (a CPU tensor is its own copy, ready at once). `ready()` asks without
    waiting; `array()` waits for the copy, then gives it as a numpy array."""

    def __init__(self, t: torch.Tensor):
        self.event: torch.cuda.Event | None = None
        if not t.is_cuda:
            self.host = t
            return
        self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        with torch.cuda.device(t.device):
            self.host.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def array(self):
        if self.event is not None:
            self.event.synchronize()
        return self.host.numpy()


def copy_to_host(t: torch.Tensor) -> HostCopy:
    """The one way a watched step's statistics leave their device (probe.train.step_stats): a
    pinned, non-blocking copy behind an event; nothing waits until `HostCopy.array`."""
    return HostCopy(t)
