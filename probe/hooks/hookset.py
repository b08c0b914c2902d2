"""The one owner of hook handles: every hook probe hangs on a model, a tensor, an autograd node or
an optimizer is registered through a HookSet and removed by it.

A HookSet is a context manager. Hooks registered while it is entered belong to that level; leaving
the level removes them, on any exit (an exception, KeyboardInterrupt, a generator closed mid-way),
and the set can be entered again inside itself (an inner level's hooks go when the inner `with`
ends, the outer ones stay). Registration is all or none: when one registration fails, every hook
of the level being registered is removed before the error propagates (outside any `with`, every
hook of the set), so a model is never left half-hooked. `repr` says what the set holds.

    hooks = HookSet("capture")
    with hooks:
        hooks.forward(module, fn, name="layer1.0.conv1")
        model(x)
    # no hook left, however the block ended

A class that hooks a model on `__enter__` opens its level with `hooks.enter(register)` (a failed
`register` closes the level again) and closes it with `hooks.__exit__(*exc)`.

Kinds: forward, forward_pre, full_backward, full_backward_pre (modules, or every module with
`module=None`: torch's module-global hooks), tensor (`Tensor.register_hook`), post_accumulate_grad
(a leaf's gradient after accumulation), node (an autograd Node's hook or pre-hook),
optimizer_step_pre and optimizer_step_post. Tensor and node hooks are registered anew on every
forward; the set forgets those whose tensor or graph is gone when it takes the next one, so a set
held for a whole run does not grow batch by batch.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as module_globals
from torch.utils.hooks import RemovableHandle

PER_FORWARD = ("tensor", "node", "node_pre")  # kinds whose targets live one forward and backward


@dataclass(frozen=True)
class Held:
    """One registered hook: its kind, what it hangs on (a name for repr), its level, its handle."""

    kind: str
    target: str
    level: int
    handle: Any


class HookSet:
    """Owns hook handles: registers all or none, removes them on leaving the level they were
    registered at (or on `remove()`). `label` names the set in its repr."""

    def __init__(self, label: str = "hooks"):
        self.label = label
        self._held: list[Held] = []
        self._level = 0

    # -- levels ------------------------------------------------------------------------------
    @property
    def level(self) -> int:
        """How many `with` levels are open (0: none)."""
        return self._level

    def __enter__(self) -> HookSet:
        self._level += 1
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._remove_from(self._level)
        finally:
            self._level = max(self._level - 1, 0)

    def enter(self, register: Callable[[], object]) -> HookSet:
        """Open a level and call `register()` to hang its hooks; if that raises, the level is
        closed (its hooks removed) before the error goes on. For an owner's own `__enter__`."""
        self.__enter__()
        try:
            register()
        except BaseException as error:
            self.__exit__(type(error), error, error.__traceback__)
            raise
        return self

    def remove(self) -> None:
        """Remove every hook the set holds, at every level."""
        self._remove_from(0)

    def _remove_from(self, level: int) -> None:
        """Remove the hooks registered at `level` or deeper, newest first; every one is tried
        even if one raises (the first error is raised after)."""
        first: BaseException | None = None
        keep = [h for h in self._held if h.level < level]
        for held in reversed([h for h in self._held if h.level >= level]):
            try:
                held.handle.remove()
            except BaseException as e:  # noqa: BLE001 - every handle is removed, then it raises
                first = first or e
        self._held = keep
        if first is not None:
            raise first

    # -- registration --------------------------------------------------------------------------
    def _add(self, kind: str, target: str, register: Callable[[], RemovableHandle]):
        if kind in PER_FORWARD:
            self._held = [h for h in self._held if not _gone(h)]
        try:
            handle = register()
        except BaseException as error:
            try:  # the level being registered: all or none
                self._remove_from(self._level)
            except BaseException as also:  # noqa: BLE001 - the registration's error goes on
                if sys.version_info >= (3, 11):  # (notes are 3.11's; 3.10 raises the error bare)
                    error.add_note(f"{self.label}: removing the hooks also raised {also!r}")
            raise
        self._held.append(Held(kind, target, self._level, handle))
        return handle

    def forward(
        self,
        module: nn.Module | None,
        fn: Callable,
        *,
        name: str | None = None,
        prepend: bool = False,
        with_kwargs: bool = False,
        always_call: bool = False,
    ) -> RemovableHandle:
        """`fn(module, args, output)` (with_kwargs: `fn(module, args, kwargs, output)`) after
        `module`'s forward; a non-None return replaces the output. `module=None`: after every
        module's forward (torch's global hook; no `prepend`)."""
        if module is None:
            _global_lacks("forward", prepend=prepend)
            return self._add(
                "forward",
                "<every module>",
                lambda: module_globals.register_module_forward_hook(
                    fn, with_kwargs=with_kwargs, always_call=always_call
                ),
            )
        return self._add(
            "forward",
            _name(module, name),
            lambda: module.register_forward_hook(
                fn, prepend=prepend, with_kwargs=with_kwargs, always_call=always_call
            ),
        )

    def forward_pre(
        self,
        module: nn.Module | None,
        fn: Callable,
        *,
        name: str | None = None,
        prepend: bool = False,
        with_kwargs: bool = False,
    ) -> RemovableHandle:
        """`fn(module, args)` (with_kwargs: `fn(module, args, kwargs)`) before `module`'s forward;
        a non-None return replaces the arguments. `module=None`: before every module's forward
        (no `prepend`, no `with_kwargs`)."""
        if module is None:
            _global_lacks("forward_pre", prepend=prepend, with_kwargs=with_kwargs)
            return self._add(
                "forward_pre",
                "<every module>",
                lambda: module_globals.register_module_forward_pre_hook(fn),
            )
        return self._add(
            "forward_pre",
            _name(module, name),
            lambda: module.register_forward_pre_hook(fn, prepend=prepend, with_kwargs=with_kwargs),
        )

    def full_backward(
        self, module: nn.Module | None, fn: Callable, *, name: str | None = None,
        prepend: bool = False,
    ) -> RemovableHandle:  # fmt: skip
        """`fn(module, grad_input, grad_output)` once the module's input gradients are computed
        (in-place ops after the module break it: probe's gradient sites use tensor hooks).
        `module=None`: every module's (no `prepend`)."""
        if module is None:
            _global_lacks("full_backward", prepend=prepend)
            return self._add(
                "full_backward",
                "<every module>",
                lambda: module_globals.register_module_full_backward_hook(fn),
            )
        return self._add(
            "full_backward",
            _name(module, name),
            lambda: module.register_full_backward_hook(fn, prepend=prepend),
        )

    def full_backward_pre(
        self, module: nn.Module | None, fn: Callable, *, name: str | None = None,
        prepend: bool = False,
    ) -> RemovableHandle:  # fmt: skip
        """`fn(module, grad_output)` before the module's input gradients are computed.
        `module=None`: every module's (no `prepend`)."""
        if module is None:
            _global_lacks("full_backward_pre", prepend=prepend)
            return self._add(
                "full_backward_pre",
                "<every module>",
                lambda: module_globals.register_module_full_backward_pre_hook(fn),
            )
        return self._add(
            "full_backward_pre",
            _name(module, name),
            lambda: module.register_full_backward_pre_hook(fn, prepend=prepend),
        )

    def tensor(self, tensor: torch.Tensor, fn: Callable, *, name: str = "tensor"):
        """`fn(grad)` when the gradient with respect to `tensor` is computed (a non-None return
        replaces it)."""
        return self._add("tensor", name, lambda: tensor.register_hook(fn))

    def post_accumulate_grad(self, param: torch.Tensor, fn: Callable, *, name: str = "param"):
        """`fn(param)` after a leaf's `.grad` has been accumulated: the gradient an optimizer
        sees (leaf tensors only)."""
        return self._add(
            "post_accumulate_grad", name, lambda: param.register_post_accumulate_grad_hook(fn)
        )

    def node(self, node, fn: Callable, *, name: str = "node", pre: bool = False):
        """An autograd Node's hook: `fn(grad_inputs, grad_outputs)`, or with `pre` its
        pre-hook `fn(grad_outputs)` (a non-None return replaces the gradients)."""
        register = node.register_prehook if pre else node.register_hook
        return self._add("node_pre" if pre else "node", name, lambda: register(fn))

    def optimizer_step_pre(self, optimizer: torch.optim.Optimizer, fn: Callable):
        """`fn(optimizer, args, kwargs)` before every `optimizer.step()`."""
        return self._add(
            "optimizer_step_pre",
            type(optimizer).__name__,
            lambda: optimizer.register_step_pre_hook(fn),
        )

    def optimizer_step_post(self, optimizer: torch.optim.Optimizer, fn: Callable):
        """`fn(optimizer, args, kwargs)` after every `optimizer.step()`."""
        return self._add(
            "optimizer_step_post",
            type(optimizer).__name__,
            lambda: optimizer.register_step_post_hook(fn),
        )

    # -- what it holds ---------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._held)

    def __bool__(self) -> bool:
        return True  # an empty set is still a set (`if hooks:` must not mean "holds some")

    def kinds(self) -> Counter:
        """How many hooks of each kind the set holds."""
        return Counter(h.kind for h in self._held)

    def targets(self, kind: str | None = None) -> list[str]:
        """What the held hooks hang on (of one kind), in registration order."""
        return [h.target for h in self._held if kind is None or h.kind == kind]

    def __repr__(self) -> str:
        if not self._held:
            return f"<HookSet {self.label!r}: no hooks; level {self._level}>"
        kinds = ", ".join(f"{n} {k}" for k, n in self.kinds().items())
        shown = list(dict.fromkeys(h.target for h in self._held))
        more = f", ... {len(shown) - 4} more" if len(shown) > 4 else ""
        return (
            f"<HookSet {self.label!r}: {len(self._held)} hooks ({kinds}) on "
            f"{', '.join(shown[:4])}{more}; level {self._level}>"
        )


def _name(module: nn.Module, name: str | None) -> str:
    return name if name is not None else type(module).__name__


def _gone(held: Held) -> bool:
    """Whether a tensor or node hook's target has been freed (its hook dict with it)."""
    ref = getattr(held.handle, "hooks_dict_ref", None)
    return held.kind in PER_FORWARD and ref is not None and ref() is None


def _global_lacks(kind: str, **asked: bool) -> None:
    """torch's module-global hooks take fewer options than a module's: refuse one they lack."""
    given = [k for k, v in asked.items() if v]
    if given:
        raise TypeError(f"a global {kind} hook (module=None) takes no {', '.join(given)}")
