"""What both trainers' callbacks share: the watch's options checked when the callback is made,
the watch made when the training starts (on the trainer's model and optimizer, resumed at the
trainer's step), and the chosen statistics of a recorded step as scalars for the trainer's
loggers."""

from __future__ import annotations

import inspect
from collections.abc import Iterable

from probe.errors import ConfigError
from probe.store.steps_file import STAT_COLUMNS
from probe.train.schedule import Schedule
from probe.train.watched_run import STATE_VERSION, Watch

# what the callbacks set themselves
OWN = {"model", "probes", "out", "every", "optimizer", "hook_optimizer", "scaler"}
OPTIONS = sorted(set(inspect.signature(Watch.__init__).parameters) - OWN - {"self"})


class Driven:
    """The settings of a callback-driven watch, and the watch once the training starts."""

    def __init__(self, probes, out, every, log_stats: Iterable[str], options: dict):
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise ConfigError(
                f"ProbeCallback got {', '.join(unknown)}; it takes probes, out, every, "
                f"log_stats and probe.watch's {', '.join(OPTIONS)}"
            )
        Schedule(every)  # (a bad `every` is said now, not when the training starts)
        if isinstance(log_stats, str):
            log_stats = [log_stats]
        self.log_stats = list(log_stats or ())
        bad = [s for s in self.log_stats if s not in STAT_COLUMNS]
        if bad:
            raise ConfigError(
                f"log_stats names {', '.join(map(repr, bad))}; choose from {', '.join(STAT_COLUMNS)}"
            )
        self.probes, self.out, self.every, self.options = probes, out, every, dict(options)
        self.watch: Watch | None = None
        self.restored: dict = {}  # a trainer checkpoint's state of the watch (its state_dict)

    def start(self, model, optimizer, step: int, scaler=None) -> Watch:
        """Make and start the watch on the trainer's model; a training resumed at `step` > 0
        (optimizer steps completed) appends to the file in `out` from that step."""
        if self.watch is not None and not self.watch.closed:
            self.watch.close(complete=False, raising=False)  # (a train() that raised)
        w = Watch(model, self.probes, out=self.out, every=self.every, optimizer=optimizer,
                  hook_optimizer=False, scaler=scaler, **self.options)  # fmt: skip
        if step > 0:
            state = self.restored if self.restored.get("step") == step else {}
            w.load_state_dict({"version": STATE_VERSION, **state, "step": int(step)})
        self.watch = w.start()
        return w

    def close(self, complete: bool = True) -> None:
        if self.watch is not None and not self.watch.closed:
            self.watch.close(complete=complete, raising=complete)

    def metrics(self, rows: dict) -> dict[str, float]:
        """`probe/<layer>/<site>/<statistic>` of the chosen statistics of a recorded step."""
        columns = [(s, STAT_COLUMNS.index(s)) for s in self.log_stats]
        return {f"probe/{layer}/{site}/{name}": float(row[i])
                for (layer, site), (_, row) in rows.items()
                for name, i in columns}  # fmt: skip
