"""Paired clean/corrupt token inputs for activation patching (dataset=pairs).

Patching copies activations position by position from one run into the other, so both halves of a
pair have one length and share one attention mask. Answers (and wrong answers) are single token
ids, padded with -1, so a logit difference can be read off without tokenizing again.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.utils.data import Dataset

from probe.data import text as tx  # its record and tokenizer helpers
from probe.data import token_sets as tk  # its file and id helpers, private or not
from probe.errors import DataError

_KEYS = ("clean_ids", "corrupt_ids", "attention_mask", "answer", "wrong")
_ANSWERS = ("answer", "wrong")
_UNEQUAL = "{}: clean is {} tokens, corrupt is {}; patching needs halves of equal length: {}"
_JSONL = "each line is {'clean': TEXT, 'corrupt': TEXT} with optional 'answer' and 'wrong'"


class PairDataset(Dataset):
    """Clean ids as `input_ids` (so the model runs on them as on any token data), corrupt ids, one
    shared mask, optional (N, K) answers; whole tensors are attributes so ids are checked once."""

    targets = None

    def __init__(self, input_ids, corrupt_ids, attention_mask, answer=None, wrong=None):
        self.input_ids, self.corrupt_ids, self.answer = input_ids, corrupt_ids, answer
        self.attention_mask, self.wrong = attention_mask, wrong

    def _tensors(self):
        return (self.input_ids, self.corrupt_ids, self.attention_mask, self.answer, self.wrong)

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> dict:
        names = ("input_ids", "corrupt_ids", "attention_mask", *_ANSWERS)
        return {k: t[i] for k, t in zip(names, self._tensors(), strict=True) if t is not None}

    def head(self, n: int | None) -> PairDataset:
        """The first n pairs (copies, so the rest can be freed); the width stays the whole file's,
        so a pair's row does not change with num_samples."""
        if n is None or n >= len(self):
            return self
        return PairDataset(*(None if t is None else t[:n].clone() for t in self._tensors()))


def pair_dataset(cfg, model_cfg, vocab_size: int | None, pad_token_id: int | None) -> Dataset:
    """The pairs of `cfg.path` (.jsonl text tokenized with dataset.tokenizer, default model.name;
    or a .pt dict of ids), cut to `cfg.num_samples`, every id checked against `vocab_size` (None
    skips the check). Ragged pairs are right-padded with `pad_token_id`, else the tokenizer's pad,
    else its EOS, else 0."""
    n = cfg.num_samples
    p = Path(str(cfg.path))  # (a .jsonl or .pt file: probe.checks)
    is_jsonl = p.suffix.lower() == ".jsonl"
    ds = (_jsonl(p, cfg, model_cfg, pad_token_id) if is_jsonl else _pt(p, pad_token_id)).head(n)
    _check_all(ds, vocab_size, p)
    return ds


def _check_all(ds: PairDataset, vocab_size: int | None, p: Path) -> None:
    """Both halves and the answers against the embedding; -1 in answers is padding."""
    for name in ("input_ids", "corrupt_ids", *_ANSWERS):
        ids = getattr(ds, name)
        if ids is None:
            continue
        if name in _ANSWERS:
            if ids.numel() and int(ids.min()) < -1:
                sample = int((ids < -1).nonzero()[0, 0])
                raise DataError(
                    f"dataset.path={str(p)!r}: {name} of record {sample} holds the negative id "
                    f"{int(ids[sample].min())}; answer ids are >= 0 (-1 only pads a shorter row)"
                )
            ids = ids.clamp(min=0)
        try:
            tk._check_ids(ids, vocab_size, p)
        except DataError as e:
            raise DataError(str(e).replace(" at sample ", f" in {name} at record ", 1)) from None


# --- .jsonl -----------------------------------------------------------------------------------


def _jsonl(p: Path, cfg, model_cfg, pad_token_id: int | None) -> PairDataset:
    """Halves tokenized with the tokenizer's special tokens, padded to the file's longest pair."""
    where = f"dataset.path={str(p)!r}"
    try:
        lines = p.read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError as e:
        raise DataError(f"{where} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    texts, extras, at = [], [], []  # at: the line number of each record, for messages
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        halves = [tx._jsonl_text(n, line, k, where, _JSONL) for k in ("clean", "corrupt")]
        if None in halves:
            half = "clean" if halves[0] is None else "corrupt"
            raise DataError(f"{where}: line {n}: {half!r} is null; {_JSONL}")
        record = json.loads(line)  # known good: _jsonl_text parsed it
        texts.append(halves)
        extras.append({k: record[k] for k in _ANSWERS if k in record})
        at.append(n)
    if not texts:
        raise DataError(f"{where} holds no pairs; {_JSONL}")
    tok = tx._tokenizer(cfg.tokenizer or model_cfg.name, cfg.tokenizer is not None)
    clean = tok([t[0] for t in texts], add_special_tokens=True)["input_ids"]
    corrupt = tok([t[1] for t in texts], add_special_tokens=True)["input_ids"]
    for i, (a, b) in enumerate(zip(clean, corrupt, strict=True)):
        if len(a) != len(b):
            rec = f"{where}: record {i} (line {at[i]})"
            raise DataError(_UNEQUAL.format(rec, len(a), len(b), "reword one half"))
        if not a:
            raise DataError(f"{where}: record {i} (line {at[i]}) gives no tokens; give text")
    pad = next((t for t in (pad_token_id, tok.pad_token_id, tok.eos_token_id) if t is not None), 0)
    width = max(len(a) for a in clean)
    ids, mask = tk._right_pad(clean, pad, width)
    answers = [_jsonl_answers(k, extras, at, tok, where) for k in _ANSWERS]
    return PairDataset(ids, tk._right_pad(corrupt, pad, width)[0], mask, *answers)


def _jsonl_answers(key: str, extras, at, tok, where: str) -> torch.Tensor | None:
    """(N, K) ids, -1-padded to the most any record has; None where no record has `key`."""
    has = [key in e for e in extras]
    if not any(has):
        return None
    if not all(has):
        i = has.index(False)
        raise DataError(
            f"{where}: record {i} (line {at[i]}) has no {key!r} but other lines do; give {key} "
            "on every line or on none"
        )
    values = [e[key] if isinstance(e[key], list) else [e[key]] for e in extras]
    strings = sorted({v for vs in values for v in vs if isinstance(v, str)})
    ids = tok(strings, add_special_tokens=False)["input_ids"] if strings else []
    pieces = dict(zip(strings, ids, strict=True))
    rows = []
    for i, vs in enumerate(values):
        rec, row = f"{where}: record {i} (line {at[i]})", []
        if not vs:
            raise DataError(f"{rec}: {key} is an empty list; give at least one token")
        for v in vs:
            if isinstance(v, str) and len(pieces[v]) == 1:
                row.append(pieces[v][0])
            elif isinstance(v, str):
                raise DataError(
                    f"{rec}: {key} {v!r} is {len(pieces[v])} tokens "
                    f"{tok.convert_ids_to_tokens(pieces[v])}; an answer must be a single token: "
                    "give its id, or its text as the tokenizer splits it (GPT-2 style with the "
                    "leading space: ' Paris')"
                )
            elif isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63:
                row.append(v)
            else:
                raise DataError(
                    f"{rec}: {key} {v!r} is not a token; give a one-token string, an id >= 0, or "
                    "a list of them"
                )
        rows.append(row)
    return tk._right_pad(rows, -1, max(len(r) for r in rows))[0]


# --- .pt --------------------------------------------------------------------------------------


def _pt(p: Path, pad_token_id: int | None) -> PairDataset:
    """(N, T) halves as saved (int64; no mask: every token real), or lists of unpadded 1-D halves,
    padded here with a mask built from the lengths."""
    where = f"dataset.path={str(p)!r}"
    how = "torch.save({'clean_ids': ids, 'corrupt_ids': ids2, ...}, path)"
    try:
        obj = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:
        raise DataError(
            f"{where} is not a readable .pt file ({tk._first_line(e)}); {how}"
        ) from None
    if not isinstance(obj, dict) or not {"clean_ids", "corrupt_ids"} <= set(obj):
        keys = f" with keys {list(obj)}" if isinstance(obj, dict) else ""
        raise DataError(
            f"{where} holds a {type(obj).__name__}{keys}; expected a dict {{'clean_ids', "
            "'corrupt_ids', 'attention_mask'?, 'answer'?, 'wrong'?}: " + how
        )
    extra = sorted(set(obj) - set(_KEYS))
    if extra:
        raise DataError(f"{where} holds keys dataset=pairs does not use: {extra}; remove them")
    clean, corrupt, mask = obj["clean_ids"], obj["corrupt_ids"], obj.get("attention_mask")
    if isinstance(clean, list | tuple):
        clean, corrupt, mask = _ragged(clean, corrupt, mask, pad_token_id, where)
    clean = tk._integers(clean, where, "clean_ids")
    corrupt = tk._integers(corrupt, where, "corrupt_ids")
    if clean.ndim != 2 or 0 in clean.shape:
        raise DataError(
            f"{where}: clean_ids has shape {tuple(clean.shape)}; expected (N, T), N pairs of "
            "T tokens, both at least 1"
        )
    if corrupt.shape != clean.shape:
        raise DataError(
            f"{where}: clean_ids has shape {tuple(clean.shape)} but corrupt_ids "
            f"{tuple(corrupt.shape)}; patching needs halves of one shape (pad them alike)"
        )
    mask = torch.ones_like(clean) if mask is None else tk._mask(mask, where)
    if mask.shape != clean.shape:
        raise DataError(
            f"{where}: attention_mask has shape {tuple(mask.shape)} but clean_ids "
            f"{tuple(clean.shape)}; one (N, T) mask is shared by both halves"
        )
    answers = [_pt_answers(obj.get(k), k, len(clean), where) for k in _ANSWERS]
    return PairDataset(clean, corrupt, mask, *answers)


def _ragged(clean, corrupt, mask, pad_token_id: int | None, where: str):
    if not isinstance(corrupt, list | tuple) or len(corrupt) != len(clean) or mask is not None:
        raise DataError(
            f"{where}: clean_ids is a list of {len(clean)}; give corrupt_ids as a list of as many "
            "and no attention_mask (it is built from the lengths), or both as (N, T) tensors"
        )
    if not clean:
        raise DataError(f"{where}: clean_ids is an empty list; it holds no pairs")
    halves = [
        [tk._integers(r, where, f"{k}[{i}]") for i, r in enumerate(rows)]
        for k, rows in (("clean_ids", clean), ("corrupt_ids", corrupt))
    ]
    for i, (a, b) in enumerate(zip(*halves, strict=True)):
        if a.ndim != 1 or b.ndim != 1 or len(a) == 0:
            raise DataError(
                f"{where}: record {i} has shapes {tuple(a.shape)} and {tuple(b.shape)}; lists of "
                "clean_ids/corrupt_ids hold non-empty 1-D tensors"
            )
        if len(a) != len(b):
            rec = f"{where}: record {i}"
            raise DataError(_UNEQUAL.format(rec, len(a), len(b), "re-tokenize one half"))
    width = max(len(a) for a in halves[0])
    pad = 0 if pad_token_id is None else pad_token_id
    ids, mask = tk._right_pad(halves[0], pad, width)
    return ids, tk._right_pad(halves[1], pad, width)[0], mask


def _pt_answers(t, key: str, n: int, where: str) -> torch.Tensor | None:
    if t is None:
        return None
    t = tk._integers(t, where, key)
    if t.ndim not in (1, 2) or len(t) != n or (t.ndim == 2 and t.shape[1] == 0):
        raise DataError(
            f"{where}: {key} has shape {tuple(t.shape)} for {n} pairs; expected ({n},) or "
            f"({n}, K): one row of token ids per pair (-1 pads a shorter row)"
        )
    return t if t.ndim == 2 else t[:, None]
