"""The hooks of a run's declared edits, hung by the edits' run part (probe.launch.parts.edit_effects)
through one HookSet level of their own: all or none, removed on any exit.

An edit acts while the run's capture has a pass open (`Capture.begin` .. `end`: the run's own
forward, a grid's cell passes, an SAE's measuring passes), never in the passes the edits' part
makes before (the clean target, the pair's source), and on every repeat of a stacked batch (a
grid's cells) alike. The edits' hooks are hung before the capture's (the run enters a part's
`edits` before the capture), so at one module the edits act first and a probe there captures
the edited value; what an edit changed is left on the pass's batch
(`BatchCapture.edited`: before and after, by dataset name), where a probe with `unedited: true`
takes the value before. A gradient edit acts as the gradient flows back through the site's
tensor (a module's input: its own use of it, a copy); the gradient before and after it are left
the same way, for the gradient sites' probes (probe.hooks.backward).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from probe.errors import ModelError
from probe.hooks.capture import BatchCapture, Capture
from probe.hooks.hookset import HookSet
from probe.hooks.names import dataset_name, flatten, replace_tensors
from probe.intervene.edits import Edit
from probe.site_keys import SiteKey

FORWARD = {"input": "grad_input", "output": "grad_output"}  # a site and its gradient's


class EditHooks:
    """Context manager: every edit of `edits` hung on its module, acting during the passes of
    `capture`."""

    def __init__(self, edits: Sequence[Edit], capture: Capture) -> None:
        self.capture = capture
        self.by_module: dict[str, tuple[torch.nn.Module, dict[str, list[Edit]]]] = {}
        for e in edits:
            module, sites = self.by_module.setdefault(e.module_name, (e.module, {}))
            sites.setdefault(e.site, []).append(e)
        self.hooks = HookSet("edits")
        self.calls: Counter[tuple[str, str]] = Counter()  # (module, input|output) this pass
        self.batch: BatchCapture | None = None  # the pass the counts are of

    def __enter__(self) -> EditHooks:
        self.hooks.enter(self._hang)
        return self

    def __exit__(self, *exc) -> None:
        self.hooks.__exit__(*exc)

    def _hang(self) -> None:
        for name, (module, sites) in self.by_module.items():
            if "input" in sites or "grad_input" in sites:
                self.hooks.forward_pre(module, self._pre_hook(name, sites), name=name)
            if "output" in sites or "grad_output" in sites:
                self.hooks.forward(module, self._post_hook(name, sites), name=name)

    def _pass(self, name: str, site: str) -> tuple[BatchCapture | None, int]:
        """The capture's open pass (None: none) and this call's index at the module's site."""
        batch = self.capture.batch
        if batch is None:
            return None, 0
        if batch is not self.batch:
            self.batch = batch
            self.calls.clear()
        call = self.calls[name, site]
        self.calls[name, site] += 1
        return batch, call

    def _pre_hook(self, name: str, sites: dict[str, list[Edit]]):
        def hook(module, args):
            batch, call = self._pass(name, "input")
            if batch is None:
                return None
            if not args:
                raise ModelError(
                    f"layer {name!r} was called with no positional input, so it has no "
                    "'input'/'grad_input' to edit; use the output site or edit another layer"
                )
            new = [
                self._site(
                    batch,
                    name,
                    sites,
                    a,
                    "" if len(args) == 1 else f".{i}",
                    call,
                    "input",
                    own_use=True,
                )  # fmt: skip
                if isinstance(a, torch.Tensor)
                else a
                for i, a in enumerate(args)
            ]
            return tuple(new) if any(n is not a for n, a in zip(new, args, strict=True)) else None

        return hook

    def _post_hook(self, name: str, sites: dict[str, list[Edit]]):
        def hook(module, args, output):
            batch, call = self._pass(name, "output")
            if batch is None:
                return None
            if isinstance(output, torch.Tensor):  # most modules: no structure to walk
                new = self._site(batch, name, sites, output, "", call, "output")
                return None if new is output else new
            new = replace_tensors(
                output, lambda path, x: self._site(batch, name, sites, x, path, call, "output")
            )
            changed = any(
                a is not b for (_, a), (_, b) in zip(flatten(new), flatten(output), strict=True)
            )
            return new if changed else None

        return hook

    def _site(self, batch: BatchCapture, name: str, sites: dict[str, list[Edit]],
              x: torch.Tensor, path: str, call: int, site: str,
              own_use: bool = False) -> torch.Tensor:  # fmt: skip
        """One tensor at one site edited (each repeat of a stacked batch alike), its gradient's
        edits hung on it; returns the tensor the model goes on with."""
        key = str(SiteKey(site, path, call))
        edited = x
        for e in sites.get(site, []):
            if batch.repeats == 1:
                edited = e.apply(edited, batch.start, key, batch.tokens)
            else:  # the batch repeated (a grid's stacked cells): each repeat edited alike
                parts = edited.chunk(batch.repeats)
                edited = torch.cat([e.apply(c, batch.start, key, batch.tokens) for c in parts])
        if edited is not x:
            batch.edited[name, key] = (x, edited)
        grad_edits = sites.get(FORWARD[site], [])
        if not grad_edits or not edited.requires_grad:
            return edited
        if own_use:  # a module's input gradient is its own use of the tensor: a copy of it
            edited = edited.clone()
        gkey = (name, dataset_name(FORWARD[site], path, call))
        hook = _grad_hook(grad_edits, gkey, batch)
        self.hooks.tensor(edited, hook, name=f"{name} {gkey[1]}")
        return edited


def _grad_hook(edits: list[Edit], gkey: tuple[str, str], batch: BatchCapture):
    """Applies gradient edits as the gradient flows back; leaves it before and after."""

    def hook(grad):
        before = grad
        for e in edits:
            grad = e.apply(grad, batch.start, gkey[1])
        batch.edited[gkey] = (before, grad)
        return grad

    return hook
