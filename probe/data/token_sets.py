"""Token datasets: ids from a .pt file, tokenized text, seeded random ids.

Ids stay int64 from file to model (an embedding indexes with them; a float id is a bug), and every
padded position is 0 in `attention_mask`, so padding can be kept out of statistics.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset

from probe.data.token_data import TokenDataset, _first_line, _right_pad
from probe.errors import ConfigError, DataError


class RandomTokens(Dataset):
    """Seeded random ids: row i depends only on (seed, i), like SyntheticImages, so a longer run
    starts with the rows of a shorter one. No mask, no targets."""

    attention_mask = None
    targets = None
    unpadded = True  # every id is a token, the pad id included

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int):
        self.num_samples, self.seq_len = num_samples, seq_len
        self.vocab_size, self.seed = vocab_size, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int):
        if not 0 <= i < self.num_samples:
            raise IndexError(f"row {i} of {self.num_samples}")
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        return {"input_ids": torch.randint(self.vocab_size, (self.seq_len,), generator=g)}

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.stack([self[i]["input_ids"] for i in range(self.num_samples)])


def token_dataset(
    cfg, model_cfg, seed: int, vocab_size: int | None, pad_token_id: int | None
) -> tuple[Dataset, bool]:
    """The dataset `cfg.name` names (tokens, text or random_tokens), cut to `cfg.num_samples`, with
    its ids checked against `vocab_size` (the model's; None skips the check); and whether it has
    targets. `pad_token_id` pads ragged ids of a .pt file (text uses its tokenizer's)."""
    n = cfg.num_samples
    if cfg.name == "random_tokens":
        vocab = cfg.vocab_size or vocab_size
        if vocab is None or vocab < 1:
            raise ConfigError(
                f"dataset=random_tokens needs a vocabulary size (dataset.vocab_size={vocab}); "
                "set dataset.vocab_size=N or use a model that has one"
            )
        if vocab_size is not None and vocab > vocab_size:
            raise ConfigError(
                f"dataset.vocab_size={vocab} is beyond the model's vocabulary of {vocab_size}; "
                f"use at most {vocab_size} (or null for the model's)"
            )
        return RandomTokens(n or 16, cfg.seq_len, vocab, seed), False
    p = Path(str(cfg.path))  # (a readable file: probe.checks)
    if cfg.name == "tokens":
        ds = _tokens_file(p, pad_token_id)
    else:
        from probe.data.text import text_dataset

        ds = text_dataset(p, cfg, model_cfg, n)
    ds = ds.head(n)
    _check_ids(ds.input_ids, vocab_size, p)
    return ds, ds.targets is not None


def _check_ids(ids: torch.Tensor, vocab_size: int | None, p: Path) -> None:
    """Ids outside the embedding would crash deep in the model (or on a GPU, asynchronously)."""
    where = f"dataset.path={str(p)!r}"
    if ids.numel() and int(ids.min()) < 0:
        sample, pos = (ids < 0).nonzero()[0].tolist()
        raise DataError(
            f"{where}: token id {int(ids[sample, pos])} at sample {sample} is negative; "
            "ids index the model's embedding and must be >= 0 (mark padding in attention_mask)"
        )
    if vocab_size is not None and ids.numel() and int(ids.max()) >= vocab_size:
        sample, pos = (ids >= vocab_size).nonzero()[0].tolist()
        raise DataError(
            f"{where}: token id {int(ids[sample, pos])} at sample {sample} is beyond the model's "
            f"vocabulary of {vocab_size}; tokenize with the model's tokenizer (dataset.tokenizer) "
            "or check model.name"
        )


# --- dataset=tokens -------------------------------------------------------------------------


def _tokens_file(p: Path, pad_token_id: int | None) -> TokenDataset:
    where = f"dataset.path={str(p)!r}"
    try:
        obj = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:
        raise DataError(
            f"{where} is not a readable .pt file ({_first_line(e)}); save the ids with "
            "torch.save(ids, path) or torch.save({'input_ids': ids, ...}, path)"
        ) from None
    if isinstance(obj, torch.Tensor):
        obj = {"input_ids": obj}
    if not isinstance(obj, dict) or "input_ids" not in obj:
        keys = f" with keys {list(obj)}" if isinstance(obj, dict) else ""
        raise DataError(
            f"{where} holds a {type(obj).__name__}{keys}; expected a (N, T) tensor of token ids or "
            "a dict {'input_ids': ..., 'attention_mask': ... (optional), 'labels': ... (optional)}"
        )
    extra = sorted(set(obj) - {"input_ids", "attention_mask", "labels", "targets", "token_labels"})
    if extra:
        raise DataError(f"{where} holds keys dataset=tokens does not use: {extra}; remove them")
    if "labels" in obj and "targets" in obj:
        raise DataError(f"{where} holds both 'labels' and 'targets'; keep one of them")
    ids, mask = obj["input_ids"], obj.get("attention_mask")
    if isinstance(ids, list | tuple):
        ids, mask = _padded(ids, mask, pad_token_id, where)
    ids = _integers(ids, where, "input_ids")
    if ids.ndim != 2 or 0 in ids.shape:
        hint = "; use ids.unsqueeze(0) for one sequence" if ids.ndim == 1 else ""
        raise DataError(
            f"{where}: input_ids has shape {tuple(ids.shape)}; expected (N, T), N samples of "
            f"T tokens, both at least 1{hint}"
        )
    if mask is not None:
        mask = _mask(mask, where)
        if mask.shape != ids.shape:
            raise DataError(
                f"{where}: attention_mask has shape {tuple(mask.shape)} but input_ids "
                f"{tuple(ids.shape)}; they must be equal (1 = a real token, 0 = padding)"
            )
    key = "labels" if "labels" in obj else "targets"
    targets = obj.get(key)
    if targets is not None:
        if not isinstance(targets, torch.Tensor):
            raise DataError(f"{where}: {key!r} is a {type(targets).__name__}, not a tensor")
        n, t = ids.shape
        if targets.ndim not in (1, 2) or targets.shape not in ((n,), (n, t)):
            raise DataError(
                f"{where}: {n} samples of {t} tokens but {key} of shape "
                f"{tuple(targets.shape)}; expected ({n},) or ({n}, {t})"
            )
    token_labels = obj.get("token_labels")
    if token_labels is not None:
        token_labels = _integers(token_labels, where, "token_labels")
        if token_labels.shape != ids.shape:
            raise DataError(
                f"{where}: token_labels has shape {tuple(token_labels.shape)} but input_ids "
                f"{tuple(ids.shape)}; give one label per token (-1 where none)"
            )
    return TokenDataset(ids, mask, targets, None, token_labels)


def _integers(t, where: str, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        try:
            t = torch.as_tensor(t)
        except (TypeError, ValueError, RuntimeError):
            raise DataError(f"{where}: {what} is a {type(t).__name__}, not a tensor") from None
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise DataError(
            f"{where}: token ids must be integers, but {what} is {t.dtype}; "
            "save them as ids.long() (ids are never cast)"
        )
    return t.long()


def _mask(m, where: str) -> torch.Tensor:
    m = torch.as_tensor(m)
    if m.numel() and not bool(((m == 0) | (m == 1)).all()):
        raise DataError(f"{where}: attention_mask holds values other than 0 and 1 (1: a token)")
    return m.long()


def _padded(rows, mask, pad_token_id: int | None, where: str):
    """Right-pad a list of 1-D id tensors to the longest; a mask is built where padding is added
    (a list of masks, row by row, is padded with 0 the same way)."""
    if not rows:
        raise DataError(f"{where}: input_ids is an empty list; it holds no samples")
    rows = [_integers(r, where, f"input_ids[{i}]") for i, r in enumerate(rows)]
    masks = [_mask(m, where) for m in mask] if isinstance(mask, list | tuple) else None
    for i, r in enumerate(rows):
        if r.ndim != 1 or len(r) == 0 or (masks and (len(masks) <= i or masks[i].shape != r.shape)):
            raise DataError(
                f"{where}: input_ids[{i}] has shape {tuple(r.shape)}; a list of input_ids holds "
                "non-empty 1-D tensors (and a list of masks, if any, one of the same length each)"
            )
    width = max(len(r) for r in rows)
    if mask is None and all(len(r) == width for r in rows):
        return torch.stack(rows), None
    ids, built = _right_pad(rows, pad_token_id or 0, width)
    if masks is not None:
        return ids, _right_pad(masks, 0, width)[0]
    return ids, built if mask is None else mask
