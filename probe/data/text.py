"""dataset=text: documents of a .txt, .jsonl or .parquet file tokenized by the model's (or a named)
tokenizer, one row per document or packed into full rows; with `dataset.label_field` and
`dataset.word_labels_field`, a class per document and a label per token (`probe.data.labels`).
"""

from __future__ import annotations

import json
from pathlib import Path

from probe.data.labels import fields, labelled, padded_labels
from probe.data.token_data import (
    TextSource,
    TokenDataset,
    _first_line,
    _right_pad,
    first_special_token,
    with_special_first,
)
from probe.errors import ConfigError, DataError

# what save_pretrained writes for a tokenizer (one of them at least), by tokenizer kind
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt",
                   "tokenizer.model", "spiece.model", "sentencepiece.bpe.model")  # fmt: skip
_CHUNK = 1024  # documents tokenized per call when packing (stop early once enough rows exist)


def text_dataset(p: Path, cfg, model_cfg, num_samples: int | None) -> TokenDataset:
    """Unpacked: one row per document (the tokenizer's own special tokens, cut to seq_len), padded to
    the longest row of the whole file, so a row does not change with num_samples. Packed: documents
    joined by EOS into rows of exactly seq_len. Text rows always carry an attention_mask. With
    `dataset.prepend_bos`, each row starts with a special token (first_special_token), as
    circuit-tracer's prompts do: an unpacked row whose first token is not special gets one (its
    document then cut to seq_len - 1 tokens); a packed row is the token and seq_len - 1 joined
    ids."""
    docs, lines = _documents(p, cfg.text_field)
    tok = _tokenizer(cfg.tokenizer or model_cfg.name, cfg.tokenizer is not None)
    source = TextSource(p, lines, str(cfg.tokenizer or model_cfg.name), cfg.seq_len)
    pad = next((t for t in (tok.pad_token_id, tok.eos_token_id) if t is not None), 0)
    T = cfg.seq_len
    names = [n for n in (cfg.label_field, cfg.word_labels_field) if n]
    special = first_special_token(tok) if cfg.prepend_bos else None
    if cfg.prepend_bos and special is None:
        raise ConfigError(
            f"dataset.prepend_bos=true, but the tokenizer {source.tokenizer!r} has no special "
            "token (no BOS, pad, EOS or other); set dataset.prepend_bos=false"
        )
    if not cfg.pack:  # (labels with pack=true are refused by probe.checks)
        records = fields(p, lines, names) if names else {}
        rows, token_rows, targets, classes, label_names = labelled(
            tok, docs, lines, records, cfg, p
        )
        if special is not None:
            specials = set(tok.all_special_ids)
            firsts = [bool(r) and r[0] in specials for r in rows]
            rows = [with_special_first(r, special, specials, T) for r in rows]
            if token_rows is not None:  # (a token's label moves with it)
                token_rows = [
                    t if first else [-1, *t[: T - 1]]
                    for t, first in zip(token_rows, firsts, strict=True)
                ]
        if not any(rows):
            raise DataError(f"dataset.path={str(p)!r}: the documents give no tokens")
        width = max(len(r) for r in rows)  # (right-padded whatever the tokenizer's padding_side:
        ids, mask = _right_pad(rows, pad, width)  # a token keeps its unpadded position)
        token_labels = None if token_rows is None else padded_labels(token_rows, width)
        source = TextSource(p, lines, source.tokenizer, T, class_names=classes,
                            label_names=label_names, prefix=int(special is not None))  # fmt: skip
        return TokenDataset(ids, mask, targets, source, token_labels)
    flat: list[int] = []
    starts: list[int] = []
    lead = [] if special is None else [special]  # (special is None: not cfg.prepend_bos)
    step = T - len(lead)  # joined ids per row
    need = None if num_samples is None else num_samples * step
    for start in range(0, len(docs), _CHUNK):
        chunk = docs[start : start + _CHUNK]
        for doc in tok(chunk, add_special_tokens=False, verbose=False)["input_ids"]:
            if flat and tok.eos_token_id is not None:
                flat.append(tok.eos_token_id)
            starts.append(len(flat))
            flat.extend(doc)
        if need is not None and len(flat) >= need:
            break
    if not flat:
        raise DataError(f"dataset.path={str(p)!r}: the documents give no tokens")
    rows = [[*lead, *flat[i : i + step]] for i in range(0, len(flat), step)]
    packed = TextSource(p, lines, source.tokenizer, T, starts, len(flat), prefix=len(lead))
    return TokenDataset(*_right_pad(rows, pad, T), None, packed)


def _documents(p: Path, field: str) -> tuple[list[str], list[int]]:
    """Non-empty documents: .txt lines, a field of .jsonl records, a column of .parquet; and the
    0-based line (or row) of each."""
    where, suffix = f"dataset.path={str(p)!r}", p.suffix.lower()
    way_out = f"name the field holding the text with dataset.text_field=... (now {field!r})"
    if suffix == ".parquet":
        values = _parquet_column(p, field, where, way_out)
    else:
        try:
            lines = p.read_text(encoding="utf-8").split("\n")
        except UnicodeDecodeError as e:
            raise DataError(f"{where} is not UTF-8 text ({e.reason} at byte {e.start})") from None
        values = [
            line.rstrip("\r") if suffix == ".txt" else _jsonl_text(n, line, field, where, way_out)
            for n, line in enumerate(lines, 1)
        ]
    kept = [n for n, v in enumerate(values) if v is not None and v.strip()]
    docs = [values[n] for n in kept]
    if not docs:
        raise DataError(
            f"{where} holds no documents; give one document per non-empty line (.txt), one JSON "
            "object per line (.jsonl) or a text column (.parquet)"
        )
    return docs, kept


def _jsonl_text(n: int, line: str, field: str, where: str, way_out: str):
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(
            f"{where}: line {n} is not JSON ({e.msg}); a .jsonl file holds one JSON object per line"
        ) from None
    if not isinstance(record, dict):
        raise DataError(f"{where}: line {n} is a JSON {type(record).__name__}, not an object")
    if field not in record:
        raise DataError(
            f"{where}: line {n} has no field {field!r} (keys: {list(record)}); {way_out}"
        )
    return _text_value(record[field], f"{where}: line {n}", field)


def _text_value(value, where: str, field: str):
    if value is not None and not isinstance(value, str):
        raise DataError(f"{where}: {field!r} is a {type(value).__name__}, not text")
    return value


def _parquet_column(p: Path, field: str, where: str, way_out: str) -> list:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("reading .parquet needs pyarrow; pip install pyarrow") from None
    try:
        names = pq.read_schema(p).names
        values = (
            pq.read_table(p, columns=[field]).column(field).to_pylist() if field in names else None
        )
    except Exception as e:
        raise DataError(f"{where} is not a readable parquet file ({_first_line(e)})") from None
    if values is None:
        raise DataError(f"{where} has no column {field!r} (columns: {names}); {way_out}")
    return [_text_value(v, f"{where}: row {i}", field) for i, v in enumerate(values)]


def _tokenizer(name: str, named: bool):
    source = f"dataset.tokenizer={name!r}" if named else f"model.name={name!r} (as tokenizer)"
    folder = Path(str(name)).expanduser()
    if folder.is_dir() and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        # transformers would build an empty tokenizer from a model's config.json alone (checked
        # before transformers is imported: the import alone costs seconds)
        raise ConfigError(
            f"{source} is a folder without tokenizer files "
            f"({', '.join(TOKENIZER_FILES[:3])}, ...); set dataset.tokenizer to a local directory saved with tokenizer.save_pretrained(DIR)"
        )
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError("dataset=text needs transformers; pip install -e '.[hf]'") from None
    try:
        return AutoTokenizer.from_pretrained(str(name))
    except Exception as e:
        raise ConfigError(
            f"{source} cannot be loaded ({_first_line(e)}); set dataset.tokenizer to a local "
            "directory saved with tokenizer.save_pretrained(DIR)"
        ) from None
