"""What identifies a run's dataset and its samples, in a form a writer can store.

`/samples/index` holds dataset-wide sample indices; without the dataset's identity (which file or
folder, which content, which generator) and a name per sample (an image's path, a document's id)
they cannot be traced back. `describe` says both, cheaply: no image is read, and a file over
HASH_LIMIT is identified by its size and mtime instead of its bytes.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from torch.utils.data import Subset

HASH_LIMIT = 256 << 20  # files up to this size are hashed whole
_READ = 1 << 20  # bytes per read while hashing
_GENERATED = ("synthetic", "fakedata", "random_tokens")

Lookup = Callable[[np.ndarray], np.ndarray]


@dataclass
class Provenance:
    """`identity`: what the dataset is (keys: see `describe`); `per_sample`: for an array of
    dataset-wide sample indices (as `/samples/index` holds them), an object array of str of the
    same shape per name; `lists`: whole-dataset lists such as `class_names`, in index order."""

    identity: dict[str, str | int]
    per_sample: dict[str, Lookup] = field(default_factory=dict)
    lists: dict[str, list[str]] = field(default_factory=dict)

    def samples(self, index) -> dict[str, np.ndarray]:
        """Every per-sample lookup applied to `index`."""
        index = np.asarray(index, dtype=np.int64)
        return {name: lookup(index) for name, lookup in self.per_sample.items()}


def describe(dataset_cfg, dataset) -> Provenance:
    """The provenance of `dataset`, built from `dataset_cfg` by `probe.data.batches.build_batches`: the
    whole dataset `/samples/index` indexes (an OrderedBatches is taken for its dataset; a torchrun
    rank's batches hold a Subset of it, pass the whole). Subsets are followed to the data they cut.
    The keys of `identity`, `per_sample` and `lists`, per dataset type: docs/configuration.md,
    "What identifies the data"."""
    from probe.data.batches import OrderedBatches

    if isinstance(dataset, OrderedBatches):
        dataset = dataset.dataset
    name = str(_get(dataset_cfg, "name") or "unknown")
    identity: dict[str, str | int] = {"dataset": name}
    size = _get(dataset_cfg, "num_samples") if name == "python" else _size(dataset)
    if size is not None:
        identity["num_samples"] = int(size)
    if dataset is None or name == "python":  # a caller's batches: nothing more is known
        return Provenance(identity)
    base, to_base = _unwrap(dataset)
    if name == "imagefolder":
        return _imagefolder(identity, base, to_base)
    if name == "text":
        return _text(identity, base, to_base, dataset_cfg)
    if name in _GENERATED:
        identity.update(_generated(name, base))
        return Provenance(identity)
    path = _get(dataset_cfg, "path")
    if path is not None:
        identity.update(file_identity(path))
    return Provenance(identity)


def file_identity(path) -> dict[str, str | int]:
    """`path` (resolved), `bytes`, `hash` and `hash_of` of one file (see `describe`)."""
    p = Path(str(path))
    st = p.stat()
    found: dict[str, str | int] = {"path": str(p.resolve()), "bytes": st.st_size}
    if st.st_size > HASH_LIMIT:
        stamp = f"{st.st_size}:{st.st_mtime_ns}".encode()
        found.update(
            hash=hashlib.sha256(stamp).hexdigest(), hash_of="size+mtime", mtime_ns=st.st_mtime_ns
        )
        return found
    h = hashlib.sha256()
    with p.open("rb") as f:
        for chunk in iter(lambda: f.read(_READ), b""):
            h.update(chunk)
    found.update(hash=h.hexdigest(), hash_of="content")
    return found


# --- indices ----------------------------------------------------------------------------------


def _unwrap(dataset):
    """The dataset under any Subsets, and the map from indices of `dataset` to indices of it."""
    cuts = []
    while isinstance(dataset, Subset):
        indices = dataset.indices
        cuts.append(indices if isinstance(indices, range) else np.asarray(indices, dtype=np.int64))
        dataset = dataset.dataset
    size = _size(dataset)

    def to_base(index) -> np.ndarray:
        index = np.asarray(index, dtype=np.int64)
        for indices in cuts:  # outermost first
            _check(index, len(indices))
            if isinstance(indices, range):
                index = indices.start + index * indices.step
            else:
                index = indices[index]
        if size is not None:
            _check(index, size)
        return index

    return dataset, to_base


def _check(index: np.ndarray, n: int) -> None:
    if index.size and (int(index.min()) < 0 or int(index.max()) >= n):
        bad = index[(index < 0) | (index >= n)].flat[0]
        raise IndexError(f"sample index {int(bad)} is outside the dataset's {n} samples")


def _lookup(names: Callable[[], list[str]], to_base) -> Lookup:
    """A per-sample lookup of base-dataset `names`, built on first use."""
    table = functools.cache(lambda: np.asarray(names(), dtype=object))

    def lookup(index) -> np.ndarray:
        index = to_base(index)
        _check(index, len(table()))
        return table()[index]

    return lookup


# --- kinds ------------------------------------------------------------------------------------


def _imagefolder(identity: dict, base, to_base) -> Provenance:
    if not hasattr(base, "samples"):  # not torchvision's ImageFolder: nothing more is known
        return Provenance(identity)
    root = base.root
    relative = [Path(os.path.relpath(p, root)).as_posix() for p, _ in base.samples]
    listing = sorted(zip(relative, (os.path.getsize(p) for p, _ in base.samples), strict=True))
    h = hashlib.sha256()
    for rel, nbytes in listing:
        h.update(f"{rel}\t{nbytes}\n".encode())
    identity.update(
        root=str(Path(root).resolve()),
        images=len(relative),
        classes=len(base.classes),
        hash=h.hexdigest(),
        hash_of="paths+sizes",
    )
    return Provenance(
        identity, {"path": _lookup(lambda: relative, to_base)}, {"class_names": list(base.classes)}
    )


def _text(identity: dict, base, to_base, dataset_cfg) -> Provenance:
    source = getattr(base, "source", None)
    path = source.path if source is not None else _get(dataset_cfg, "path")
    if path is not None:
        identity.update(file_identity(path))
    if source is None:
        return Provenance(identity)
    packed = source.starts is not None
    identity.update(
        documents=len(source.lines),
        tokenizer=source.tokenizer,
        seq_len=source.seq_len,
        pack=int(packed),
    )
    if source.prefix:
        identity["prepend_bos"] = 1
    ids = functools.cache(lambda: document_ids(source.path, source.lines))
    if not packed:
        names = {"class_names": source.class_names, "token_label_names": source.label_names}
        lists = {k: v for k, v in names.items() if v is not None}
        return Provenance(identity, {"document": _lookup(ids, to_base)}, lists)
    starts = np.asarray(source.starts, dtype=np.int64)
    stride = source.seq_len - source.prefix  # joined ids per row
    first = np.arange(0, source.tokens, stride, dtype=np.int64)  # each row's first joined id
    last = np.minimum(first + stride, source.tokens) - 1
    at_first, at_last = (np.searchsorted(starts, t, side="right") - 1 for t in (first, last))
    return Provenance(
        identity,
        {
            "document": _lookup(lambda: [ids()[d] for d in at_first], to_base),
            "last_document": _lookup(lambda: [ids()[d] for d in at_last], to_base),
        },
    )


def document_ids(path, lines: list[int]) -> list[str]:
    """The id of the document at each 0-based line (row) of a .txt, .jsonl or .parquet file."""
    p = Path(str(path))
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        given = [None] * (max(lines) + 1 if lines else 0)
        if "id" in pq.read_schema(p).names:
            given = pq.read_table(p, columns=["id"]).column("id").to_pylist()
        return [_id(given[n], f"{p.name}#{n}") for n in lines]
    if suffix != ".jsonl":
        return [f"{p.name}:{n + 1}" for n in lines]
    text = p.read_text(encoding="utf-8").split("\n")
    return [_id(json.loads(text[n]).get("id"), f"{p.name}:{n + 1}") for n in lines]


def _id(value, fallback: str) -> str:
    if value is None or isinstance(value, dict | list):
        return fallback
    return str(value)


def _generated(name: str, base) -> dict[str, str | int]:
    """The generator's parameters and their hash (sample i depends on them and i only)."""
    keys = {
        "random_tokens": {"seed": "seed", "seq_len": "seq_len", "vocab_size": "vocab_size"},
        "fakedata": {"seed": "random_offset", "shape": "image_size", "num_classes": "num_classes"},
    }.get(name, {"seed": "seed", "shape": "shape", "num_classes": "num_classes"})
    params = {}
    for key, attr in keys.items():  # (a batch source of another kind has none of them)
        value = getattr(base, attr, None)
        if value is not None:
            params[key] = "x".join(map(str, value)) if key == "shape" else int(value)
    if not params:
        return {"hash_of": "unknown"}
    text = json.dumps({"generator": name, **params}, sort_keys=True)
    return {**params, "hash": hashlib.sha256(text.encode()).hexdigest(), "hash_of": "parameters"}


def _size(dataset) -> int | None:
    try:
        return int(len(dataset))
    except TypeError:
        return None


def _get(cfg, key: str):
    if cfg is None:
        return None
    if isinstance(cfg, dict):
        return cfg.get(key)
    return getattr(cfg, key, None)
