"""`probe.watch(model, probes, out=DIR, ...)`: per-step statistics of the user's own training.

    with probe.watch(model, "all_convs", out="runs/w", optimizer=opt, every=10) as w:
        for x, y in loader:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            w.loss(loss)            # optional: the step's loss in the file
            w.clipped(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))  # if it clips
            opt.step()              # the optimizer's step hooks count the steps

No extra forward or backward: the hooks watch the user's own (probe.train.step_hooks). Without
`optimizer=`, the loop calls `w.step(loss=loss)` after each optimizer step (before zero_grad).
The run directory holds probe.h5 with the per-step statistics (probe.store.steps_file),
train.csv, probe.log, watch.yaml and, with a `probe_batch`, its evaluations
(probe.train.probe_batch). `w.state_dict()` goes into the user's checkpoint; a training resumed
with `w.load_state_dict(...)` (before the watch starts) appends to the same file from its step.
docs/training.md is the guide.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
import yaml
from torch import nn

from probe.config import GRAD_EDIT_SITES
from probe.errors import ConfigError, ProbeError
from probe.intervene.edits import build_edits
from probe.plan import checked_edits, probe_specs, spec_config
from probe.store import runlock
from probe.store.runfile import file_state
from probe.store.steps_file import SCALAR_COLUMNS, StepFile
from probe.train import ranks
from probe.train.log_lines import renamed_lines, steps_text
from probe.train.probe_batch import FOLDER, ProbeBatch
from probe.train.schedule import Schedule
from probe.train.step_hooks import COMPILED_WAY_OUT, Watcher
from probe.train.watched_sites import resolve
from probe.watch_options import WatchOptions

log = logging.getLogger("probe")
STATE_VERSION = 1
FILENAME = "probe.h5"


def watch(
    model: nn.Module,
    probes,
    *,
    out: str | Path,
    every: int | str = 1,
    optimizer: torch.optim.Optimizer | None = None,
    scaler=None,
    probe_batch=None,
    probe_every: int | str | None = None,
    probe_stats: Mapping | None = None,
    edits: Mapping | None = None,
    flush_every: int = 10,
    fail_on_nonfinite: bool = False,
    seed: int = 0,
    overwrite: bool = False,
    hook_optimizer: bool = True,
) -> Watch:
    """Watch the training of `model` into the run directory `out` (see the module's text).

    `probes`: a mapping name -> probe spec, or a shipped probe file's name; their `capture`
    takes output, input, grad_output, grad_input, param, param_grad, param_update (those three
    with an optional glob: param_grad.weight). `every`: an int >= 1 or "log" (steps 0, 1, 2, 4,
    ...). `optimizer`: counts the steps with its step hooks. `scaler`: AMP's GradScaler, whose
    scale the file records. `probe_batch` (a tensor, an (inputs, targets) pair or a dict of
    keyword arguments) is evaluated every `probe_every` steps (default: `every`), its run's
    statistics options in `probe_stats` (e.g. {"topk": 8}). `edits`: name -> edit spec on
    grad_output/grad_input sites (op zero, scale, clamp, noise, ...: the intervene group's
    keys), applied at every step. `flush_every`: recorded steps between flushes of the file.
    `fail_on_nonfinite`: the first NaN or Inf stops the training (a ModelError). `seed`: the
    noise edits' seed. `overwrite`: replace a watched run already in `out`.
    `hook_optimizer=False`: the optimizer's learning rates are recorded but its steps are not
    hooked; whatever drives the training calls `before_update()` right before each optimizer
    step and `after_update()` right after it (a trainer's callbacks).

    In a process group (DDP, FSDP2 under torchrun) every rank makes the same watch; rank 0
    writes the one run directory (probe.train.ranks)."""
    options = WatchOptions(
        out=out, every=every, optimizer=optimizer, scaler=scaler, probe_batch=probe_batch,
        probe_every=probe_every, probe_stats=probe_stats, edits=edits, flush_every=flush_every,
        fail_on_nonfinite=fail_on_nonfinite, seed=seed, overwrite=overwrite,
        hook_optimizer=hook_optimizer,
    )  # fmt: skip
    return Watch(model, probes, options)


class Watch:
    """A watched training: `start()`/`close()` or a `with` block. `options` has passed its own
    checks; those that need the model run here, before the training runs; the hooks exist from
    `start()` to `close()`. `on_record(step, rows, scalars)`, where given, runs after each
    recorded step is written (a trainer's callback sends statistics to its loggers).

    Entry points for what drives the steps: `before_update(optimizer)` and `after_update()` (the
    optimizer's step hooks call them; a trainer's callbacks can), or `step(loss=...)` in a plain
    loop without `optimizer=`."""

    def __init__(self, model: nn.Module, probes, options: WatchOptions, on_record=None):
        if not isinstance(model, nn.Module):
            raise ConfigError(f"probe.watch takes an nn.Module, not a {type(model).__name__}")
        model = trained_module(model)
        self.options = o = options
        if o.optimizer is not None:
            _check_optimizer_trains(o.optimizer, model)
        self.rank, self.world = ranks.rank_and_world()
        self.writes = self.rank == 0  # (rank 0 alone writes the run directory)
        self.model, self.out = model, Path(o.out)
        self.optimizer, self.scaler, self.flush_every = o.optimizer, o.scaler, o.flush_every
        self.hook_optimizer = o.optimizer_hooked
        self.overwrite = bool(o.overwrite)
        self.specs = probe_specs(probes, run_sites=False)
        ranks.check_model(model, self.specs)
        watched = resolve(model, self.specs)
        self.edits = _grad_edits(model, o.edits, o.seed)
        merge = ranks.RankMerge(model, self.rank, self.world) if self.world > 1 else None
        self.watcher = Watcher(model, watched, self.edits, o, self._record,
                               failing=self._failing, merge_ranks=merge)  # fmt: skip
        if o.scaler is not None:
            self.watcher.norms.grad_scale = lambda: scale_of(o.scaler)
        self.schedule = self.watcher.schedule
        groups = len(o.optimizer.param_groups) if o.optimizer is not None else 0
        self.scalar_columns = (*SCALAR_COLUMNS, *(f"lr.{i}" for i in range(groups)))
        self.probe_batch = None
        if o.probe_batch is not None:
            ranks.check_probe_batch(model, self.world)
            every = o.every if o.probe_every is None else o.probe_every
            self.probe_batch = ProbeBatch(model, self.specs, o.probe_batch, self.out / FOLDER,
                                          Schedule(every, "probe_every"), o.probe_stats)  # fmt: skip
        self.settings = {
            "probes": {n: spec_config(s) for n, s in self.specs.items()},
            "every": o.every,
            "edits": [e.describe for e in self.edits if e.describe],
            "probe_every": None if self.probe_batch is None else self.probe_batch.schedule.every,
        }
        self.config = {
            **self.settings,
            "model": type(model).__name__,
            "optimizer": None if o.optimizer is None else type(o.optimizer).__name__,
            "param_groups": groups,
            "scaler": o.scaler is not None,
            "flush_every": o.flush_every,
            "fail_on_nonfinite": bool(o.fail_on_nonfinite),
            "seed": o.seed,
            "world_size": self.world,
            "modules": {w.name: sorted(w.sites) + sorted(
                f"{k}.{n}" for k, ps in w.params.items() for n in ps) for w in watched},
        }  # fmt: skip
        self.file: StepFile | None = None
        self.resume_at: int | None = None
        self.started = self.closed = self.locked = False
        self.log_handler: logging.Handler | None = None
        self.on_record = on_record

    # -- life --------------------------------------------------------------------------------
    def __enter__(self) -> Watch:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(complete=exc_type is None, raising=exc_type is None)

    def start(self) -> Watch:
        """Lock the run directory, open (or resume) probe.h5, hook the model and the optimizer,
        evaluate the probe batch if its schedule takes this step. In a process group rank 0
        does the directory's part, and every rank learns whether it could."""
        if self.started:
            raise ProbeError("this watch has started already; a Watch runs once")
        ranks.check_params_current(self.model, self.watcher.watched)
        failure = None
        try:
            if self.writes:
                runlock.acquire(self.out)  # (RunDirBusy while another run writes there)
                self.locked = True
            self.started = True
            if self.writes:
                self._open_directory()
        except BaseException as e:
            failure = e
        if self.world > 1:
            failure = ranks.agree(failure, self.rank, self.world)
        try:
            if failure is not None:
                raise failure
            self.watcher.attach()
            if self.hook_optimizer and self.optimizer is not None:
                before, after = self._step_hooks()
                self.watcher.hooks.optimizer_step_pre(self.optimizer, before)
                self.watcher.hooks.optimizer_step_post(self.optimizer, after)
        except BaseException:
            if self.started:
                self._release(complete=False)
            raise
        step = self.watcher.step
        self._note(
            f"watching {len(self.watcher.watched)} modules of {type(self.model).__name__} from "
            f"step {step}, every {self.schedule.every}"
            + (
                f"; gradient edits active: {json.dumps(self.settings['edits'])}"
                if self.edits
                else ""
            )
        )
        return self

    def _open_directory(self) -> None:
        self._open_log()
        self._open_file()
        step = self.watcher.step
        if self.probe_batch is not None:
            self.probe_batch.check_fits()
            self.probe_batch.forget_from(step)
            self._evaluate(step)

    def close(self, complete: bool = True, raising: bool = True) -> None:
        """Flush, write `complete`, remove every hook, release the directory. A training whose
        gradient sites never got a gradient is said here (a ConfigError, after closing)."""
        if self.closed or not self.started:
            self.closed = True
            return
        error = None
        if raising:
            try:
                self.watcher.check_close()
            except ConfigError as e:
                error = e
        self._release(complete=complete and error is None)
        if error is not None:
            raise error

    def _release(self, complete: bool) -> None:
        self.closed = True
        try:
            try:  # the recorded steps whose statistics are still on their way
                self.watcher.write_staged()
            except Exception:  # noqa: BLE001 - a training that failed keeps its own error
                if complete:
                    raise
                log.warning("the last recorded steps could not be written", exc_info=True)
            finally:
                self.watcher.detach()
        finally:
            try:
                if self.file is not None:
                    steps = self.watcher.step
                    self.file.close(complete, steps)
                    self._note(
                        f"closed {self.file.path} ({'complete' if complete else 'not complete'}"
                        f", {steps} steps, {self.file.written} recorded, the last "
                        f"{self.file.last_step})"
                    )
            finally:
                if self.log_handler is not None:
                    log.removeHandler(self.log_handler)
                    self.log_handler.close()
                if self.locked:
                    runlock.release(self.out)

    def _open_log(self) -> None:
        """probe.log is the log of the training probe.h5 holds: continued on a resume, begun
        anew when overwrite=True replaces the file (a refused directory's log is kept)."""
        replaces = self.overwrite and self.resume_at is None
        mode = "w" if replaces and (self.out / FILENAME).exists() else "a"
        self.log_handler = logging.FileHandler(self.out / "probe.log", mode=mode)
        self.log_handler.setFormatter(logging.Formatter("[%(asctime)s][%(levelname)s] %(message)s"))
        log.addHandler(self.log_handler)

    def _note(self, message: str) -> None:
        """An INFO line in probe.log (and wherever the user's logging sends probe's)."""
        if log.isEnabledFor(logging.INFO):
            log.info("%s", message)
        elif self.log_handler is not None:
            self.log_handler.handle(
                log.makeRecord(log.name, logging.INFO, "", 0, message, (), None)
            )

    def _open_file(self) -> None:
        path = self.out / FILENAME
        if path.exists() and self.resume_at is None and not self.overwrite:
            raise ConfigError(
                f"out={str(self.out)!r} already holds a run ({file_state(path)}); resume its "
                "training with w.load_state_dict(checkpoint's w.state_dict()) before the watch "
                "starts, pass overwrite=True to replace it, or give a new directory"
            )
        attrs = {
            "config": yaml.safe_dump(self.config, sort_keys=False),
            "watch": json.dumps(self.settings, sort_keys=True),
            "edits": json.dumps(self.settings["edits"]),
        }
        self.file = StepFile(path, attrs, self.scalar_columns, self.resume_at)
        if self.resume_at is not None:
            self._resumed(self.resume_at)

    def _resumed(self, step: int) -> None:
        """Begin at the checkpoint's step, and say in the log what the file kept and cut."""
        self.watcher.begin(step)
        kept = self.file.resumed if self.file is not None else None
        if self.file is None or kept is None:
            self._note(f"resuming the training at step {step} into a new {FILENAME}")
            return
        self.watcher.said_before(self.file.sites)  # (their names are in the log already)
        lost = sorted(set(self.schedule.steps_before(step)) - set(kept.steps))
        if lost:
            log.warning(
                "resuming at step %d: the file lacks the recorded steps %s (taken after its last "
                "flush before the training stopped; they cannot be recorded again)",
                step, steps_text(lost),
            )  # fmt: skip
        said = [f"kept {_count(kept.steps, 'recorded step')}"]
        if kept.cut:
            said.append(f"cut {_count(kept.cut, 'step')}, recorded after the checkpoint was taken")
        if kept.unflushed:
            said.append(
                f"cut {kept.unflushed} row{'s' * (kept.unflushed > 1)} past /progress, left by "
                "a flush the stop interrupted"
            )
        if len(said) == 1:
            said.append("cut none")
        self._note(f"resuming the training at step {step}: {'; '.join(said)}")

    # -- steps -------------------------------------------------------------------------------
    def _step_hooks(self):
        """The optimizer's step hooks (closures: see Watcher's hooks)."""

        def before(optimizer, args, kwargs):
            self.before_update(optimizer)

        def after(optimizer, args, kwargs):
            self.after_update()

        return before, after

    def before_update(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Right before the optimizer step: the parameters, their gradients, the global grad
        norm and the learning rates."""
        self.watcher.take_params()
        self.watcher.take_grads(optimizer if optimizer is not None else self.optimizer)

    def after_update(self, loss=None) -> None:
        """Right after the optimizer step: the updates; the step ends."""
        self.watcher.add_loss(loss)
        self.watcher.take_updates()
        self._end_step()

    def step(self, loss=None) -> None:
        """End a training step in a loop without `optimizer=`: call it after optimizer.step()
        and before zero_grad (it reads the gradients). `loss` (a tensor or a number) goes into
        the file."""
        self._check_open("w.step()")
        if self.hook_optimizer:
            raise ProbeError(
                "w.step() ends a step of a watch without optimizer=; this one counts the steps "
                "with the optimizer's step hooks. Give the loss with w.loss(loss) instead"
            )
        if self.optimizer is not None:
            raise ProbeError(
                "w.step() ends a step of a watch without optimizer=; with hook_optimizer=False "
                "call w.before_update() right before optimizer.step() and w.after_update() "
                "right after it"
            )
        self.watcher.add_loss(loss)
        self.watcher.take_grads(None)
        self.watcher.take_updates()
        self._end_step()

    def clipped(self, norm) -> None:
        """The loop clipped the current step's gradients: `norm` (a tensor or a number) is the
        total norm `torch.nn.utils.clip_grad_norm_` returned, the norm before the clip (after
        any `scaler.unscale_`), and the step's `grad_norm_preclip`. Handed over, it spares the
        watch a measurement of the gradients at the end of each backward (see
        docs/training.md, Steps)."""
        self.watcher.take_clip_norm(norm)

    def loss(self, loss, summed: bool = False) -> None:
        """The loss of the current step: of each micro-batch, the step's is their mean, or their
        sum with `summed=True` (micro-batch losses that are partial sums of the step's)."""
        self.watcher.add_loss(loss, summed)

    @property
    def step_count(self) -> int:
        """Optimizer steps completed: the step the next forward belongs to."""
        return self.watcher.step

    def _end_step(self) -> None:
        recorded = self.watcher.recording
        scale = scale_of(self.scaler) if recorded and self.scaler is not None else None
        self.watcher.end_step(grad_scale=scale)
        if recorded and self.file is not None and self.file.unflushed >= self.flush_every:
            self.file.flush()
        if self.probe_batch is not None and self.writes:
            self._evaluate(self.watcher.step)

    def _evaluate(self, step: int) -> None:
        if self.probe_batch is None:
            return
        with self.watcher.paused():
            self.probe_batch.evaluate(step)

    def _record(self, step: int, rows: dict, scalars: dict) -> None:
        if self.file is None:  # (rank 0 alone writes, and only it records)
            return
        values = np.array([scalars.get(c, math.nan) for c in self.file.scalar_columns])
        self.file.append(step, rows, values)
        if self.on_record is not None:
            self.on_record(step, rows, scalars)
        said = ", ".join(f"{k} {scalars[k]:.6g}" for k in ("loss", "grad_norm") if k in scalars)
        self._note(f"step {step}: {len(rows)} sites recorded{'; ' + said if said else ''}")
        for line in renamed_lines(self.watcher.renamed()):
            self._note(f"recorded under the names a run gives them (docs/format.md#names): {line}")

    def _failing(self, message: str) -> None:
        if self.file is not None:
            self.file.flush()

    def _check_open(self, what: str) -> None:
        if not self.started or self.closed:
            raise ProbeError(f"{what} outside the watch: call it between start() and close()")

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What the user's checkpoint keeps of the watch: the step and the edits' sample count.
        The file is flushed first, so it holds every step the checkpoint has seen (a step whose
        device copy is still under way is waited for and written)."""
        if self.file is not None and not self.closed:
            self.watcher.write_staged(wait=True)
            self.file.flush()
        return {"version": STATE_VERSION, "step": self.watcher.step,
                "rows_seen": self.watcher.rows_seen}  # fmt: skip

    def load_state_dict(self, state: Mapping) -> None:
        """Resume from a checkpoint's `state_dict()`: before `start()`. The watch then appends
        to the file in `out` from the checkpoint's step (later rows are cut)."""
        if self.started:
            raise ProbeError(
                "w.load_state_dict() comes before the watch starts (before `with w:` or "
                "w.start()): the file is opened at the checkpoint's step"
            )
        if (
            not isinstance(state, Mapping)
            or not isinstance(state.get("step"), int)
            or state["step"] < 0
        ):
            raise ConfigError(f"w.load_state_dict got {state!r}; give what w.state_dict() returned")
        self.resume_at = int(state["step"])
        self.watcher.resume(self.resume_at, rows_seen=int(state.get("rows_seen", 0)))


def trained_module(model: nn.Module) -> nn.Module:
    """The module a DistributedDataParallel wrapper trains (its names are the model's own); a
    torch.compile'd model is refused (its compiled code skips hooks)."""
    from torch.nn.parallel import DistributedDataParallel

    while isinstance(model, DistributedDataParallel):
        model = model.module
    if type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
        raise ConfigError(f"probe.watch got a torch.compile'd model. {COMPILED_WAY_OUT}")
    return model


def _grad_edits(model: nn.Module, edits: Mapping | None, seed: int) -> list:
    """The declared edits (a mapping: WatchOptions checked it), each on a gradient site,
    resolved onto the modules they select."""
    if not edits:
        return []
    specs = checked_edits(dict(edits))
    for name, spec in specs.items():
        if spec.site not in GRAD_EDIT_SITES:
            raise ConfigError(
                f"edit {name!r}: site {spec.site!r}; a watched training edits gradients only "
                f"({', '.join(GRAD_EDIT_SITES)}), in the user's own backward"
            )
    return build_edits(model, specs, seed)


def _count(steps: list[int], what: str) -> str:
    """`3 recorded steps (0-2)`, `step 6`, `steps 6-7`, `0 recorded steps`."""
    if what == "step":
        return f"step{'s' * (len(steps) > 1)} {steps_text(steps)}"
    plural = f"{len(steps)} {what}{'s' * (len(steps) != 1)}"
    return f"{plural} ({steps_text(steps)})" if steps else plural


def _check_optimizer_trains(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """An optimizer that steps none of the watched model's parameters would have its steps
    counted and every update read 0: refused. One shared parameter is enough (a frozen part of
    the model, or a second model beside it, may be left out)."""
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    own = {id(p) for p in model.parameters()}
    if stepped and not any(id(p) in own for p in stepped):
        raise ConfigError(
            f"optimizer= steps none of the watched {type(model).__name__}'s "
            f"{len(own)} parameters: its {len(stepped)} parameters belong to another model. "
            "Give the optimizer that trains the model you watch (or watch the model it trains)"
        )


def scale_of(scaler) -> float | torch.Tensor:
    """A GradScaler's scale now, without reading a device's value into Python: its scale tensor
    where it has one (read with the step's statistics), else `get_scale()`'s number."""
    get = getattr(scaler, "_get_scale_async", None)  # (torch's own, what get_scale reads)
    scale = get() if get is not None and scaler.is_enabled() else None
    if isinstance(scale, torch.Tensor):
        return scale.detach().reshape(()).double()
    return float(scaler.get_scale())
