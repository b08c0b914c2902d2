"""Capture: every probe hook (captures and edits) on a model in one context manager, and what one
batch produces (BatchCapture). Its hooks belong to one HookSet: hung all or none on entry,
removed on any exit, the gradient-edit hooks it hangs on tensors during a forward included.

Forward values are copied inside the hook (a later in-place op cannot change them). Gradients are
taken with respect to the autograd edge each tensor had when the hook saw it, so an in-place op
after the module (resnet's ReLU(inplace=True) after bn1, `out += identity` after bn2) does not move
the gradient onto the wrong tensor, and the user's model is never modified.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch.autograd.graph import get_gradient_edge

from probe.errors import ModelError
from probe.hooks.backward import DTYPES, Attributed, PendingGrad
from probe.hooks.buffers import AlignedPool, aligned_empty
from probe.hooks.hookset import HookSet
from probe.hooks.module_select import Selection
from probe.hooks.names import dataset_name, flatten, replace_tensors
from probe.hooks.sae_site import SaeSite, sae_site, take_sae
from probe.hooks.transcoder_site import TranscoderSite, take_features, transcoder_site
from probe.layout import TokenBatch, reduced, token_rows, unit_axis
from probe.site_keys import ATTRIBUTION_SITES, SiteKey

Key = tuple[str, str]  # (layer, site): a capture's dataset
# the attribution sites that explain a module's output, and its input
ATTRIBUTED = {
    "output": tuple(s for s in ATTRIBUTION_SITES if s != "grad_x_input"),
    "input": ("grad_x_input",),
}


class Listener(Protocol):
    """A run part that reduces each value as it is captured (its statistics, its examples per
    unit), on the value's device, before any later in-place op can change it."""

    def took(self, key: Key, value: torch.Tensor, axis: int, sel: Selection,
             batch: BatchCapture) -> None: ...  # fmt: skip


@dataclass
class BatchCapture:
    """What one batch produced: per-sample tensors by (layer, dataset) and gradient edges to resolve."""

    size: int
    start: int = 0
    values: dict[Key, torch.Tensor] = field(default_factory=dict)
    pending: list[PendingGrad] = field(default_factory=list)
    listeners: tuple[Listener, ...] = ()  # told of each value as it is taken
    keep_values: bool = True  # False: only statistics are wanted (store.mode=stats)
    pool: AlignedPool | None = None  # where CPU copies come from
    pooled: list[torch.Tensor] = field(default_factory=list)  # to give back once written
    layouts: dict[Key, torch.Tensor] = field(default_factory=dict)  # across batches
    axes: dict[Key, int] = field(default_factory=dict)  # unit axis of each dataset
    tokens: TokenBatch | None = None  # a token batch's mask (token reductions and rows)
    recording: bool = True  # False: the edits act, nothing is captured (a grid's cell passes)
    repeats: int = 1  # the batch stacked so many times in one forward (a grid's cells)
    attributed: list[Attributed] = field(default_factory=list)  # for the attribution sites
    token_keys: set[Key] = field(default_factory=set)  # the datasets of token rows
    unstored: set[Key] = field(default_factory=set)  # statistics, no dataset
    plain: dict[Key, dict] = field(default_factory=dict)  # no statistics: attrs
    # what an edit changed in this pass, by dataset: (before, after) (probe.intervene.edit_hooks)
    edited: dict[Key, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def take(self, key: Key, t: torch.Tensor, sel: Selection, store: bool = True) -> None:
        """Capture `t` at `key`. The listeners see the value now, before any later in-place op
        (a CPU one while it is in cache, a GPU one where it lives); when values are not kept (or
        not `store`d) it then needs no copy, and `values` holds an empty tensor that only tells
        the sink the layout."""
        if not store:
            self.unstored.add(key)
        keeping = self.keep_values and store
        listened = bool(self.listeners)
        value, axis = keep(
            t, sel, self.size, key, keeping or not listened, self.pool, self.pooled, self.tokens
        )
        self.axes[key] = axis
        if sel.rows == "tokens" and t.ndim >= 2:  # one row per token (as `keep` made them)
            self.token_keys.add(key)
        for listener in self.listeners:
            listener.took(key, value, axis, sel, self)
        if listened and not keeping:
            value = self.layout(key, value)
        self.values[key] = value

    def take_plain(self, key: Key, t: torch.Tensor, sel: Selection, **attrs) -> None:
        """Store `t` at `key` in the probe's rows, without statistics or examples (an SAE's
        sparse latents: slot indices and values); `attrs` go on its dataset."""
        args = (self.size, key, True, self.pool, self.pooled, self.tokens)
        self.values[key], self.axes[key] = keep(t, sel, *args)
        if sel.rows == "tokens" and t.ndim >= 2:
            self.token_keys.add(key)
        self.plain[key] = attrs

    def layout(self, key: Key, value: torch.Tensor) -> torch.Tensor:
        """An empty tensor shaped like a row of `value`: the layout, not the activation, which
        the sink reads for a dataset's first batch only (its statistics merge whatever the
        later rows' shape), so the first batch's serves them all (fewer torch calls a hook)."""
        held = self.layouts.get(key)
        if held is None:
            held = self.layouts[key] = value.new_empty((0, *value.shape[1:]))
        return held


@dataclass
class HookedModule:
    """Everything hooked on one module: its capture selection and its SAE."""

    name: str
    module: torch.nn.Module
    selection: Selection
    sae: SaeSite | None = None  # a sparse autoencoder on its output (probe.hooks.sae_site)
    transcoder: TranscoderSite | None = None  # a transcoder on its input (transcoder_site)

    def __post_init__(self):
        self.captured = frozenset(self.selection.sites)
        self.explains = {
            site: tuple(s for s in ATTRIBUTED[site] if s in self.captured) for site in ATTRIBUTED
        }

    def captures(self, site: str) -> bool:
        return site in self.captured

    def wants(self, *sites: str) -> bool:
        return any(s in self.captured or self.explains.get(s) for s in sites)


class Capture:
    """Context manager: all hooks on entry (all or none), every hook removed on any exit.

    Hooks act only between `begin()` and `end()`, so a clean forward of the same model (no edits,
    no captures) can run in between. The run's edits hang their own hooks, acting in the same
    passes and before the capture at one site (probe.intervene.edit_hooks).
    """

    def __init__(
        self,
        selections: list[Selection],
        index_offset: int = 0,
        keep_values: bool = True,
    ):
        self.selections = selections
        self.listeners: list[Listener] = []  # told of each value of a recorded pass
        self.keep_values = keep_values
        self.pool = AlignedPool()  # copies of CPU captures, reused once a batch is written
        self.index_offset = index_offset  # this process's first sample in the dataset (torchrun)
        self.hooked = [
            HookedModule(s.name, s.module, s, sae=sae_site(s), transcoder=transcoder_site(s))
            for s in selections
        ]
        probes = ", ".join(dict.fromkeys(s.probe for s in selections))
        self.hooks = HookSet(f"capture ({probes})" if probes else "capture")
        self.batch: BatchCapture | None = None
        self.in_calls: Counter[str] = Counter()
        self.out_calls: Counter[str] = Counter()
        self.layouts: dict[tuple[str, str], torch.Tensor] = {}
        self.axes: dict[tuple[str, str], int] = {}

    def __enter__(self) -> Capture:
        self.hooks.enter(self._hang)
        return self

    def listen(self, listener: Listener) -> None:
        """Tell `listener` of every value the run's recorded passes take from now on."""
        self.listeners.append(listener)

    def _hang(self) -> None:
        for t in self.hooked:
            if t.wants("input", "grad_input") or t.transcoder is not None:
                self.hooks.forward_pre(t.module, self._pre_hook(t), name=t.name)
            if t.wants("output", "grad_output"):
                self.hooks.forward(t.module, self._post_hook(t), name=t.name)

    def __exit__(self, *exc) -> None:
        self.batch = None
        self.hooks.__exit__(*exc)

    def begin(
        self,
        size: int,
        start: int = 0,
        tokens: TokenBatch | None = None,
        recording: bool = True,
        repeats: int = 1,
    ) -> BatchCapture:
        self.batch = BatchCapture(
            size,
            self.index_offset + start,
            listeners=tuple(self.listeners) if recording else (),
            keep_values=self.keep_values,
            pool=self.pool,
            layouts=self.layouts,
            axes=self.axes,
            tokens=tokens,
            recording=recording,
            repeats=repeats,
        )
        self.in_calls.clear()
        self.out_calls.clear()
        return self.batch

    def end(self) -> None:
        self.batch = None

    def _pre_hook(self, t: HookedModule):
        def hook(module, args):
            batch = self.batch
            if batch is None:
                return None
            call = self.in_calls[t.name]
            self.in_calls[t.name] += 1
            if not args:
                raise ModelError(
                    f"layer {t.name!r} was called with no positional input, so it has no "
                    "'input'/'grad_input' to capture or edit; use the output site or exclude it"
                )
            new = [
                self._site(
                    batch,
                    t,
                    a,
                    "" if len(args) == 1 else f".{i}",
                    call,
                    "input",
                    "grad_input",
                    own_use=True,
                )
                if isinstance(a, torch.Tensor)
                else a
                for i, a in enumerate(args)
            ]
            return tuple(new) if any(n is not a for n, a in zip(new, args, strict=True)) else None

        return hook

    def _post_hook(self, t: HookedModule):
        def hook(module, args, output):
            batch = self.batch
            if batch is None:
                return None
            call = self.out_calls[t.name]
            self.out_calls[t.name] += 1
            if isinstance(output, torch.Tensor):  # most modules: no structure to walk
                new = self._site(batch, t, output, "", call, "output", "grad_output")
                return None if new is output else new
            new = replace_tensors(
                output,
                lambda path, x: self._site(batch, t, x, path, call, "output", "grad_output"),
            )
            changed = any(
                a is not b for (_, a), (_, b) in zip(flatten(new), flatten(output), strict=True)
            )
            return new if changed else None

        return hook

    def _site(
        self,
        batch: BatchCapture,
        t: HookedModule,
        x: torch.Tensor,
        path: str,
        call: int,
        site: str,
        grad_site: str,
        own_use: bool = False,
    ) -> torch.Tensor:
        """Capture one tensor at one site (an edit there acted already) into `batch` (the one
        begun); returns the tensor the model goes on with."""
        site_key = SiteKey(site, path, call)
        key = str(site_key)
        sel = t.selection
        onward = x
        if t.sae is not None and site == "output" and call == 0 and path in ("", ".0"):
            onward = take_sae(batch, t.name, t.sae, x, sel)
        if t.transcoder is not None and site == "input" and call == 0 and path in ("", ".0"):
            take_features(batch, t.transcoder, x, sel)
        captured = site in t.captured and batch.recording
        if captured and sel.unedited and (t.name, key) in batch.edited:
            batch.take((t.name, str(site_key.unedited())), batch.edited[t.name, key][0], sel)
        if captured:
            batch.take((t.name, key), x, sel)
        if onward is not x:  # spliced: the model goes on with the SAE's reconstruction
            return onward
        explains = t.explains.get(site) if batch.recording else None
        if not x.requires_grad or not (t.wants(grad_site) or explains):
            return x
        if own_use:  # grad_input is this module's own contribution, not every use of the tensor
            x = x.clone()
        if explains:
            check_batch_axis(x, batch.size, (t.name, key))
            edge = get_gradient_edge(x) if explains != ("ig_output",) else None
            held = x.detach().clone()  # (a later in-place op would change it)
            batch.attributed.append(Attributed(t.name, site_key, held, edge, sel, explains))
        if t.captures(grad_site):
            gkey = (t.name, dataset_name(grad_site, path, call))
            check_batch_axis(x, batch.size, gkey)
            batch.pending.append(PendingGrad(gkey, get_gradient_edge(x), x.shape, sel))
        return x


def check_batch_axis(t: torch.Tensor, size: int, key: tuple[str, str]) -> None:
    shape = t.shape
    if not shape or shape[0] != size:
        raise ModelError(
            f"layer {key[0]!r} {key[1]} has shape {tuple(t.shape)}, whose first axis is not the batch "
            f"of {size}; exclude this layer from the probe (exclude: [{key[0]!r}])"
        )


def keep(
    t: torch.Tensor,
    sel: Selection,
    size: int,
    key: tuple[str, str],
    copy: bool = True,
    pool: AlignedPool | None = None,
    lent: list[torch.Tensor] | None = None,
    tokens: TokenBatch | None = None,
) -> tuple[torch.Tensor, int]:
    """A private copy of `t` (with copy=False: possibly `t` itself) after the probe's reduction
    or token rows, in its storage dtype, on its device (probe.hooks.device.to_host moves GPU copies to
    the host without stalling the GPU), and the axis of its units. A CPU copy is page-aligned,
    taken from `pool` and listed in `lent` when they are given."""
    check_batch_axis(t, size, key)
    ndim = t.ndim
    axis = unit_axis(sel.unit_axis, sel.class_axis, ndim, f"probe {sel.probe!r} layer {key[0]!r}")
    kind = t.dtype
    dtype = DTYPES[sel.dtype] if kind.is_floating_point else kind
    by_token = sel.rows == "tokens" and ndim >= 2
    shaped = by_token or (sel.reduce != "none" and ndim >= 3)
    if not copy and not shaped and kind == dtype:  # (few tensor calls: in a hook each costs)
        return (t if not t.requires_grad else t.detach()), axis
    x = t.detach()
    fresh = False  # x is a new tensor already (no copy needed)
    if by_token:
        x, axis = token_rows(x, axis, tokens, f"probe {sel.probe!r} layer {key[0]!r} {key[1]}")
        fresh = tokens is not None and tokens.flat is not None  # (token_rows refuses no tokens)
    elif shaped:
        where = f"probe {sel.probe!r} layer {key[0]!r} {key[1]}"
        x, axis = reduced(x, sel.reduce, axis, tokens, where)
        fresh = True
        dtype = DTYPES[sel.dtype] if x.is_floating_point() else x.dtype  # means are float
    if copy and not fresh and x.device.type == "cpu":  # aligned, so it can be written O_DIRECT
        if pool is None:
            return aligned_empty(x.shape, dtype).copy_(x), axis
        buffer = pool.take(x.shape, dtype)
        if lent is not None:  # given back to `pool` once the batch is written
            lent.append(buffer)
        return buffer.copy_(x), axis
    return x.to(dtype=dtype, copy=copy and not fresh), axis
