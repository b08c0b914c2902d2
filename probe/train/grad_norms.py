"""The two global gradient norms of a watched training's recorded steps, each measured at most
once a step in the common cases.

- `grad_norm`: the 2-norm of every gradient of the model together as the optimizer steps on
  them (after accumulation, DDP's all-reduce, an unscale and any clipping), measured when the
  step's gradients are read (`at_step`).
- `grad_norm_preclip`: the same norm at the end of the step's last backward, before anything
  clipped or changed the gradients (divided by a GradScaler's scale where the loss was scaled).
  It is, in this order of preference:
  1. the total norm a clip returned, where the loop hands it over (`hand_over`: `w.clipped(norm)`
     in a plain loop; the transformers callback hands over what the Trainer's
     `accelerator.clip_grad_norm_` returned, the Trainer's logged grad_norm) - no measurement;
  2. the norm a trainer's hook measured before its clip (`take_preclip`: Lightning's
     `on_before_optimizer_step`);
  3. `grad_norm` itself, where the gradients at the step are still those the last backward left
     (each gradient the same tensor at the same version counter: nothing changed them in place
     or replaced them since) - no second measurement;
  4. the norm measured at the end of the last backward, where the loop changed the gradients
     after it without handing a norm over (a clip by hand, a GradScaler's unscale).

A backward cannot know it is its step's last, and what changes the gradients after it is not
seen before it has acted, so case 4 needs a measurement at the end of every backward of the step
(or of the one a trainer says is the last: `last_backward`). A plain loop's watch learns whether
it needs that (`learns`): it measures at the end of every backward of the first recorded step,
and from then on only while the previous recorded step's gradients changed after their last
backward with no norm handed over. A loop that starts changing them later (a clip switched on
after a warm-up) gets no `grad_norm_preclip` at that one step (NaN, said once in the log), and
the measurement at the end of each backward from its next recorded step.

Version counters do not see an in-place foreach op on a DTensor's shard (what clip_grad_norm_
does under FSDP2), so with DTensor gradients the gradients always count as changed (case 4, or a
second measurement where a trainer's hook measured before).

The norm (`global_norm`): each gradient's 2-norm in the gradients' own dtype (16-bit ones
accumulated in float32), their squares summed in float64, a 0-d float64 tensor on the first
gradient's device (no host transfer: the step's end reads it). On an accelerator the per-tensor
norms are `torch._foreach_norm`'s, by device and dtype. On the CPU torch's float32 norm kernel
accumulates sequentially (pytorch#169237: -3e-4 relative on the gradients of a 135M-parameter
Llama, -1.6e-3 on its 28M-element embedding alone), so there each gradient is reduced in rows
of 1024 values, whose norms are exact to float32 rounding (1e-9 relative on that model), at 1.2x
the time of `_foreach_norm`. The pieces of DTensor gradients are this process's (`to_local()`);
the ranks' squares combine in probe.train.ranks.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

log = logging.getLogger("probe")
ROW = 1024  # values per row of a CPU gradient's norm (see the module's text)
LOW_PRECISION = (torch.float16, torch.bfloat16)
Marks = tuple[tuple[Any, int], ...] | None  # (a weak reference, version counter) per gradient


def global_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of `grads` together: a 0-d float64 tensor on the first one's device."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        if g.is_sparse:  # (a sparse embedding's: its values)
            g = g.coalesce().values()
        groups.setdefault((g.device, g.dtype), []).append(g)
    device = grads[0].device
    total = None
    for (dev, dtype), group in groups.items():
        low = dtype in LOW_PRECISION
        norms = _cpu_norms(group, low) if dev.type == "cpu" else _norms(group, low)
        if not norms:  # (empty shards only)
            continue
        squares = torch.cat([n.reshape(-1) for n in norms]).double().square().sum().to(device)
        total = squares if total is None else total + squares
    if total is None:
        return torch.zeros((), dtype=torch.float64, device=device)
    return total.sqrt()


def _norms(tensors: list[torch.Tensor], low: bool) -> list[torch.Tensor]:
    """Each tensor's 2-norm (`torch._foreach_norm`; 16-bit tensors accumulated in float32)."""
    if not low:
        return list(torch._foreach_norm(tensors))
    try:
        return list(torch._foreach_norm(tensors, 2, dtype=torch.float32))
    except (TypeError, RuntimeError):  # (a torch whose _foreach_norm takes no dtype)
        return [torch.linalg.vector_norm(t, dtype=torch.float32) for t in tensors]


def _cpu_norms(tensors: list[torch.Tensor], low: bool) -> list[torch.Tensor]:
    """The norms of each CPU tensor's rows of ROW values and of its last, shorter row."""
    dtype = torch.float32 if low else None
    norms, tails = [], []
    for t in tensors:
        v = t.reshape(-1)
        rows = v.numel() // ROW
        if rows:
            norms.append(torch.linalg.vector_norm(v[: rows * ROW].view(rows, ROW), dim=1,
                                                  dtype=dtype))  # fmt: skip
        if v.numel() > rows * ROW:
            tails.append(v[rows * ROW :])
    if tails:
        norms.extend(_norms(tails, low))
    return norms


def marks(grads: list[torch.Tensor]) -> Marks:
    """What tells whether `grads` changed later: each one's identity and version counter (None
    for DTensors, whose shards' in-place foreach ops leave the counters as they were)."""
    if any(callable(getattr(g, "to_local", None)) for g in grads):
        return None
    return tuple((weakref.ref(g), g._version) for g in grads)


def unchanged(before: Marks, grads: list[torch.Tensor]) -> bool:
    """Whether `grads` are the tensors `before` marked, unchanged since (False: not known)."""
    if before is None or len(before) != len(grads):
        return False
    return all(
        ref() is g and version == g._version
        for (ref, version), g in zip(before, grads, strict=True)
    )


class GradNorms:
    """The global gradient norms of the current step of a watched `model` (see the module's
    text). `at_backward`: measure at the end of a backward (where `last_backward()`, if given,
    says it is the step's last); `learns`: `at_backward` follows what the last recorded step
    showed (a plain loop's watch); `grad_scale()`: a GradScaler's scale, dividing a norm taken
    at the end of a backward. The step's values (0-d tensors, or a handed-over number) are in
    `values`; `whole` names those that are the training's already (a handed-over norm under
    FSDP), not this process's share."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.at_backward = True
        self.learns = True
        self.last_backward: Callable[[], bool] | None = None
        self.grad_scale: Callable[[], float | torch.Tensor] | None = None
        self.said_gap = self.said_early = False
        self.begin()

    def begin(self) -> None:
        """A step starts: nothing measured or handed over yet."""
        self.values: dict[str, torch.Tensor | float] = {}
        self.whole: set[str] = set()
        self.measured: tuple[Marks, torch.Tensor] | None = None  # the last measurement
        self.backward_marks: Marks = None  # the gradients the last backward left
        self.backward_norm: torch.Tensor | None = None  # their norm (where measured), unscaled
        self.backwards = 0
        self.given: torch.Tensor | float | None = None

    def _grads(self) -> list[torch.Tensor]:
        """The model's gradients now (the parameters' own `.grad` tensors)."""
        return [p.grad for p in self.model.parameters() if p.grad is not None]

    def _norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The norm of `grads` now: the last measurement's where they are unchanged since."""
        if self.measured is not None and unchanged(self.measured[0], grads):
            return self.measured[1]
        norm = global_norm([_local(g) for g in grads])
        self.measured = (marks(grads), norm)
        return norm

    def backward_ended(self) -> None:
        """A backward of a recorded step ended (its gradients accumulated, DDP's all-reduce
        done): mark its gradients, and measure them where the step may need it."""
        grads = self._grads()
        if not grads:
            return
        self.backwards += 1
        self.backward_marks = marks(grads)
        self.backward_norm = None
        if self.at_backward and (self.last_backward is None or self.last_backward()):
            norm = self._norm(grads)
            scale = self.grad_scale() if self.grad_scale is not None else 1.0
            self.backward_norm = norm if isinstance(scale, float) and not scale else norm / scale

    def hand_over(self, norm, step: int) -> None:
        """The total norm a clip of this step's gradients returned (a tensor or a number); one
        that comes before any backward of the step is of no gradient of it: said, not kept."""
        if not self.backwards:
            if not self.said_early:
                self.said_early = True
                log.warning(
                    "step %d: a clip's norm was handed over (w.clipped) before any backward of "
                    "the step; it is not the step's grad_norm_preclip. Hand it over between the "
                    "backward and optimizer.step()",
                    step,
                )
            return
        if isinstance(norm, torch.Tensor):
            norm = norm.detach()
            if callable(getattr(norm, "full_tensor", None)):  # (a DTensor: the training's)
                norm = cast(Any, norm).full_tensor()
        self.given = norm

    def take_preclip(self) -> None:
        """`grad_norm_preclip` measured now (a trainer's hook before its clip)."""
        grads = self._grads()
        if grads:
            self.values["grad_norm_preclip"] = self._norm(grads)

    def take_step(self, step: int) -> None:
        """The optimizer step comes: `grad_norm` now, and `grad_norm_preclip` (see the module's
        text); a plain loop's watch learns whether to measure at the end of each backward."""
        grads = self._grads()
        if grads:
            self.values["grad_norm"] = self._norm(grads)
        if self.given is not None:
            self.values["grad_norm_preclip"] = self.given
            self.whole.add("grad_norm_preclip")
        if "grad_norm_preclip" in self.values or not self.backwards:
            self._learn(changed=False)
            return
        if grads and unchanged(self.backward_marks, grads):
            self.values["grad_norm_preclip"] = self.values["grad_norm"]
            self._learn(changed=False)
            return
        if self.backward_norm is not None:
            self.values["grad_norm_preclip"] = self.backward_norm
        elif self.learns and not self.said_gap:
            self.said_gap = True
            log.warning(
                "step %d: the gradients changed between the step's last backward and the "
                "optimizer step (a clip?), and no norm was handed over, so this step has no "
                "grad_norm_preclip; from the next recorded step the watch measures the norm at "
                "the end of each backward (w.clipped(norm) with clip_grad_norm_'s value spares "
                "that)",
                step,
            )
        self._learn(changed=True)

    def _learn(self, changed: bool) -> None:
        if self.learns and self.backwards:
            self.at_backward = changed


def _local(t: torch.Tensor) -> torch.Tensor:
    """This process's piece of a gradient (a DTensor's local shard), detached."""
    return (cast(Any, t).to_local() if callable(getattr(t, "to_local", None)) else t).detach()
