"""How many copies of the prompt one graph's backward passes carry, when `graph.batch_size` is
not given: as many as a share of the free memory of the model's devices holds, at most
MAX_BATCH (an explicit batch size always wins).

Each backward pass computes one target row per copy of the prompt, so the batch trades memory
for fewer passes. What the attribution (probe.graphs.attribution under
probe.graphs.replacement) holds while it runs, at width d, n_pos positions, e bytes an element
of the model's dtype:

- per copy of the prompt, per block on the device: COPY_TENSORS_PER_BLOCK tensors of
  n_pos x d that the frozen forward keeps for the backward or the attribution reads (the
  attention norm's output, which the value projection saves; the values side by side, which
  the frozen pattern multiplies; the attention's output, which the output projection saves;
  the transcoder's input, a feature target's root, and the MLP's replaced output, where they
  are not one of those); and, where the
  model's attention is eager, one block's scores and their softmax at a time,
  EAGER_TEMPS x heads x n_pos^2 (sdpa and the others need no such matrix);
- per copy, outside the blocks: COPY_TENSORS_OUTSIDE tensors of n_pos x d (the embeddings,
  the final norm's output, the seeds' gradients, the gradients in flight, the float32 copy
  and the gathered pieces the rows are read from), on the device of the embeddings;
- once, per block on the device: the queries, keys and values of one copy (QKV_TENSORS
  tensors of at most n_pos x d), from which each backward pass makes the block's frozen pattern
  again (probe.graphs.replacement: no n_pos^2 pattern is held between passes); and on the
  device, one block's pattern while it is made, the eager function's EAGER_TEMPS matrices of
  heads x n_pos^2 float32.

    batch = clamp(floor((FRACTION x free - once) / per_copy), 1, MAX_BATCH)

per device holding blocks (accelerate's execution device where a `device_map` placed the
model), the smallest over the devices. `free` is what the device can still give: on the CPU
the kernel's MemAvailable (/proc/meminfo), on a GPU torch.cuda.mem_get_info's free bytes plus
what torch's caching allocator holds unused. FRACTION leaves room for what the formula does
not count: the dense rows in flight (batch x columns floats, and the floor's temporaries), the
kept entries, the nodes' decoder writes and encoder rows, allocator slack. Where free memory
cannot be read (another device type), FALLBACK_BATCH copies.

A forward carrying forward-mode tangents (`tangents=True`: the QK attribution traced to the
nodes, probe.graphs.qk_sources, one node's write a copy) keeps nothing for a backward: a copy
costs FORWARD_COPY_TENSORS tensors of n_pos x d while one block runs, wherever the blocks are,
and the attention runs on the first copy alone (one block's pattern made at a time: `once`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from probe.models.placement import execution_device

FRACTION = 0.5  # of the free memory the planned batch may use
MAX_BATCH = 64  # copies beyond this save little time: a backward's work grows with its rows
FALLBACK_BATCH = 8  # where a device's free memory cannot be read
# n_pos x d tensors per copy and block (see the module docstring): counted with autograd's
# saved-tensor hooks on SmolLM2-135M's shape (4.25-4.5 a block), 3 by the peak RSS's slope
COPY_TENSORS_PER_BLOCK = 4
COPY_TENSORS_OUTSIDE = 8  # n_pos x d tensors per copy outside the blocks
EAGER_TEMPS = 3  # heads x n_pos^2 matrices eager attention makes at once (scores, softmax, pattern)
PATTERN_BYTES = 4  # the frozen patterns are float32
QKV_TENSORS = 3  # n_pos x d tensors a block keeps to make its pattern again (one copy's q, k, v)
# n_pos x d tensors a copy holds in a forward carrying tangents while a block runs, each a value
# and a tangent: the residual stream, the norm's output, the values, the attention's output,
# the MLP's input and skip path (counted from the replacement's hooks, not measured)
FORWARD_COPY_TENSORS = 12


@dataclass(frozen=True)
class DeviceShare:
    """What one device holds of the model: its blocks, whether the embeddings are there, and
    its free bytes (None: unknown)."""

    device: torch.device
    blocks: int
    embeddings: bool
    free: int | None


@dataclass(frozen=True)
class BatchPlan:
    """The chosen batch and why: `reason` says it in a sentence (the run's log shows it)."""

    batch: int
    reason: str
    per_copy: int = 0  # bytes a copy costs on the tightest device
    once: int = 0  # bytes paid once on that device
    free: int | None = None  # that device's free bytes


def copy_bytes(blocks: int, embeddings: bool, n_pos: int, width: int, heads: int,
               element: int, eager: bool) -> int:  # fmt: skip
    """Bytes one copy of the prompt costs on a device holding `blocks` blocks (and the
    embeddings, if `embeddings`)."""
    tensors = COPY_TENSORS_PER_BLOCK * blocks + (COPY_TENSORS_OUTSIDE if embeddings else 0)
    scores = EAGER_TEMPS * heads * n_pos * n_pos * element if eager and blocks else 0
    return tensors * n_pos * width * element + scores


def once_bytes(blocks: int, n_pos: int, width: int, heads: int, element: int) -> int:
    """Bytes paid once on a device holding `blocks` blocks: each block's queries, keys and
    values of one copy, and one block's pattern while it is made (see the module docstring)."""
    if not blocks:
        return 0
    made = EAGER_TEMPS * heads * n_pos * n_pos * PATTERN_BYTES
    return blocks * QKV_TENSORS * n_pos * width * element + made


def forward_copy_bytes(n_pos: int, width: int, element: int) -> int:
    """Bytes one copy of the prompt costs in a forward carrying tangents (module docstring)."""
    return FORWARD_COPY_TENSORS * n_pos * width * element


def plan_batch(shares: list[DeviceShare], n_pos: int, width: int, heads: int, element: int,
               eager: bool, fraction: float = FRACTION, rows: int | None = None,
               tangents: bool = False) -> BatchPlan:  # fmt: skip
    """The batch the formula of the module docstring gives for a model placed as `shares`, at
    most `rows` (the rows to attribute, where known: more copies would idle); `tangents`: for
    a forward carrying tangents instead of the backward passes."""
    best: BatchPlan | None = None
    per_pass = "forward" if tangents else "backward"
    for share in shares:
        if not share.blocks and not share.embeddings:
            continue
        if tangents:
            per_copy = forward_copy_bytes(n_pos, width, element)
            once = once_bytes(min(share.blocks, 1), n_pos, width, heads, element)
        else:
            per_copy = copy_bytes(share.blocks, share.embeddings, n_pos, width, heads, element,
                                  eager)  # fmt: skip
            once = once_bytes(share.blocks, n_pos, width, heads, element)
        if share.free is None:
            plan = BatchPlan(
                FALLBACK_BATCH,
                f"{FALLBACK_BATCH} prompt copies per {per_pass}: the free memory of "
                f"{share.device} cannot be read (graph.batch_size sets it)",
            )
        else:
            fits = math.floor((fraction * share.free - once) / max(per_copy, 1))
            most = min(MAX_BATCH, rows) if rows is not None else MAX_BATCH
            batch = min(max(fits, 1), most)
            why = (
                f"{batch} prompt copies per {per_pass}: {human(per_copy)} a copy and {human(once)}"
                f" once (queries, keys and values the patterns are made from) against {fraction:.0%} of {human(share.free)} free on "
                f"{share.device}"
            )
            if fits > most:
                why += f" (at most {most}: " + (
                    "the rows to attribute)" if most != MAX_BATCH else "the most it plans)"
                )
            elif fits < 1:
                why += " (less than one copy fits: one, and memory may run out)"
            plan = BatchPlan(batch, why + "; graph.batch_size sets it", per_copy, once, share.free)
        if best is None or plan.batch < best.batch:
            best = plan
    if best is None:  # (a model with no blocks is refused before this)
        return BatchPlan(FALLBACK_BATCH, "no blocks found; graph.batch_size sets it")
    return best


def free_bytes(device: torch.device) -> int | None:
    """Bytes `device` can still give: the CPU's MemAvailable, a GPU's free memory plus what
    torch's caching allocator holds unused; None where it cannot be read."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + cached)
    if device.type == "cpu":
        return _host_available()
    return None


def _host_available() -> int | None:
    """The host's available memory: /proc/meminfo's MemAvailable (Linux), else the free
    pages sysconf reports, else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import os

        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return None


def device_shares(blocks: list[torch.nn.Module], embeddings: torch.nn.Module) -> list[DeviceShare]:
    """Per device: how many of `blocks` run there, whether `embeddings` does, its free bytes."""
    counts: dict[torch.device, int] = {}
    for block in blocks:
        device = execution_device(block)
        counts[device] = counts.get(device, 0) + 1
    embed_device = execution_device(embeddings)
    counts.setdefault(embed_device, 0)
    return [DeviceShare(d, n, d == embed_device, free_bytes(d)) for d, n in counts.items()]


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")
