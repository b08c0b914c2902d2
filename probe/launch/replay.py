"""The run's batches again, for a pass after the loop (a circuit's edge scores, the attribution
graphs): this rank's block of the ordered batches, in order, from any batch on (a resumed pass
skips those it wrote), read afresh (the loop's are spent), stopped by the run's one stop flag.

A pass takes its batches from `batches(start)` and calls `check(done, total)` after each unit it
wrote (a batch, a prompt): when a signal arrived meanwhile and the pass is not whole, the run
stops there with `Interrupted`, what was written kept, the file saying it is not complete.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from probe.data.batches import Batch, OrderedBatches, RunBatches
from probe.launch.distributed import Shard, whole_dataset
from probe.launch.interrupt import Interrupted, StopFlag


class Replay:
    """This rank's ordered batches (`batches`: as the run's loop had them), its shard, the
    run's stop flag and file."""

    def __init__(self, batches: RunBatches, shard: Shard, stop: StopFlag, path: Path) -> None:
        self._batches, self.shard, self.stop, self.path = batches, shard, stop, path

    def batches(self, start: int = 0) -> Iterator[tuple[int, Batch]]:
        """(index, batch) of this rank's batches from batch `start` on (those before unread)."""
        b = self._batches
        if not isinstance(b, OrderedBatches):  # (a caller's batches: iterated again, whole)
            for i, batch in enumerate(b):
                if i >= start:
                    yield i, batch
            return
        again = OrderedBatches(b.dataset, b.batch_size, b.loader.num_workers, b.has_targets)
        again.skip(start)
        yield from enumerate(again, start=start)

    def whole_dataset(self) -> Iterator[Batch]:
        """Every batch of the whole dataset, on every rank (a mean over every pair)."""
        b = self._batches
        if not isinstance(b, OrderedBatches):
            yield from b
            return
        dataset = whole_dataset(b) if self.shard.world > 1 else b.dataset
        yield from OrderedBatches(dataset, b.batch_size, b.loader.num_workers, b.has_targets)

    def __len__(self) -> int:
        """This rank's batches (all of them, those a resumed loop skipped too)."""
        b = self._batches
        if isinstance(b, OrderedBatches):
            return -(-b.num_samples // b.batch_size)
        return len(b)

    def check(self, doing: str, done: int, total: int, unit: str = "batches") -> None:
        """Stop the run here (`Interrupted`) when a signal arrived and the pass, `done` of its
        `total` units written, is not whole."""
        signum = self.stop.requested
        if signum is not None and done < total:
            raise Interrupted(signum, self.path, f"while {doing} after {done} of {total} {unit}")
