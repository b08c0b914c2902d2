"""Which training steps a watch records: every N-th (`every=N`) or 0, 1, 2, 4, 8, ... (`"log"`)."""

from __future__ import annotations

from dataclasses import dataclass

from probe.watch_options import check_every


@dataclass(frozen=True)
class Schedule:
    """`every` an int >= 1 or "log"; `name` names the keyword in errors."""

    every: int | str
    name: str = "every"

    def __post_init__(self):
        check_every(self.name, self.every)

    def records(self, step: int) -> bool:
        """Whether step `step` (0-based) is recorded."""
        every = self.every
        if isinstance(every, str):  # "log" (check_every allows no other string)
            return step == 0 or step & (step - 1) == 0
        return step % every == 0

    def steps_before(self, step: int) -> list[int]:
        """The recorded steps below `step`, in order."""
        every = self.every
        if isinstance(every, str):  # "log"
            out, s = ([0] if step > 0 else []), 1
            while s < step:
                out.append(s)
                s *= 2
            return out
        return list(range(0, step, every))
