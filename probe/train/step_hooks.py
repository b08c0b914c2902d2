"""The core of a watched training: hooks in the user's forward and backward, and the step's
entry points, whatever drives the steps (a plain loop, an optimizer's step hooks, a trainer's
callbacks).

A step goes through, in order:

    forward_begins()      each training forward (the root's, or the loop's first call of a
                          watched module: see Watcher._opener_hook)
      module hooks         values, and tensor hooks for the gradients of the user's backward
    take_params()         the parameters before the update (and a copy for param_update)
    take_grads(opt)       the gradients the optimizer sees, the global grad norms, the lrs
    take_updates()        what the optimizer step changed
    end_step()            the step's StepRecord -> merge_ranks -> the sink; the next step begins

Only recorded steps (the schedule's) reduce anything; on the others the hooks return at once,
except where a gradient edit acts: edits act at every step. Statistics are taken only in
forwards run with gradients enabled (a validation pass under no_grad inside the loop is not the
training's); the probe batch runs with the watch `paused()`.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from probe.errors import ConfigError, ModelError
from probe.hooks.hookset import HookSet
from probe.hooks.names import dataset_name, flatten
from probe.layout import unit_axis
from probe.site_keys import VALUE_GRAD_SITES, VALUE_SITES, SiteKey, parse_or_none
from probe.stats import backend
from probe.stats.running import RunningStats, bounds_for
from probe.store.steps_file import SiteInfo, step_row
from probe.train import grad_norms
from probe.train.schedule import Schedule
from probe.train.step_stats import Key, Settled, StepStats
from probe.train.watched_sites import WatchedModule, class_name
from probe.watch_options import WatchOptions

log = logging.getLogger("probe")
VALUE_AND_GRAD_SITES = (*VALUE_SITES, *VALUE_GRAD_SITES)  # sites a module's values name


@dataclass
class _Staged:
    """A recorded step between its end and its record: its statistics (the device's on their
    way), what it recorded of each site, its scalars, its losses (None: read with the copy)."""

    step: int
    settled: Settled
    infos: dict[Key, SiteInfo]
    values: dict[str, float | None]  # None: a device's, read with the copy
    losses: list[float | None]
    summed: bool
    whole: frozenset[str]  # scalars that are the training's, not a rank's share


@dataclass
class StepRecord:
    """What one recorded step gives the sink: statistics and SiteInfo by (layer, site), the
    step's scalars (grad_norm, grad_norm_preclip, lr.<group>, grad_scale) and the step's
    loss (one value; several where the micro-batches' losses are averaged)."""

    step: int
    stats: dict[Key, RunningStats]
    infos: dict[Key, SiteInfo]
    scalars: dict[str, float]
    losses: list[float]
    whole: frozenset[str] = frozenset()  # scalars that are the training's, not a rank's share


@dataclass
class Hooked:
    """One module the watch hooks: what it records (None: only edited) and its gradient edits
    by site."""

    name: str
    module: nn.Module
    watched: WatchedModule | None
    edits: dict[str, list] = field(default_factory=dict)

    def prepare(self) -> None:
        """Its flags, read in every hook call, once its edits are all added."""
        sites = self.watched.sites if self.watched is not None else set()
        self.record_input = "input" in sites
        self.record_output = "output" in sites
        self.record_grad_input = "grad_input" in sites
        self.record_grad_output = "grad_output" in sites
        self.edit_input = bool(self.edits.get("grad_input"))
        self.edit_output = bool(self.edits.get("grad_output"))
        self.module_type = class_name(self.module)

    @property
    def before(self) -> bool:
        return self.record_input or self.record_grad_input or self.edit_input

    @property
    def after(self) -> bool:
        return self.record_output or self.record_grad_output or self.edit_output


class Watcher:
    """Hooks and per-step statistics of one watched model.

    From `options` (probe.watch_options.WatchOptions) it takes the schedule (`every`),
    `fail_on_nonfinite`, and whether an optimizer's step hook reads the parameters (without one
    they are read at a step's first forward). `sink(step, rows, scalars)` takes each recorded
    step: rows {(layer, site): (SiteInfo, STAT_COLUMNS row)}, scalars {name: float}.
    `merge_ranks(record)` turns this process's StepRecord into the training's, or None where
    this process writes nothing (None: this process's is the training's; probe.train.ranks
    merges the ranks of a distributed training: activation sites over the ranks' batches,
    sharded parameters' pieces, `SiteInfo.kind` says which). Parameters are read through
    `to_local()` where they are DTensors (FSDP2's shards). `failing(message)` runs before a
    fatal non-finite value raises (the file is flushed there)."""

    def __init__(
        self,
        model: nn.Module,
        watched: list[WatchedModule],
        edits: list,
        options: WatchOptions,
        sink: Callable[[int, dict, dict], None],
        *,
        failing: Callable[[str], None] | None = None,
        merge_ranks: Callable[[StepRecord], StepRecord | None] | None = None,
    ):
        self.model = model
        self.watched = watched
        self.schedule = Schedule(options.every)
        self.sink = sink
        self.fail_on_nonfinite = bool(options.fail_on_nonfinite)
        self.failing = failing
        self.merge_ranks: Callable[[StepRecord], StepRecord | None] = (
            merge_ranks if merge_ranks is not None else lambda record: record
        )
        # a distributed training's ranks merge each step as it ends (a collective: no step
        # waits for a later one), whole histograms and all
        self.ranked = merge_ranks is not None
        # every value reduced on its device where the torch backend reduces (a GPU's always)
        self.on_device = backend.cpu_name() == "torch"
        self.staged: deque[_Staged] = deque()  # recorded steps whose device copy is under way
        hooked = {w.name: Hooked(w.name, w.module, w) for w in watched}
        for e in edits:
            if e.module_name not in hooked:
                hooked[e.module_name] = Hooked(e.module_name, e.module, None)
            hooked[e.module_name].edits.setdefault(e.site, []).append(e)
        for h in hooked.values():
            h.prepare()
        self.hooked = list(hooked.values())
        self.by_name = hooked
        self.edited = bool(edits)
        self.hooks = HookSet("watch")
        self.grad_hooks = HookSet("watch: gradients of this step's forwards")
        self.infos: dict[Key, SiteInfo] = {}  # every site seen, in order of first appearance
        self.layouts: dict[Key, tuple] = {}  # (saturation bounds, unit axis) by site
        self.reported: set[Key] = set()  # sites whose non-finite values were logged
        self.missing: set[tuple[str, str]] = set()  # gradient sites said to get nothing
        # the names an asked value site became (a tuple's items, a second call), by (layer, site
        # asked), and those not yet said in the log (Watch notes them: `renamed()`)
        self.names_of: dict[tuple[str, str], list[str]] = {}
        self.unsaid: set[tuple[str, str]] = set()
        self.is_paused = False  # (while the probe batch runs: see paused())
        self.rows_seen = 0  # rows of the training's forwards: the noise edits' sample index
        self.forwards = 0  # training forwards while watched
        self.grads_seen = 0  # gradient values recorded while watched
        self.params_at_forward = options.optimizer is None  # take_params at the first forward
        self.sharded = any(is_dtensor(p) for p in model.parameters())
        self.needs_forwards = bool(edits) or any(w.sites for w in watched)
        self.norm_hooks = HookSet("watch: the end of each backward (the gradient norms)")
        self.norms = grad_norms.GradNorms(model)  # grad_norm and grad_norm_preclip
        self.norm_queued = False
        self.opener: nn.Module | None = None  # the module whose call began the open forward
        self.param_batch: list | None = None  # parameter sites held to be reduced together
        self.begin(0)

    # -- hooks -------------------------------------------------------------------------------
    def attach(self) -> None:
        """Register every hook (all or none), each refusing to run in compiled code. The
        forward detection comes first: on the root, on each hooked module and on the modules
        between them (see `_opener_hook`)."""
        names = dict(self.model.named_modules())
        openers = {"": self.model}
        for h in self.hooked:
            parts = h.name.split(".")
            for i in range(1, len(parts) + 1):
                name = ".".join(parts[:i])
                if name in names:
                    openers.setdefault(name, names[name])
        for name, module in openers.items():
            hook = uncompiled(self._opener_hook(root=module is self.model))
            self.hooks.forward_pre(module, hook, name=name or "<model>", with_kwargs=True)
        for h in self.hooked:
            if h.before:
                self.hooks.forward_pre(h.module, uncompiled(self._pre_hook(h)), name=h.name)
            if h.after:
                self.hooks.forward(h.module, uncompiled(self._post_hook(h)), name=h.name)
        self._attach_backward_norm()

    def _attach_backward_norm(self) -> None:
        """At a recorded step, the end of each backward (an autograd engine callback queued by
        the first parameter's post-accumulate hook, after the other callbacks of that
        backward): the gradients it left, and their norm where the step may need it as
        `grad_norm_preclip` (probe.train.grad_norms)."""

        def measure():
            self.norm_queued = False
            self.norms.backward_ended()

        def queue(fn):
            torch.autograd.Variable._execution_engine.queue_callback(fn)

        def hook(param):
            if self.recording and not self.norm_queued and not self.is_paused:
                self.norm_queued = True
                # queued again when it runs: after the callbacks queued in this backward
                # (DDP's, which puts the all-reduced gradients in place)
                queue(lambda: queue(measure))

        for name, p in self.model.named_parameters():
            if p.requires_grad:
                self.norm_hooks.post_accumulate_grad(p, hook, name=name)

    def detach(self) -> None:
        """Remove every hook (the step's gradient hooks too)."""
        try:
            self.grad_hooks.remove()
            self.norm_hooks.remove()
        finally:
            self.hooks.remove()

    def _active(self) -> bool:
        return not self.is_paused and torch.is_grad_enabled()

    @contextlib.contextmanager
    def paused(self):
        """The hooks do nothing inside (the probe batch's forwards are not the training's)."""
        self.is_paused = True
        try:
            yield
        finally:
            self.is_paused = False

    # Hooks are closures, not bound methods: copy.deepcopy(model) (an EMA copy) copies a
    # module's hooks, and a bound method would drag the watch and its open file along.
    def _opener_hook(self, root: bool):
        """Where a training forward begins: the root's forward, or, where the loop calls
        submodules (a LightningModule's training_step calling self.net, a loop calling
        model.model and model.lm_head), the first watched module (or module above one) called
        since the step began; the same module called again begins the next forward (the next
        micro-batch). Modules called while a forward is open belong to it."""

        def hook(module, args, kwargs):
            if not self._active():
                return
            if root or self.opener is None or module is self.opener:
                self.opener = module
                self.forward_begins(args, kwargs)

        return hook

    def _pre_hook(self, h: Hooked):
        def hook(module, args):
            if not (self.recording or h.edit_input) or not self._active():
                return None
            values = self.recording and h.record_input
            grads = (self.recording and h.record_grad_input) or h.edit_input
            call = self.in_calls[h.name]
            self.in_calls[h.name] += 1
            if not args:
                raise ModelError(
                    f"layer {h.name!r} was called with no positional input, so it has no "
                    "input or grad_input to watch; watch its output sites or exclude it"
                )
            new, changed = list(args), False
            for i, a in enumerate(args):
                if not isinstance(a, torch.Tensor):
                    continue
                path = "" if len(args) == 1 else f".{i}"
                if values:
                    self.observe(h, dataset_name("input", path, call), a, "activation")
                if grads and a.requires_grad:  # its own copy: this module's share of the gradient
                    new[i], changed = a.clone(), True  # (the clone's backward passes it on as is)
                    self._grad_site(h, new[i], dataset_name("grad_input", path, call), "grad_input")
            return tuple(new) if changed else None

        return hook

    def _post_hook(self, h: Hooked):
        def hook(module, args, output):
            if not (self.recording or h.edit_output) or not self._active():
                return None
            values = self.recording and h.record_output
            grads = (self.recording and h.record_grad_output) or h.edit_output
            call = self.out_calls[h.name]
            self.out_calls[h.name] += 1
            for path, x in flatten(output):
                if values:
                    self.observe(h, dataset_name("output", path, call), x, "activation")
                if grads and x.requires_grad:
                    self._grad_site(h, x, dataset_name("grad_output", path, call), "grad_output")
            return None

        return hook

    def _grad_site(self, h: Hooked, x: torch.Tensor, key: str, site: str) -> None:
        """A tensor hook on `x` (in-place safe: it sees the gradient of the value `x` had now):
        the site's edits, then its statistics at a recorded step."""
        edits = h.edits.get(site, ())
        record = self.recording and site in h.watched.sites if h.watched is not None else False
        start = self.rows_seen

        def hook(grad):
            for e in edits:
                grad = e.apply(grad, start, key)
            if record:
                self.grads_seen += 1
                self.observe(h, key, grad, "activation")
            return grad if edits else None

        self.grad_hooks.tensor(x, hook, name=f"{h.name} {key}")
        self.grads_expected += record

    # -- the step's entry points ---------------------------------------------------------------
    def begin(self, step: int) -> None:
        """Step `step` starts (0-based: optimizer steps completed before its forward)."""
        self.step = step
        self.recording = self.schedule.records(step)
        self.stats = StepStats(self.on_device, histograms=self.ranked)
        self.in_calls: Counter[str] = Counter()
        self.out_calls: Counter[str] = Counter()
        self.losses: list[float | torch.Tensor] = []  # a GPU's stay there until the step ends
        self.loss_summed = False  # the micro-batches' losses are partial sums (see add_loss)
        self.norm_queued = False
        self.norms.begin()
        self.scalars: dict[str, float | torch.Tensor] = {}  # a device's read at the step's end
        self.before: dict[int, torch.Tensor] = {}  # id(parameter) -> its value before the update
        self.params_taken = False
        self.grads_at_begin = self.grads_seen
        self.grads_expected = 0  # gradient values this step's forwards wait for
        self.opener = None

    def resume(self, step: int, rows_seen: int) -> None:
        """A training resumed at `step` whose forwards had seen `rows_seen` rows (a
        checkpoint's: the noise edits go on from that sample)."""
        self.begin(step)
        self.rows_seen = rows_seen

    def forward_begins(self, args=(), kwargs=None) -> None:
        """A training forward starts (call counts restart: `output@1` is the second call of a
        module in one forward); `args`, `kwargs`: the call that began it (its batch rows)."""
        self.forwards += 1
        self.in_calls.clear()
        self.out_calls.clear()
        if self.edited:
            tensors = [t for _, t in flatten((args, kwargs or {})) if t.dim() > 0]
            self.rows_seen += tensors[0].shape[0] if tensors else 1
        if self.params_at_forward:
            self.take_params()

    def take_params(self) -> None:
        """The parameters as the step's forward used them (`param.*`), and a copy of those whose
        update is recorded; once per step."""
        if not self.recording or self.params_taken:
            return
        self.params_taken = True
        with self._batched():
            for w in self.watched:
                h = self._hooked(w)
                for name, p in w.params.get("param", {}).items():
                    self._observe_param(h, f"param.{name}", local(p))
                for p in w.params.get("param_update", {}).values():
                    if id(p) not in self.before:
                        self.before[id(p)] = local(p).clone()

    def take_grads(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """The gradients as the optimizer sees them (after accumulation, clipping, and under
        DDP the all-reduce), the global grad norms over every gradient of the model (`grad_norm`
        now, `grad_norm_preclip` as probe.train.grad_norms says), and each param group's
        learning rate (with `optimizer`)."""
        if not self.recording:
            return
        with self._batched():
            for w in self.watched:
                h = self._hooked(w)
                for name, p in w.params.get("param_grad", {}).items():
                    if p.grad is not None:
                        self._observe_param(h, f"param_grad.{name}", local(p.grad))
        self.norms.take_step(self.step)
        self.take_lrs(optimizer)

    def take_lrs(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Each param group's learning rate (`lr.<group>`), as the optimizer step uses it."""
        if self.recording and optimizer is not None:
            for i, group in enumerate(optimizer.param_groups):
                self.scalars[f"lr.{i}"] = float(group["lr"])

    def take_preclip_norm(self) -> None:
        """The global grad norm now, as `grad_norm_preclip` (a trainer's hook that runs before
        it clips, after it unscales)."""
        if self.recording:
            self.norms.take_preclip()

    def take_clip_norm(self, norm) -> None:
        """The total norm a clip of this step's gradients returned (before the clip: a tensor or
        a number), as `grad_norm_preclip`."""
        if self.recording and not self.is_paused:
            self.norms.hand_over(norm, self.step)

    def take_updates(self) -> None:
        """What the optimizer step changed (`param_update.*`): the weights after minus before."""
        if not self.recording:
            return
        updates: dict[int, torch.Tensor] = {}  # (a tied parameter's, once)
        with self._batched():
            for w in self.watched:
                h = self._hooked(w)
                for name, p in w.params.get("param_update", {}).items():
                    before = self.before.get(id(p))
                    if before is None:
                        continue
                    update = updates.get(id(p))
                    if update is None:  # (the difference into the copy: no new tensor)
                        update = updates[id(p)] = torch.sub(local(p), before, out=before)
                    self._observe_param(h, f"param_update.{name}", update)
        self.before.clear()

    def add_loss(self, loss, summed: bool = False) -> None:
        """A micro-batch's loss (a tensor or a number). The step's loss is their mean, or their
        sum where the micro-batches' losses are partial sums (`summed`: transformers' Trainer
        divides each micro-batch's summed loss by the whole step's item count)."""
        if self.recording and loss is not None:
            self.loss_summed = self.loss_summed or summed
            if not isinstance(loss, torch.Tensor):
                self.losses.append(float(loss))
            elif loss.is_cpu and not self.on_device:
                self.losses.append(float(loss.detach()))
            else:  # (read with the step's one copy, not now)
                self.losses.append(loss.detach().reshape(()))

    def end_step(self, **scalars: float | torch.Tensor | None) -> None:
        """The step ends: at a recorded step its statistics (and `scalars`, e.g. grad_scale) go
        on their way to the sink (the device's by one copy: probe.train.step_stats); each staged
        step whose copy is done is written, in order; then the next step begins."""
        if not self.forwards and self.needs_forwards:
            self._check_hooks_ran()
        if self.recording:
            self._check_backward()
            device = {f"loss.{i}": t for i, t in enumerate(self.losses)
                      if isinstance(t, torch.Tensor)}  # fmt: skip
            values: dict[str, float | None] = {}  # in order; None: a device's, read with the copy
            for name, v in [*self.scalars.items(), *self.norms.values.items(), *scalars.items()]:
                if isinstance(v, torch.Tensor):
                    device[name], values[name] = v, None
                elif v is not None:
                    values[name] = float(v)
            losses = [None if isinstance(t, torch.Tensor) else t for t in self.losses]
            staged = _Staged(self.step, self.stats.settle(device), dict(self.infos), values,
                             losses, self.loss_summed,
                             frozenset(self.norms.whole))  # fmt: skip
            self.staged.append(staged)
        self.write_staged(wait=self.ranked)
        self.grad_hooks.remove()
        self.begin(self.step + 1)

    def write_staged(self, wait: bool = True) -> None:
        """The staged steps to the sink, in order: those whose copy is done (`wait`: every one,
        waiting for the copies: the watch closes, or a distributed training's collective)."""
        while self.staged and (wait or self.staged[0].settled.ready()):
            staged = self.staged.popleft()
            stats, device = staged.settled.result(partial(self._check_finite, step=staged.step))
            losses = [device[f"loss.{i}"] if v is None else v for i, v in enumerate(staged.losses)]
            values = {k: device[k] if v is None else v for k, v in staged.values.items()}
            if staged.summed:
                losses = [float(np.sum(losses))]
            infos = {key: staged.infos[key] for key in stats}
            record = self.merge_ranks(
                StepRecord(staged.step, stats, infos, values, losses, staged.whole)
            )
            if record is not None:
                rows = {key: (record.infos[key], step_row(s)) for key, s in record.stats.items()}
                if record.losses:
                    record.scalars["loss"] = float(np.mean(record.losses))
                self.sink(record.step, rows, record.scalars)

    # -- statistics ----------------------------------------------------------------------------
    def _observe_param(self, h: Hooked, site: str, p: torch.Tensor) -> None:
        """A parameter (or its gradient or update) as one row; an empty shard has nothing.
        Inside `_batched`, held to be reduced with the others at its end."""
        if not p.numel() and self.sharded:
            return
        x = p.detach().unsqueeze(0)
        if self.param_batch is None:
            self.observe(h, site, x, "parameter")
            return
        key = (h.name, site)
        self.param_batch.append((key, x, *self._layout(h, site, x, "parameter")))

    @contextlib.contextmanager
    def _batched(self):
        """The parameter sites observed inside are reduced together at its end (on the device
        path: one reduction per device and dtype, probe.stats.batched)."""
        self.param_batch = []
        try:
            yield
        finally:
            items, self.param_batch = self.param_batch, None
        self.stats.add_many(items)

    def observe(self, h: Hooked, site: str, x: torch.Tensor, kind: str) -> None:
        """Fold one value of (h's layer, site) into the step's statistics."""
        key = (h.name, site)
        batch = self.stats.add(key, x, *self._layout(h, site, x, kind))
        if batch is not None and (batch.nan_count or batch.inf_count):
            self._check_finite(key, batch)

    def _layout(self, h: Hooked, site: str, x: torch.Tensor, kind: str) -> tuple:
        """(saturation bounds, unit axis) of (h's layer, site), its SiteInfo noted at its first
        value."""
        key = (h.name, site)
        layout = self.layouts.get(key)
        if layout is None:
            self.infos[key] = SiteInfo(
                h.name, site, h.module_type, tuple(x.shape), str(x.dtype).removeprefix("torch."),
                kind,
            )  # fmt: skip
            if kind == "activation":
                self._name_taken(h.name, site)
            if kind == "parameter":
                axis = 1 if x.dim() >= 2 else 0  # a parameter's first axis (its output units)
            else:
                w = h.watched
                setting, classes = (w.unit_axis, w.class_axis) if w is not None else ("auto", None)
                where = f"probe {w.probe if w is not None else None!r} layer {h.name!r} {site}"
                axis = unit_axis(setting, classes, x.dim(), where)
            layout = self.layouts[key] = (bounds_for(h.module_type, site), axis)
        return layout

    def _name_taken(self, layer: str, site: str) -> None:
        """Note the name a value site is recorded under; one other than the asked site's own
        (`output.0` of a tuple output, `output@1` of a second call) is said once in the log
        (a name a resumed file holds was said when the file first recorded it)."""
        asked = SiteKey.parse(site).family
        names = self.names_of.setdefault((layer, asked), [])
        if site in names:
            return
        names.append(site)
        if names != [asked]:
            self.unsaid.add((layer, asked))

    def said_before(self, sites: Iterable[tuple[str, str]]) -> None:
        """The (layer, site) pairs a resumed file holds: their names are not said again."""
        for layer, site in sites:
            key = parse_or_none(site)
            if key is not None and key.family in VALUE_AND_GRAD_SITES:
                names = self.names_of.setdefault((layer, key.family), [])
                if site not in names:
                    names.append(site)

    def renamed(self) -> dict[tuple[str, str], list[str]]:
        """Each asked site recorded under other names and not said yet: {(layer, asked site):
        the names it became} (`output` -> `output.0`, `output.1`); the log says them once."""
        found = {key: list(self.names_of[key]) for key in self.unsaid}
        self.unsaid.clear()
        return found

    def _check_finite(self, key: Key, batch: RunningStats, step: int | None = None) -> None:
        """Log the first non-finite values of each site (with fail_on_nonfinite: the first of
        the training stops it, after the file is flushed); `step`: the step that held them,
        where its copy landed later (default: the current one)."""
        if not (batch.nan_count or batch.inf_count) or key in self.reported:
            return
        first = not self.reported
        self.reported.add(key)
        message = (
            f"step {self.step if step is None else step}: layer {key[0]!r} {key[1]} has {batch.nan_count} NaN and "
            f"{batch.inf_count} Inf values (the first of this site"
            f"{', and of the training' if first else ''})"
        )
        log.warning("%s", message)
        if self.fail_on_nonfinite and first:
            if self.failing is not None:
                self.failing(message)
            raise ModelError(
                f"{message}; fail_on_nonfinite=True stops the training here (the steps before "
                "it are written); set fail_on_nonfinite=False to count them and go on"
            )

    def _check_backward(self) -> None:
        """A recorded step whose forwards wait for gradients that no backward brought is a
        training without loss.backward(); a gradient site that gets none is said once."""
        got_any = self.grads_seen > self.grads_at_begin
        if self.grads_expected and not got_any:
            wanted = [
                f"{w.name} {s}" for w in self.watched for s in VALUE_GRAD_SITES if s in w.sites
            ]
            raise ConfigError(
                f"step {self.step}: no gradient reached the gradient sites ({', '.join(wanted[:4])}"
                f"{', ...' if len(wanted) > 4 else ''}): the step ended without a backward "
                "through the model. Call loss.backward() before the optimizer step, or drop "
                "grad_output/grad_input from the probes"
            )
        if not got_any:
            return
        keys = [*self.stats.stats, *self.stats.packs]
        got = {(layer, SiteKey.parse(site).family) for layer, site in keys}
        for w in self.watched:
            for site in VALUE_GRAD_SITES:
                if site in w.sites and (w.name, site) not in got | self.missing:
                    self.missing.add((w.name, site))
                    log.warning(
                        "step %d: layer %r %s got no gradient (its %s needs none, or the loss "
                        "does not depend on it)",
                        self.step, w.name, site, site.removeprefix("grad_"),
                    )  # fmt: skip

    def _check_hooks_ran(self) -> None:
        """A step that ends with gradients but without one forward through the hooks trained
        modules the watch never saw run: a model compiled before the watch was made (its
        compiled code runs without hooks added later), or a loop whose forwards bypass every
        watched module. Compiled code is named only where this process compiled some."""
        if not any(p.grad is not None for p in self.model.parameters()):
            return
        watched = ", ".join(h.name for h in self.hooked[:3]) + (
            ", ..." if len(self.hooked) > 3 else ""
        )
        if compiled_any():
            raise ConfigError(
                f"step {self.step} ended with gradients, but no forward of "
                f"{type(self.model).__name__} passed through the watch's hooks: a model "
                f"compiled before the watch was made runs without them. {COMPILED_WAY_OUT}"
            )
        raise ConfigError(
            f"step {self.step} ended with gradients of {type(self.model).__name__}, but none of "
            f"the watched modules ({watched}) ran a forward with gradients enabled in it: the "
            "loop trains modules the probes do not select. Select the modules the loop calls, "
            "or watch the model it trains"
        )

    def check_close(self) -> None:
        """At the end of the watch: gradient sites asked for in a training that never ran a
        backward are an error (said here when no step ended to say it)."""
        wanted = any(s in w.sites for w in self.watched for s in VALUE_GRAD_SITES)
        if wanted and self.forwards and not self.grads_seen:
            raise ConfigError(
                "the probes watch gradient sites (grad_output, grad_input), but no gradient "
                "reached them in the whole training: the model's forwards never went backward. "
                "Call loss.backward() in the loop, or drop those sites from the probes"
            )

    def _hooked(self, w: WatchedModule) -> Hooked:
        return self.by_name[w.name]


COMPILED_WAY_OUT = (
    "torch.compile's code skips module hooks (those added after it compiled, and after a "
    "graph break those of the next modules), so a watch would miss values: watch and train the "
    "model uncompiled (the module you gave torch.compile, e.g. compiled._orig_mod: the same "
    "parameters), and compile the trainings you do not watch"
)


def uncompiled(hook):
    """`hook`, refusing to run in a model torch.compile traced: traced, the outer function
    notes it (dynamo replays the note as the graph runs), then the graph breaks at the inner
    one, which runs as plain Python and raises a ConfigError."""
    traced: list[bool] = []

    def refuse(*args):
        if traced:
            raise ConfigError(
                f"the watched model runs compiled (torch.compile). {COMPILED_WAY_OUT}"
            )
        return hook(*args)

    inner = torch.compiler.disable(refuse)

    def outer(*args):
        if torch.compiler.is_compiling():
            traced.append(True)
        return inner(*args)

    return outer


def compiled_any() -> bool:
    """Whether torch.compile has compiled a graph in this process (dynamo's own counter)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # (a build without dynamo)
        return False
    return bool(counters["stats"].get("unique_graphs"))


def is_dtensor(t) -> bool:
    """Whether `t` is a DTensor (FSDP2's sharded parameters and gradients)."""
    return callable(getattr(t, "to_local", None))


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's piece of a parameter or gradient (a DTensor's local shard), detached."""
    return (cast(Any, t).to_local() if is_dtensor(t) else t).detach()
