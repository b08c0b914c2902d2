"""Build the ordered batch iterator a dataset config names: images, tensors or tokens
(`probe.data.token_sets`; a token batch's inputs are a dict of `input_ids` and `attention_mask`)."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sized
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, cast

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

from probe.config import TOKEN_DATASETS, TOKEN_REDUCTIONS
from probe.data.token_sets import token_dataset
from probe.errors import DataError
from probe.plan import DataSpec, ModelSpec

# what a batch carries besides the model's inputs: a pairs batch's other half and answer tokens,
# a labelled token batch's label per token (/tokens/label)
SIDE_KEYS = ("corrupt_ids", "answer", "wrong", "token_labels")
log = logging.getLogger("probe")


@dataclass
class Batch:
    inputs: torch.Tensor | dict[str, torch.Tensor]
    targets: torch.Tensor | None
    start: int  # index of the first sample of this batch in the dataset
    side: dict[str, torch.Tensor] = field(default_factory=dict)  # SIDE_KEYS of a pairs batch

    @property
    def size(self) -> int:
        inputs = self.inputs
        if not isinstance(inputs, dict):
            return len(inputs)
        if "input_ids" in inputs:
            return len(inputs["input_ids"])
        return len(next(v for v in inputs.values() if isinstance(v, torch.Tensor)))


class RunBatches(Protocol):
    """What a run reads of its batches (`OrderedBatches`, or a caller's:
    probe.data.user_batches.UserBatches): the batches in order and how many there are, the
    dataset behind them (a caller's: its DataLoader's, or None), the size of a full batch,
    whether they bring targets, how many samples they hold (None: unknown before they are read),
    and `skip` (a resumed run starts after the batches its file holds)."""

    @property
    def dataset(self) -> Dataset | None: ...

    @property
    def batch_size(self) -> int: ...

    @property
    def has_targets(self) -> bool: ...

    @property
    def num_samples(self) -> int | None: ...

    def skip(self, batches: int) -> None: ...

    def __iter__(self) -> Iterator[Batch]: ...

    def __len__(self) -> int: ...


class SyntheticImages(Dataset):
    """Seeded Gaussian images and integer targets: sample i depends only on (seed, i)."""

    def __init__(self, num_samples: int, shape: tuple[int, ...], num_classes: int, seed: int):
        self.num_samples, self.shape, self.num_classes, self.seed = (
            num_samples,
            shape,
            num_classes,
            seed,
        )

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        target = int(torch.randint(self.num_classes, (1,), generator=g))
        return torch.randn(self.shape, generator=g), target


def _length(dataset: Dataset) -> int:
    """A map-style dataset's length (torch's Dataset declares no __len__; each one here has it)."""
    return len(cast(Sized, dataset))


class OrderedBatches:
    """Batches in dataset order, with the index of each batch's first sample; the last may be short."""

    def __init__(self, dataset: Dataset, batch_size: int, num_workers: int, has_targets: bool):
        self.dataset, self.has_targets = dataset, has_targets
        self.batch_size, self.num_workers, self.first = batch_size, num_workers, 0
        self.loader = DataLoader(
            dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers
        )

    def skip(self, batches: int) -> None:
        """Start at batch `batches` (a resumed run); the skipped samples are never loaded."""
        self.first = min(batches * self.batch_size, _length(self.dataset))
        rest = Subset(self.dataset, range(self.first, _length(self.dataset)))
        self.loader = DataLoader(
            rest, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers
        )

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def num_samples(self) -> int:
        return _length(self.dataset)

    def __iter__(self) -> Iterator[Batch]:
        start = self.first
        for item in _loaded(self.loader, start, self.batch_size):
            if self.has_targets:
                inputs, targets = item
            else:
                inputs, targets = (item[0] if isinstance(item, list | tuple) else item), None
            side = {}
            if isinstance(inputs, dict):
                side = {k: inputs.pop(k) for k in SIDE_KEYS if k in inputs}
            batch = Batch(inputs, targets, start, side)
            yield batch
            start += batch.size


def _loaded(loader: DataLoader, start: int, batch_size: int):
    """The loader's items; a sample that cannot be read becomes a DataError naming where."""
    items = iter(loader)
    for position in range(start, 1 << 62, batch_size):
        try:
            item = next(items)
        except StopIteration:
            return
        except (OSError, ValueError, RuntimeError) as e:
            raise DataError(
                f"loading the batch that starts at sample {position} failed ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}); fix or remove that file, or limit "
                "dataset.num_samples; the samples before it are written"
            ) from None
        yield item


def build_batches(cfg: DataSpec, model_cfg: ModelSpec, seed: int, model=None) -> OrderedBatches:
    """The batches of a run plan's dataset `cfg` (`model_cfg` gives generated data its default
    shape and classes, and text its tokenizer); `model` tells token data its vocabulary."""
    if cfg.name in (*TOKEN_DATASETS, "pairs"):
        from probe.data.pairs import pair_dataset
        from probe.models.hub import pad_token_id, vocab_size

        vocab, pad = (vocab_size(model), pad_token_id(model)) if model is not None else (None, None)
        if cfg.name == "pairs":
            dataset, has_targets = pair_dataset(cfg, model_cfg, vocab, pad), False
        else:
            dataset, has_targets = token_dataset(cfg, model_cfg, seed, vocab, pad)
        return OrderedBatches(dataset, cfg.batch_size, cfg.num_workers, has_targets)
    channels = cfg.channels or model_cfg.input_shape[0]
    size = cfg.image_size or model_cfg.input_shape[-1]
    num_classes = cfg.num_classes or model_cfg.num_classes
    shape = (channels, size, size)
    has_targets = True
    if cfg.name in ("synthetic", "fakedata") and model is not None:
        _check_target_classes(cfg, model_cfg, model, num_classes)
    if cfg.name == "synthetic":
        dataset = SyntheticImages(cfg.num_samples or 16, shape, num_classes, seed)
    elif cfg.name == "fakedata":
        dataset = _fakedata(cfg.num_samples or 16, shape, num_classes, seed)
    elif cfg.name == "imagefolder":
        dataset = _imagefolder(cfg)
    else:
        dataset, has_targets = _tensors(cfg.path)
    if cfg.num_samples is not None and cfg.name in ("imagefolder", "tensors"):
        dataset = Subset(dataset, range(min(cfg.num_samples, _length(dataset))))
    return OrderedBatches(dataset, cfg.batch_size, cfg.num_workers, has_targets)


def _check_target_classes(cfg, model_cfg, model: nn.Module, num_classes: int) -> None:
    """Synthetic targets are drawn below dataset.num_classes or model.num_classes (1000 unless
    set), which a custom model is not built with: say so where its outputs look fewer or more."""
    if not (model_cfg._target_ or model_cfg.library == "custom"):
        return
    source = "dataset.num_classes" if cfg.num_classes else "model.num_classes"
    width, where = output_width(model, model_cfg)
    if width is None:
        log.info("dataset=%s: targets drawn below %d (%s)", cfg.name, num_classes, source)
    elif width != num_classes:
        log.warning(
            "dataset=%s draws its targets below %d (%s), but %s %d outputs: set "
            "model.num_classes=%d (or dataset.num_classes=%d) so that /samples/target and the "
            "cross_entropy objective of gradient probes use classes the model has",
            cfg.name,
            num_classes,
            source,
            where,
            width,
            width,
            width,
        )


def output_width(model: nn.Module, model_cfg=None) -> tuple[int | None, str]:
    """How many outputs a classifier seems to have, and whence: model.kwargs.num_classes, a
    `num_classes` attribute, else its last Linear module (in module order). A guess that needs
    no forward pass, for a warning only."""
    given = (model_cfg.kwargs or {}).get("num_classes") if model_cfg is not None else None
    if isinstance(given, int):
        return given, "model.kwargs.num_classes gives it"
    attribute = getattr(model, "num_classes", None)
    if isinstance(attribute, int) and not isinstance(attribute, bool):
        return attribute, "the model's num_classes attribute says it has"
    last = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)][-1:]
    if last:
        return last[0][1].out_features, f"the model's last Linear layer {last[0][0]!r} has"
    return None, ""


def check_token_data(dataset, selections, model) -> None:
    """Token rows and token reductions need to know the padding: without an attention mask,
    ids equal to the model's pad token would count as tokens."""
    from probe.models.hub import pad_token_id

    wanting = [s for s in selections if s.rows == "tokens" or s.reduce in TOKEN_REDUCTIONS]
    if not wanting or getattr(dataset, "unpadded", False):
        return
    ids = getattr(dataset, "input_ids", None)
    if ids is None or getattr(dataset, "attention_mask", None) is not None:
        return
    pad = pad_token_id(model)
    if pad is not None and bool((ids == pad).any()):
        what = "rows: tokens" if wanting[0].rows == "tokens" else f"reduce: {wanting[0].reduce}"
        raise DataError(
            f"probe {wanting[0].probe!r} asks for {what}, but the token ids hold the model's pad "
            f"token {pad} and the data has no attention_mask, so padding cannot be told from "
            "tokens; save the ids with an attention_mask ({'input_ids': ..., 'attention_mask': "
            "...}) or as a list of unpadded sequences"
        )


def _fakedata(n: int, shape, num_classes: int, seed: int) -> Dataset:
    from torchvision import datasets, transforms

    return datasets.FakeData(
        size=n,
        image_size=shape,
        num_classes=num_classes,
        transform=transforms.ToTensor(),
        random_offset=seed,
    )


def _imagefolder(cfg) -> Dataset:
    from torchvision import datasets, transforms

    root = Path(str(cfg.root))  # (a directory: probe.checks)
    tf = transforms.Compose(
        [
            transforms.Resize(cfg.resize),
            transforms.CenterCrop(cfg.crop),
            transforms.ToTensor(),
            transforms.Normalize(list(cfg.mean), list(cfg.std)),
        ]
    )
    try:
        return datasets.ImageFolder(str(root), transform=tf)
    except (FileNotFoundError, RuntimeError) as e:
        raise DataError(
            f"dataset.root={str(root)!r} holds no images ({e}); expected ROOT/<class>/<image>.jpg|png"
        ) from None


def _tensors(path) -> tuple[Dataset, bool]:
    p = Path(str(path))  # (a readable file: probe.checks)
    try:
        obj = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:
        raise DataError(
            f"dataset.path={str(p)!r} is not a readable .pt file ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); save the inputs with "
            "torch.save(tensor, path) or torch.save({'inputs': x, 'targets': y}, path)"
        ) from None
    if isinstance(obj, torch.Tensor):
        return _checked_tensor_dataset(p, obj, None), False
    if isinstance(obj, dict) and isinstance(obj.get("inputs"), torch.Tensor):
        targets = obj.get("targets")
        if targets is not None and not isinstance(targets, torch.Tensor):
            raise DataError(
                f"dataset.path={str(p)!r}: 'targets' is a {type(targets).__name__}, not a tensor"
            )
        return _checked_tensor_dataset(p, obj["inputs"], targets), targets is not None
    keys = list(obj) if isinstance(obj, dict) else None
    raise DataError(
        f"dataset.path={str(p)!r} holds a {type(obj).__name__}{f' with keys {keys}' if keys else ''}; "
        "expected a tensor of inputs or a dict {'inputs': Tensor, 'targets': Tensor (optional)}"
    )


def _checked_tensor_dataset(p: Path, inputs: torch.Tensor, targets) -> TensorDataset:
    if inputs.ndim < 1 or len(inputs) == 0:
        raise DataError(
            f"dataset.path={str(p)!r} holds no samples (inputs shape {tuple(inputs.shape)})"
        )
    if targets is not None and len(targets) != len(inputs):
        raise DataError(
            f"dataset.path={str(p)!r}: {len(inputs)} inputs but {len(targets)} targets; they must match"
        )
    return TensorDataset(inputs) if targets is None else TensorDataset(inputs, targets)
