"""A caller's batches (`probe.launch.api`) as the run loop takes them: `probe.data.batches.Batch`es with the
index of their first sample, from any iterable of tensors, (inputs, targets) pairs or dicts of
keyword arguments. The first batch is read at once: it tells the batch size, whether there are
targets (for a gradient objective) and, with the data's length, how many samples there are."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from probe.data.batches import SIDE_KEYS, Batch
from probe.errors import DataError

EXPECTED = (
    "each batch must be a tensor, an (inputs, targets) pair or a dict of keyword arguments "
    "such as input_ids/attention_mask"
)


class UserBatches:
    def __init__(self, data: Iterable):
        if isinstance(data, torch.Tensor | dict):  # one batch
            data = [data]
        if not isinstance(data, Iterable):
            raise DataError(
                f"data is a {type(data).__name__}, not an iterable of batches; {EXPECTED}"
            )
        self.data = data
        self.rest: Iterator | None = iter(data)
        try:
            self.first = as_batch(next(self.rest), 0)
        except StopIteration:
            raise DataError("data holds no batch; give at least one") from None
        self.batch_size = self.first.size
        self.has_targets = self.first.targets is not None
        self.num_samples = known_samples(data, self.batch_size)
        self.dataset = getattr(data, "dataset", None)  # a DataLoader's (token and pair checks)
        self.skipped = 0

    def __len__(self) -> int:
        # a TypeError when it has none: tqdm then counts without a total
        return len(self.data)  # type: ignore[arg-type]

    def skip(self, batches: int) -> None:
        """Start after `batches` batches (a resumed run): they are read and dropped."""
        self.skipped = batches

    def __iter__(self) -> Iterator[Batch]:
        if self.rest is not None:  # the first pass goes on from the batch read at the start
            items, first, self.rest = self.rest, self.first, None
        elif iter(self.data) is self.data:
            raise DataError(
                "data is a one-pass iterator (a generator), but this run reads it twice (an edit "
                "with a first-pass mean); give a list of batches or a DataLoader"
            )
        else:
            items, first = iter(self.data), None
        start = 0
        for index, item in enumerate(_chain(first, items)):
            batch = item if isinstance(item, Batch) else as_batch(item, start)
            batch.start = start
            start += batch.size
            if index >= self.skipped:
                yield batch


def _chain(first, items):
    if first is not None:
        yield first
    yield from items


def as_batch(item, start: int) -> Batch:
    """One batch as the pipeline's `Batch`; anything else is a DataError naming what it was."""
    inputs, targets = item, None
    if isinstance(item, list | tuple):
        if len(item) == 1:
            inputs = item[0]
        elif len(item) == 2:
            inputs, targets = item
        else:
            raise DataError(
                f"data yielded a {type(item).__name__} of {len(item)} items; {EXPECTED}"
            )
    side = {}
    if isinstance(inputs, dict):
        inputs = dict(inputs)
        side = {k: inputs.pop(k) for k in SIDE_KEYS if k in inputs}
        if not any(isinstance(v, torch.Tensor) for v in inputs.values()):
            raise DataError(f"data yielded a dict without tensors ({sorted(inputs)}); {EXPECTED}")
    elif not isinstance(inputs, torch.Tensor):
        raise DataError(f"data yielded a {type(inputs).__name__}; {EXPECTED}")
    if targets is not None and not isinstance(targets, torch.Tensor):
        targets = torch.as_tensor(targets)
    return Batch(inputs, targets, start, side)


def known_samples(data, batch_size: int) -> int | None:
    """How many samples `data` holds, where that is known without reading it: a DataLoader's
    dataset, a list of batches; None for a generator."""
    dataset = getattr(data, "dataset", None)
    if dataset is not None and hasattr(dataset, "__len__"):
        return len(dataset)
    if isinstance(data, list | tuple):
        return sum(as_batch(item, 0).size for item in data)
    return None
