"""Token datasets: .pt ids, tokenized text, random ids; real files in tmp_path, a local tokenizer."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch.utils.data import DataLoader

from probe.data.token_sets import token_dataset
from probe.errors import ConfigError, DataError
from probe.plan import DataSpec, ModelSpec, parse
from probe.testing.compose import make_cfg
from probe.testing.tiny_lms import make_tokenizer
from tests.helpers import padded

DOCS = ["the cat sat on the mat", "a dog ran", "big red hat and then it was one two three four"]


def build(name, vocab_size=None, pad_token_id=None, model="no-such-model", seed=0, **kw):
    """The dataset the builder makes of these keys (what the config alone decides is checked
    by the parse: `checked`)."""
    data, model = DataSpec(name=name, **kw), ModelSpec(name=model, library="hf")
    return token_dataset(data, model, seed, vocab_size, pad_token_id)


def checked(name, **kw) -> DataSpec:
    """dataset.* as probe.plan.parse makes and checks them from the composed config."""
    keys = [f"dataset.{k}={v}" for k, v in kw.items()]
    return parse(make_cfg("model=hf", "model.name=no-such-model", f"dataset={name}", *keys)).data


def save(tmp_path, obj, name="ids.pt"):
    path = tmp_path / name
    torch.save(obj, path)
    return str(path)


# --- dataset=tokens ---------------------------------------------------------------------------


def test_tokens_tensor_stays_int64_without_mask_or_targets(tmp_path):
    ids = torch.arange(20, dtype=torch.int32).reshape(4, 5)
    ds, has_targets = build("tokens", path=save(tmp_path, ids), vocab_size=20)
    assert not has_targets and ds.attention_mask is None and ds.targets is None
    assert ds.input_ids.dtype == torch.int64 and torch.equal(ds.input_ids, ids.long())
    assert set(ds[2]) == {"input_ids"} and torch.equal(ds[2]["input_ids"], ids[2].long())
    assert ds[2]["input_ids"].dtype == torch.int64


def test_tokens_dict_keeps_mask_and_labels(tmp_path):
    ids = torch.randint(50, (5, 6))
    mask = torch.ones(5, 6, dtype=torch.bool)
    mask[1, 4:] = False
    labels = torch.arange(5)
    obj = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    ds, has_targets = build("tokens", path=save(tmp_path, obj), vocab_size=50)
    assert has_targets and torch.equal(ds.targets, labels)
    assert ds.attention_mask.dtype == torch.int64 and torch.equal(ds.attention_mask, mask.long())
    inputs, target = ds[1]
    assert torch.equal(inputs["attention_mask"], torch.tensor([1, 1, 1, 1, 0, 0])) and target == 1
    per_token = {"input_ids": ids, "targets": ids.roll(-1, 1)}
    ds, has_targets = build("tokens", path=save(tmp_path, per_token, "lm.pt"))
    assert has_targets and torch.equal(ds.targets, ids.roll(-1, 1))


def test_tokens_ragged_list_is_right_padded_with_mask(tmp_path):
    rows = [[5, 6, 7], [8], [9, 10, 11, 12]]
    path = save(tmp_path, {"input_ids": [torch.tensor(r) for r in rows]})
    ds, _ = build("tokens", path=path, pad_token_id=3)
    want_ids, want_mask = padded(rows, 3, 4)
    assert torch.equal(ds.input_ids, want_ids) and torch.equal(ds.attention_mask, want_mask)
    ds, _ = build("tokens", path=path)  # no pad id known: 0
    assert torch.equal(ds.input_ids, padded(rows, 0, 4)[0])


def test_tokens_num_samples_cuts_every_tensor(tmp_path):
    obj = {
        "input_ids": torch.randint(9, (7, 3)),
        "attention_mask": torch.ones(7, 3),
        "labels": torch.arange(7),
    }
    ds, _ = build("tokens", path=save(tmp_path, obj), num_samples=4)
    assert len(ds) == 4 and ds.input_ids.shape == (4, 3) and ds.attention_mask.shape == (4, 3)
    assert torch.equal(ds.targets, torch.arange(4))


def test_dataloader_stacks_dict_batches(tmp_path):
    obj = {
        "input_ids": torch.randint(9, (7, 5)),
        "attention_mask": torch.ones(7, 5, dtype=torch.long),
        "labels": torch.arange(7),
    }
    ds, _ = build("tokens", path=save(tmp_path, obj))
    inputs, targets = next(iter(DataLoader(ds, batch_size=3)))
    assert inputs["input_ids"].shape == (3, 5) and inputs["attention_mask"].shape == (3, 5)
    assert inputs["input_ids"].dtype == torch.int64 and torch.equal(targets, torch.arange(3))
    ds, _ = build("random_tokens", vocab_size=11, seq_len=4, num_samples=5)
    batches = list(DataLoader(ds, batch_size=3))
    assert [tuple(b["input_ids"].shape) for b in batches] == [(3, 4), (2, 4)]


@pytest.mark.parametrize(
    ("obj", "kw", "words"),
    [
        (torch.rand(2, 3), {}, ["token ids must be integers", "float32"]),
        (torch.arange(4), {}, ["shape (4,)", "(N, T)", "unsqueeze(0)"]),
        (torch.zeros(2, 3, 4, dtype=torch.long), {}, ["shape (2, 3, 4)"]),
        (
            {"input_ids": torch.zeros(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 4)},
            {},
            ["attention_mask has shape (2, 4)", "(2, 3)"],
        ),
        (
            {"input_ids": torch.zeros(3, 2, dtype=torch.long), "labels": torch.arange(2)},
            {},
            ["3 samples", "labels of shape (2,)"],
        ),
        (torch.tensor([[1, 2], [3, -4]]), {}, ["token id -4 at sample 1", "negative"]),
        (
            torch.tensor([[1, 2], [3, 4], [5, 6], [7, 70000]]),
            {"vocab_size": 50257},
            [
                "token id 70000 at sample 3 is beyond the model's vocabulary of 50257",
                "dataset.tokenizer",
                "model.name",
            ],
        ),
        ({"inputs": torch.zeros(2, 3, dtype=torch.long)}, {}, ["keys ['inputs']", "input_ids"]),
        (
            {"input_ids": torch.zeros(2, 3, dtype=torch.long), "token_type_ids": torch.zeros(2, 3)},
            {},
            ["['token_type_ids']"],
        ),
        (
            {"input_ids": [torch.tensor([1, 2]), torch.tensor([0.5])]},
            {},
            ["input_ids[1]", "must be integers"],
        ),
        (
            {
                "input_ids": torch.zeros(2, 2, dtype=torch.long),
                "attention_mask": torch.full((2, 2), 2),
            },
            {},
            ["other than 0 and 1"],
        ),
    ],
)
def test_tokens_file_errors_name_the_bad_value(tmp_path, obj, kw, words):
    path = save(tmp_path, obj)
    with pytest.raises(DataError) as e:
        build("tokens", path=path, **kw)
    assert path in str(e.value)
    for w in words:
        assert w in str(e.value)


def test_tokens_missing_directory_and_unreadable_files(tmp_path):
    for path, words in [
        (tmp_path / "nope.pt", "does not exist"),
        (tmp_path, "is a directory"),
    ]:
        with pytest.raises(DataError, match=words) as e:
            checked("tokens", path=str(path))
        assert str(path) in str(e.value)
    junk = tmp_path / "junk.pt"
    junk.write_text("not a pickle")
    with pytest.raises(DataError, match="not a readable .pt file"):
        build("tokens", path=str(junk))
    if os.geteuid() != 0:
        locked = save(tmp_path, torch.zeros(1, 1, dtype=torch.long), "locked.pt")
        os.chmod(locked, 0)
        with pytest.raises(DataError, match="permission denied"):
            checked("tokens", path=locked)
    with pytest.raises(ConfigError, match="dataset.path=FILE"):
        checked("tokens")
    with pytest.raises(ConfigError, match="dataset.num_samples=0"):
        checked("tokens", path=str(junk), num_samples=0)


# --- dataset=text -----------------------------------------------------------------------------


def write_docs(tmp_path, suffix, docs=DOCS, field="text"):
    path = tmp_path / f"docs{suffix}"
    if suffix == ".txt":
        path.write_text("\n".join(docs[:1] + ["", "   "] + docs[1:]) + "\n")
    elif suffix == ".jsonl":
        path.write_text(
            "\n".join(json.dumps({field: d, "id": i}) for i, d in enumerate(docs)) + "\n"
        )
    else:
        import pandas as pd

        pd.DataFrame({field: docs, "id": range(len(docs))}).to_parquet(path)
    return str(path)


@pytest.mark.parametrize("suffix", [".txt", ".jsonl", ".parquet"])
def test_text_unpacked_equals_the_tokenizer(tmp_path, tok_dir, tok, suffix):
    ds, has_targets = build(
        "text", path=write_docs(tmp_path, suffix), tokenizer=str(tok_dir), seq_len=8
    )
    rows = [tok.encode(d)[:8] for d in DOCS]
    assert rows[0] == [4, 6, 8, 10, 4, 12]  # the, cat, sat, on, the, mat
    want_ids, want_mask = padded(rows, tok.pad_token_id, 8)  # the longest row is cut to 8
    assert not has_targets
    assert torch.equal(ds.input_ids, want_ids) and torch.equal(ds.attention_mask, want_mask)


def test_text_unpacked_pads_to_the_longest_row_and_keeps_special_tokens(tmp_path):
    tok_dir = make_tokenizer(tmp_path / "tok", specials=True)
    path = write_docs(tmp_path, ".txt")
    ds, _ = build("text", path=path, tokenizer=str(tok_dir), seq_len=64)
    assert ds.input_ids.shape == (3, 13)  # 11 words + [BOS] + [EOS]
    assert ds.input_ids[1, :5].tolist() == [3, 5, 7, 9, 2]  # [BOS] a dog ran [EOS]
    ds, _ = build("text", path=path, tokenizer=str(tok_dir), seq_len=4)
    assert ds.input_ids[2].tolist() == [
        3,
        14,
        15,
        2,
    ]  # [BOS] big red [EOS]: cut to 4, the specials kept
    ds, _ = build("text", path=path, tokenizer=str(tok_dir), seq_len=64, num_samples=2)
    assert ds.input_ids.shape == (2, 13)  # the width does not depend on num_samples


@pytest.mark.parametrize("specials", [False, True])
def test_text_packed_joins_documents_with_eos(tmp_path, tok, specials):
    tok_dir = make_tokenizer(tmp_path / "tok", specials=specials)
    flat = []
    for d in DOCS:  # no [BOS]: packed text is tokenized without special tokens
        flat += ([tok.eos_token_id] if flat else []) + tok.encode(d, add_special_tokens=False)
    assert len(flat) == 6 + 3 + 11 + 2
    path = write_docs(tmp_path, ".jsonl")
    ds, _ = build("text", path=path, tokenizer=str(tok_dir), seq_len=5, pack=True)
    rows = [flat[i : i + 5] for i in range(0, len(flat), 5)]
    want_ids, want_mask = padded(rows, tok.pad_token_id, 5)
    assert torch.equal(ds.input_ids, want_ids) and torch.equal(ds.attention_mask, want_mask)
    ds, _ = build("text", path=path, tokenizer=str(tok_dir), seq_len=5, pack=True, num_samples=2)
    assert torch.equal(ds.input_ids, want_ids[:2])


@pytest.mark.parametrize("specials", [False, True])
def test_text_prepend_bos_starts_each_row_with_a_special_token(tmp_path, specials):
    """Unpacked: [BOS] + the document cut to seq_len - 1, unless the tokenizer put a special token
    first already; word labels move with their tokens. Packed: test_provenance."""
    tok_dir = make_tokenizer(tmp_path / "tok", specials=specials)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    path = write_docs(tmp_path, ".txt")
    ds, _ = build("text", path=path, tokenizer=str(tok_dir), seq_len=8, prepend_bos=True)
    plain, _ = build("text", path=path, tokenizer=str(tok_dir), seq_len=8)
    if specials:  # rows start with [BOS] already: nothing changes
        assert torch.equal(ds.input_ids, plain.input_ids)
    else:
        rows = [[tok.bos_token_id, *tok.encode(d)[:7]] for d in DOCS]
        want_ids, want_mask = padded(rows, tok.pad_token_id, 8)
        assert torch.equal(ds.input_ids, want_ids) and torch.equal(ds.attention_mask, want_mask)
    with pytest.raises(ConfigError, match="dataset.prepend_bos=true applies to dataset=text"):
        checked("tokens", path=save(tmp_path, torch.ones(2, 3, dtype=torch.long)),
                prepend_bos="true")  # fmt: skip
    with pytest.raises(ConfigError, match="dataset.seq_len=1 with dataset.prepend_bos=true"):
        checked("text", path=path, seq_len=1, prepend_bos="true", pack="true")


def test_text_falls_back_to_the_model_name_for_the_tokenizer(tmp_path, tok_dir, tok):
    ds, _ = build("text", path=write_docs(tmp_path, ".txt"), model=str(tok_dir), seq_len=3)
    assert ds.input_ids[1].tolist() == tok.encode(DOCS[1])


def test_text_id_beyond_the_model_vocabulary(tmp_path, tok_dir):
    with pytest.raises(DataError, match="beyond the model's vocabulary of 10"):
        build("text", path=write_docs(tmp_path, ".txt"), tokenizer=str(tok_dir), vocab_size=10)


def test_text_errors_name_the_bad_value(tmp_path, tok_dir):
    def fails(error, path, *words, parse=False, **kw):
        with pytest.raises(error) as e:
            (checked if parse else build)("text", path=str(path), tokenizer=str(tok_dir), **kw)
        for w in words:
            assert w in str(e.value), str(e.value)

    fails(DataError, tmp_path / "nope.txt", "nope.txt", "does not exist", parse=True)
    csv = tmp_path / "docs.csv"
    csv.write_text("text\nthe cat\n")
    fails(DataError, csv, "'.csv'", ".txt, .jsonl, .parquet", parse=True)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "the cat"}\n{"text": oops}\n')
    fails(DataError, bad, "line 2 is not JSON")
    other = write_docs(tmp_path, ".jsonl", field="body")
    fails(DataError, other, "line 1 has no field 'text'", "['body', 'id']", "dataset.text_field=")
    parquet = write_docs(tmp_path, ".parquet", field="body")
    fails(DataError, parquet, "no column 'text'", "['body', 'id']", "dataset.text_field=")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    fails(DataError, empty, "holds no documents")
    fails(ConfigError, write_docs(tmp_path, ".txt"), "dataset.seq_len=0", seq_len=0, parse=True)
    with pytest.raises(ConfigError) as e:
        build("text", path=write_docs(tmp_path, ".txt"), tokenizer=str(tmp_path / "no-tok"))
    assert "dataset.tokenizer=" in str(e.value) and "save_pretrained" in str(e.value)
    assert "no-tok" in str(e.value)


# --- dataset=random_tokens --------------------------------------------------------------------


def test_random_tokens_depend_only_on_seed_and_row(tmp_path):
    short, has_targets = build("random_tokens", vocab_size=100, seq_len=6, num_samples=3, seed=7)
    long, _ = build("random_tokens", vocab_size=100, seq_len=6, num_samples=9, seed=7)
    again, _ = build("random_tokens", vocab_size=100, seq_len=6, num_samples=9, seed=7)
    other, _ = build("random_tokens", vocab_size=100, seq_len=6, num_samples=9, seed=8)
    assert not has_targets and short.attention_mask is None and short.targets is None
    assert len(short) == 3 and len(long) == 9 and set(long[0]) == {"input_ids"}
    assert torch.equal(long.input_ids[:3], short.input_ids)
    assert torch.equal(long.input_ids, again.input_ids)
    assert not torch.equal(long.input_ids, other.input_ids)
    assert long.input_ids.dtype == torch.int64 and long.input_ids.shape == (9, 6)
    assert int(long.input_ids.min()) >= 0 and int(long.input_ids.max()) < 100
    default, _ = build("random_tokens", vocab_size=100, seq_len=6)
    assert len(default) == 16


def test_random_tokens_vocabulary(tmp_path):
    with pytest.raises(ConfigError, match="dataset.vocab_size"):
        build("random_tokens", seq_len=4)  # neither the config nor the model gives one
    cfg_vocab = checked("random_tokens", vocab_size=5, seq_len=50)
    ds, _ = token_dataset(cfg_vocab, ModelSpec(name="m"), 0, 1000, None)
    assert int(ds.input_ids.max()) < 5
    with pytest.raises(ConfigError, match="beyond the model's vocabulary of 3"):
        token_dataset(cfg_vocab, ModelSpec(name="m"), 0, 3, None)
    with pytest.raises(ConfigError, match="dataset.seq_len=0"):
        checked("random_tokens", vocab_size=5, seq_len=0)


def test_tokens_lists_as_a_tokenizer_returns_them(tmp_path):
    """`dict(tok(texts))` without return_tensors: lists of lists for ids and mask."""
    rows = [[5, 6, 7], [8]]
    obj = {"input_ids": rows, "attention_mask": [[1, 1, 1], [1]], "labels": torch.tensor([0, 1])}
    ds, has_targets = build("tokens", path=save(tmp_path, obj), pad_token_id=0)
    want_ids, want_mask = padded(rows, 0, 3)
    assert has_targets and torch.equal(ds.input_ids, want_ids)
    assert torch.equal(ds.attention_mask, want_mask)
    with pytest.raises(DataError, match=r"input_ids\[1\] has shape \(1,\)"):
        build(
            "tokens",
            path=save(tmp_path, {"input_ids": rows, "attention_mask": [[1, 1, 1], [1, 1]]}),
        )


@pytest.mark.parametrize("name", ["tokens", "text", "random_tokens"])
def test_config_files_compose(name):
    from probe.testing.compose import make_cfg

    cfg = make_cfg(f"dataset={name}", "dataset.path=x")
    assert cfg.dataset.name == name and cfg.dataset.batch_size == 8
    assert cfg.dataset.seq_len == 128 and cfg.dataset.num_samples == (
        16 if name == "random_tokens" else None
    )


def test_a_folder_without_tokenizer_files_is_refused_before_transformers_loads(
    tmp_path, monkeypatch
):
    """The folder check needs no transformers (its import costs a fit seconds where the run's
    model folder holds no tokenizer): with transformers unimportable the error is still the
    folder's, and a folder with a tokenizer file reaches the import."""
    import sys

    from probe.data.text import _tokenizer

    monkeypatch.setitem(sys.modules, "transformers", None)  # (an import of it raises)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="is a folder without tokenizer files"):
        _tokenizer(str(tmp_path), False)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match="needs transformers"):
        _tokenizer(str(tmp_path), False)
