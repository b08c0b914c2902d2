"""Labelled text: a document's class (`dataset.label_field`) and a label per whitespace-separated
word (`dataset.word_labels_field`) aligned to the tokens through the tokenizer's character
offsets, so the tokenization is the tokenizer's own (no pre-split words, no added spaces). A token
belongs to the word holding its first non-space character (a token of spaces only, to the word
after it): the tokenizer's word ids where its words are the whitespace-separated ones, and still
right where its pre-tokenizer splits punctuation off into words of their own.

A word's label goes to its first sub-token (`dataset.label_subtokens=first`) or to each of them
(`all`); every other token, special tokens and padding included, gets -1, which probes leave out.
Labels reach the run as /samples/target (class names in order of first appearance in
/dataset/class_names) and, per token row, /tokens/label.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from probe.errors import DataError

WORDS = re.compile(r"\S+")


def fields(p: Path, lines: list[int], names: list[str]) -> dict[str, list]:
    """Each named field's value at the kept lines (rows) of a .jsonl or .parquet file."""
    where = f"dataset.path={str(p)!r}"
    if p.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(p)
        missing = [n for n in names if n not in table.column_names]
        if missing:
            raise DataError(f"{where} has no column {missing[0]!r} (columns: {table.column_names})")
        return {n: [table.column(n)[i].as_py() for i in lines] for n in names}
    if p.suffix.lower() != ".jsonl":
        raise DataError(f"{where}: labels need records, a .jsonl or .parquet file, not {p.suffix}")
    text = p.read_text(encoding="utf-8").split("\n")
    out: dict[str, list] = {n: [] for n in names}
    for i in lines:
        record = json.loads(text[i])
        for n in names:
            if n not in record:
                raise DataError(f"{where}: line {i + 1} has no field {n!r} (keys: {list(record)})")
            out[n].append(record[n])
    return out


def document_targets(values: list, where: str) -> tuple[torch.Tensor, list[str] | None]:
    """(N,) class indices and the class names in order of first appearance (None for ints)."""
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return torch.tensor(values, dtype=torch.long), None
    if not all(isinstance(v, str) for v in values):
        kinds = sorted({type(v).__name__ for v in values})
        raise DataError(f"{where}: labels must all be strings or all be integers, not {kinds}")
    names = list(dict.fromkeys(values))
    index = {name: i for i, name in enumerate(names)}
    return torch.tensor([index[v] for v in values], dtype=torch.long), names


def word_labels(tok, text: str, labels: list, where: str, subtokens: str, max_length: int):
    """(ids, the label of each id) of one document, tokenized as unlabelled text is (special
    tokens, truncated to max_length): each whitespace-separated word's label on its first
    sub-token (or on all of them), -1 elsewhere."""
    words = [m.span() for m in WORDS.finditer(text)]
    if len(labels) != len(words):
        raise DataError(
            f"{where} has {len(words)} whitespace-separated words but {len(labels)} labels; give "
            "one label per word"
        )
    if not getattr(tok, "is_fast", False):
        raise DataError(
            f"{where}: word labels are aligned through the tokenizer's character offsets, which "
            f"only a fast tokenizer gives ({type(tok).__name__} is not); save the tokenizer with "
            "tokenizers installed (AutoTokenizer.from_pretrained(..., use_fast=True))"
        )
    enc = tok(text, add_special_tokens=True, truncation=True, max_length=max_length,
              return_offsets_mapping=True)  # fmt: skip
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    starts = [s for s, _ in words]
    out, seen = [], set()
    for s, e in offsets:
        first = next((c for c in range(s, e) if not text[c].isspace()), None)
        if first is None and e > s:  # a token of spaces only goes with the word after it, as
            first = e  # the tokenizer's word ids have it (a byte-level BPE's lone "Ġ")
        w = _word_at(starts, words, first) if first is not None and e > s else None
        if w is None or (subtokens == "first" and w in seen):
            out.append(-1)
        else:
            out.append(labels[w])
            seen.add(w)
    return ids, out


def _word_at(starts: list[int], words, c: int) -> int | None:
    import bisect

    w = bisect.bisect_right(starts, c) - 1
    return w if w >= 0 and words[w][0] <= c < words[w][1] else None


def label_ids(values: list[list], where: str) -> tuple[list[list[int]], list[str] | None]:
    """Word labels as integers: ints as they are, strings by their order of first appearance."""
    flat = [v for row in values for v in row]
    if all(isinstance(v, int) and not isinstance(v, bool) for v in flat):
        return values, None
    if not all(isinstance(v, str) for v in flat):
        raise DataError(f"{where}: word labels must all be strings or all be integers")
    names = list(dict.fromkeys(flat))
    index = {n: i for i, n in enumerate(names)}
    return [[index[v] for v in row] for row in values], names


def labelled(tok, docs: list[str], lines: list[int], records: dict, cfg, p: Path):
    """(rows of ids, rows of token labels or None, targets or None, class names, word label
    names) of unpacked documents, each cut to dataset.seq_len."""
    where, parquet = f"dataset.path={str(p)!r}", p.suffix.lower() == ".parquet"
    targets = names = word_names = None
    if cfg.label_field:
        targets, names = document_targets(
            records[cfg.label_field], f"{where} field {cfg.label_field!r}"
        )
    rows, token_rows = [], None
    if cfg.word_labels_field:
        at = [f"{where}: {'row' if parquet else 'line'} {n + (0 if parquet else 1)}" for n in lines]
        for place, value in zip(at, records[cfg.word_labels_field], strict=True):
            if not isinstance(value, list):
                raise DataError(
                    f"{place}: {cfg.word_labels_field!r} is a {type(value).__name__}, not a list "
                    "of labels (one per whitespace-separated word)"
                )
        given, word_names = label_ids(records[cfg.word_labels_field], where)
        token_rows = []
        for doc, place, labels in zip(docs, at, given, strict=True):
            ids, per_token = word_labels(tok, doc, labels, place, cfg.label_subtokens, cfg.seq_len)
            rows.append(ids)
            token_rows.append(per_token)
    else:
        enc = tok(docs, add_special_tokens=True, truncation=True, max_length=cfg.seq_len)
        rows = [r[: cfg.seq_len] for r in enc["input_ids"]]
    return rows, token_rows, targets, names, word_names


def padded_labels(rows: list[list[int]], width: int) -> torch.Tensor:
    """(N, width) labels, right-padded with -1 as the ids are."""
    out = torch.full((len(rows), width), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
    return out
