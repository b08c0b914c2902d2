"""What every token dataset is made of: rows of ids held in memory (TokenDataset), where text rows
came from (TextSource), and the padding and error helpers the readers share."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset


def first_special_token(tokenizer) -> int | None:
    """The special token a row starts with where its first token is not one (circuit-tracer's
    rule): the tokenizer's BOS, else its pad, else its EOS, else its first special token; None
    where it has none."""
    candidates = [tokenizer.bos_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id]
    return next((t for t in [*candidates, *tokenizer.all_special_ids] if t is not None), None)


def with_special_first(ids: list[int], special: int | None, specials: set[int], width: int):
    """`ids` starting with `special` (cut to `width` tokens) unless its first token is special."""
    if special is None or (ids and ids[0] in specials):
        return ids
    return [special, *ids[: width - 1]]


@dataclass(frozen=True)
class TextSource:
    """Where dataset=text rows come from, kept so `probe.data.provenance` can name a row's document:
    `lines` holds each non-empty document's 0-based line (.txt, .jsonl) or row (.parquet) in the
    file; packed, `starts` holds each tokenized document's first offset in the joined ids (an EOS
    separator belongs to the document it ends) and `tokens` their count; `prefix` tokens (a
    special token: dataset.prepend_bos) lead each packed row, so a row holds seq_len - prefix of
    the joined ids."""

    path: Path
    lines: list[int]
    tokenizer: str
    seq_len: int
    starts: list[int] | None = None
    tokens: int = 0
    class_names: list[str] | None = None  # dataset.label_field's string classes, by index
    label_names: list[str] | None = None  # dataset.word_labels_field's string labels, by index
    prefix: int = 0


class TokenDataset(Dataset):
    """Rows of ids held in memory. The whole tensors are attributes so the run can check ids once;
    items are `{"input_ids", "attention_mask"?, "token_labels"?}` or `(that dict, target)` for the
    default collate. `token_labels` (N, T): a label per token, -1 where none (/tokens/label)."""

    def __init__(self, input_ids, attention_mask=None, targets=None, source=None,
                 token_labels=None):  # fmt: skip
        self.input_ids, self.attention_mask, self.targets = input_ids, attention_mask, targets
        self.source: TextSource | None = source  # dataset=text: the documents rows come from
        self.token_labels = token_labels

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int):
        inputs = {"input_ids": self.input_ids[i]}
        if self.attention_mask is not None:
            inputs["attention_mask"] = self.attention_mask[i]
        if self.token_labels is not None:
            inputs["token_labels"] = self.token_labels[i]
        return inputs if self.targets is None else (inputs, self.targets[i])

    def head(self, n: int | None) -> TokenDataset:
        """The first n rows (copies, so the rest can be freed)."""
        if n is None or n >= len(self):
            return self
        ids, mask, targets, labels = (
            None if t is None else t[:n].clone()
            for t in (self.input_ids, self.attention_mask, self.targets, self.token_labels)
        )  # row i of the head is row i of the whole
        return TokenDataset(ids, mask, targets, self.source, labels)


def _right_pad(rows, pad: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of different lengths as one (N, width) int64 tensor, and the mask of the real tokens."""
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return ids, mask


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
