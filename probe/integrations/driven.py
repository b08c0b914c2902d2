"""What both trainers' callbacks share: the watch's options checked when the callback is made,
the watch made when the training starts (on the trainer's model and optimizer, resumed at the
trainer's step), and the chosen statistics of a recorded step as scalars for the trainer's
loggers."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from probe.errors import ConfigError
from probe.store.steps_file import STAT_COLUMNS
from probe.train.watched_run import STATE_VERSION, Watch
from probe.watch_options import WatchOptions, user_options

# the options a callback takes beside probes, out, every and log_stats (the others are the
# trainer's: its optimizer, its grad scaler, its own step hooks)
OPTIONS = sorted(set(user_options()) - {"out", "every"})


class Driven:
    """The settings of a callback-driven watch, and the watch once the training starts."""

    def __init__(self, probes, out, every, log_stats: Iterable[str], options: dict):
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise ConfigError(
                f"ProbeCallback got {', '.join(unknown)}; it takes probes, out, every, "
                f"log_stats and probe.watch's {', '.join(OPTIONS)}"
            )
        # (bad options are said now, not when the training starts)
        self.options = WatchOptions(out=out, every=every, **options)
        if isinstance(log_stats, str):
            log_stats = [log_stats]
        self.log_stats = list(log_stats or ())
        bad = [s for s in self.log_stats if s not in STAT_COLUMNS]
        if bad:
            raise ConfigError(
                f"log_stats names {', '.join(map(repr, bad))}; choose from {', '.join(STAT_COLUMNS)}"
            )
        self.probes = probes
        self.watch: Watch | None = None
        self.restored: dict = {}  # a trainer checkpoint's state of the watch (its state_dict)

    def start(self, model, optimizer, step: int, scaler=None,
              on_record: Callable[[int, dict, dict], None] | None = None) -> Watch:  # fmt: skip
        """Make and start the watch on the trainer's model, its optimizer and grad scaler (the
        callbacks end the steps: hook_optimizer=False); a training resumed at `step` > 0
        (optimizer steps completed) appends to the file in `out` from that step."""
        if self.watch is not None and not self.watch.closed:
            self.watch.close(complete=False, raising=False)  # (a train() that raised)
        options = dataclasses.replace(
            self.options, optimizer=optimizer, scaler=scaler, hook_optimizer=False
        )
        w = Watch(model, self.probes, options, on_record=on_record)
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
