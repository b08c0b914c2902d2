"""`probe.capture(model, probes)`: the captures of a few forwards, held in memory.

The small-data path: for a notebook or a test, where a run directory and an HDF5 file are more
than the question needs. Everything captured stays in memory, so keep it to a few batches;
`probe.launch.run` and `python -m probe` stream to HDF5 with bounded memory instead. The hooks are
probe.hooks.capture.Capture's, with the selection of probe.hooks.module_select, so names, copies, reductions and dtypes
are those of a run.
"""

from __future__ import annotations

from contextlib import ExitStack

import torch
from torch import nn

from probe.errors import ConfigError, ModelError, ProbeError
from probe.hooks.backward import resolve_grads
from probe.hooks.capture import BatchCapture, Capture
from probe.hooks.hookset import HookSet
from probe.hooks.module_select import select_modules
from probe.hooks.names import flatten
from probe.layout import TokenBatch
from probe.plan import probe_specs
from probe.site_keys import VALUE_AND_PARAM_GRAD_SITES, family_of

NOT_RESOLVED = (
    "gradient sites ({sites}) were recorded in a forward but never resolved; call "
    "cap.backward(loss) inside the with-block (loss.backward() does not fill them: the gradients "
    "are taken with torch.autograd.grad on the edges the hooks recorded)"
)


class MemoryCapture:
    """Context manager: `with probe.capture(model, probes) as cap: model(x)`, then
    `cap[(layer, site)]`, `cap.get(layer, site="output")`, `cap.keys()`.

    Every forward of `model` inside the block is one batch of a run: sites are named as a run names
    them, and forwards are concatenated along axis 0 per key (`cap.parts(key)` keeps them apart).
    Gradient sites need `cap.backward(loss)` after each forward. Every hook is removed on exit.
    """

    def __init__(self, model: nn.Module, probes, *, to=None, batch_size: int | None = None):
        self.model, self.to, self.batch_size = model, to, batch_size
        self.selections = select_modules(model, probe_specs(probes))
        self.grad_sites = sorted(
            {s for sel in self.selections for s in sel.sites} & {*VALUE_AND_PARAM_GRAD_SITES}
        )
        self.param_grads = any("param_grad" in sel.sites for sel in self.selections)
        self.capture = Capture(self.selections)  # no listeners, keep_values=True: plain copies
        self.forwards = 0
        self._parts: dict[tuple[str, str], list[torch.Tensor]] = {}
        self._joined: dict[tuple[str, str], torch.Tensor] = {}
        self._unresolved: list[BatchCapture] = []
        self.hooks = HookSet("probe.capture")  # the model's own: where a forward starts and ends
        self._entered: ExitStack | None = None
        self._rows = 0
        self._grad = False

    def __enter__(self) -> MemoryCapture:
        with ExitStack() as entering:  # the capture's hooks, then the model's, or neither
            entering.enter_context(self.capture)
            entering.enter_context(self.hooks)
            self.hooks.forward_pre(self.model, self._begin, name="<model>", with_kwargs=True)
            self.hooks.forward(self.model, self._end, name="<model>")
            self._entered = entering.pop_all()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        entered, self._entered = self._entered, None
        if entered is not None:  # the model's hooks, then the capture's
            entered.__exit__(exc_type, exc, tb)
        if exc_type is None and self._unresolved:
            raise ProbeError(NOT_RESOLVED.format(sites=", ".join(self.grad_sites)))

    def _begin(self, module, args, kwargs) -> None:
        """A forward of the model starts: one batch, sized by its first input tensor."""
        tensors = [t for _, t in flatten((args, kwargs)) if t.ndim > 0]
        if self.batch_size is None and not tensors:
            raise ModelError(
                "probe.capture cannot tell the batch size: the model was called with no tensor "
                "that has a batch axis; pass batch_size= to probe.capture"
            )
        size = self.batch_size or tensors[0].shape[0]
        self.capture.begin(size, self._rows, _tokens(args, kwargs))
        self._grad = torch.is_grad_enabled() and not torch.is_inference_mode_enabled()

    def _end(self, module, args, output) -> None:
        batch = self.capture.batch
        if batch is None:
            return
        self.capture.end()
        self._rows += batch.size
        self.forwards += 1
        self._keep(batch.values)
        batch.values.clear()  # the gradients resolved later land here (see backward)
        if batch.pending or (self.param_grads and self._grad):
            self._unresolved.append(batch)

    def backward(self, loss: torch.Tensor) -> None:
        """Resolve the gradient sites of the last forward against the scalar `loss` (summed over
        samples, per-sample gradients do not depend on the batch). Uses torch.autograd.grad, so
        parameters' `.grad` are left as they are; call `loss.backward(retain_graph=True)` first
        when those are wanted too."""
        if not self.grad_sites:
            raise ConfigError("cap.backward: no probe captures a gradient site (grad_output, ...)")
        if not self._unresolved:
            raise ProbeError(
                "cap.backward: no forward awaits its gradients; run the model inside the "
                "with-block with gradients enabled (not under torch.no_grad or inference_mode)"
            )
        if len(self._unresolved) > 1:
            raise ProbeError(
                f"cap.backward: {len(self._unresolved)} forwards await their gradients and one "
                "loss resolves one forward's; call cap.backward(loss) after each forward"
            )
        if loss.numel() != 1:
            raise ConfigError(
                f"cap.backward takes a scalar loss, not one of shape {tuple(loss.shape)}; sum "
                "the per-sample losses"
            )
        batch = self._unresolved[0]
        per_batch = resolve_grads(batch, loss.reshape(()), self.selections)
        self._unresolved.clear()
        self._keep(batch.values)
        self._keep(per_batch)
        batch.values.clear()

    def _keep(self, values: dict) -> None:
        for key, value in values.items():
            value = value if self.to is None else value.to(self.to)
            self._parts.setdefault(key, []).append(value)
            self._joined.pop(key, None)

    def parts(self, layer: str, site: str = "output") -> list[torch.Tensor]:
        """The values of (layer, site), one per forward that produced it."""
        return list(self._parts[self._known((layer, site))])

    def __getitem__(self, key) -> torch.Tensor:
        """cap[(layer, site)] (cap[layer] for its output): every forward's rows, concatenated."""
        key = self._known((key, "output") if isinstance(key, str) else tuple(key))
        if key not in self._joined:
            parts = self._parts[key]
            try:
                self._joined[key] = parts[0] if len(parts) == 1 else torch.cat(parts)
            except RuntimeError:
                shapes = [tuple(p.shape) for p in parts]
                raise ProbeError(
                    f"{key} has shapes {shapes} in the forwards, which do not stack into rows; "
                    f"read cap.parts{key} for each forward's"
                ) from None
        return self._joined[key]

    def get(self, layer: str, site: str = "output") -> torch.Tensor:
        """cap[(layer, site)]."""
        return self[(layer, site)]

    def _known(self, key: tuple[str, str]) -> tuple[str, str]:
        if key in self._parts:
            return key
        if self._unresolved and family_of(key[1]) in VALUE_AND_PARAM_GRAD_SITES:
            raise ProbeError(NOT_RESOLVED.format(sites=", ".join(self.grad_sites)))
        keys = ", ".join(map(str, list(self._parts)[:12])) or "nothing yet"
        raise KeyError(
            f"no capture {key}; captured: {keys}. Gradient sites need a forward with gradients "
            "enabled and cap.backward(loss)"
        )

    def keys(self) -> list[tuple[str, str]]:
        return list(self._parts)

    def items(self) -> list[tuple[tuple[str, str], torch.Tensor]]:
        return [(k, self[k]) for k in self._parts]

    def __contains__(self, key) -> bool:
        return ((key, "output") if isinstance(key, str) else tuple(key)) in self._parts

    def __iter__(self):
        return iter(list(self._parts))

    def __len__(self) -> int:
        return len(self._parts)

    def __repr__(self) -> str:
        return f"<probe.capture: {len(self._parts)} captures from {self.forwards} forwards>"


def _tokens(args: tuple, kwargs: dict) -> TokenBatch | None:
    """The token layout of a forward on token ids (`input_ids` as keyword or first positional
    argument, `attention_mask` as keyword), which token reductions and rows need."""
    ids = kwargs.get("input_ids")
    if ids is None and args and isinstance(args[0], torch.Tensor):
        ids = args[0]
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.is_floating_point():
        return None
    return TokenBatch.of(ids, kwargs.get("attention_mask"))


def capture(model: nn.Module, probes, *, to=None, batch_size: int | None = None) -> MemoryCapture:
    """`with probe.capture(model, probes) as cap:`; see MemoryCapture. `probes` is a mapping
    name -> probe spec (as in a probe file) or a shipped probe file's name."""
    return MemoryCapture(model, probes, to=to, batch_size=batch_size)
