"""dataset=pairs: clean/corrupt pairs from .jsonl text and .pt ids; real files, local tokenizers."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import DataLoader

from probe.data.pairs import pair_dataset
from probe.errors import ConfigError, DataError
from probe.plan import parse
from probe.testing.compose import make_cfg
from probe.testing.tiny_lms import make_tokenizer
from tests.helpers import padded

VOCAB = 32  # 4 specials + 28 words


def build(path, tok_dir=None, vocab_size=VOCAB, pad_token_id=None, **kw):
    """The pairs of `path` as a run reads them: the config parsed (probe.plan), then the file."""
    plan = parse(make_cfg("model=hf", f"model.name={tok_dir or 'no-such-model'}", "dataset=pairs",
                          f"dataset.path={path}", *(f"dataset.{k}={v}" for k, v in kw.items())))  # fmt: skip
    return pair_dataset(plan.data, plan.model, vocab_size, pad_token_id)


def jsonl(tmp_path, records, name="pairs.jsonl"):
    """Records as lines; a str record is written as the line itself (bad JSON, blank lines)."""
    path = tmp_path / name
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def save(tmp_path, obj, name="pairs.pt"):
    path = tmp_path / name
    torch.save(obj, path)
    return path


RECORDS = [
    {"clean": "the cat sat on the mat", "corrupt": "the dog sat on the mat", "answer": " mat",
     "wrong": "hat"},
    {"clean": "a dog ran", "corrupt": "a cat ran", "answer": 7, "wrong": ["cat", 13]},
    {"clean": "big red hat", "corrupt": "small blue hat", "answer": ["one", "two"], "wrong": 5},
]  # fmt: skip


# --- .jsonl -------------------------------------------------------------------------------------


def test_jsonl_string_id_and_list_answers(tmp_path, tok_dir, tok):
    ds = build(jsonl(tmp_path, RECORDS), tok_dir)
    clean = [tok.encode(r["clean"]) for r in RECORDS]
    corrupt = [tok.encode(r["corrupt"]) for r in RECORDS]
    ids, mask = padded(clean, tok.pad_token_id, 6)
    bad, mask2 = padded(corrupt, tok.pad_token_id, 6)
    one = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    (mat,), (hat,), (cat,), (n1,), (n2,) = map(one, [" mat", "hat", "cat", "one", "two"])
    assert torch.equal(ds.input_ids, ids) and torch.equal(ds.corrupt_ids, bad)
    assert torch.equal(ds.attention_mask, mask) and torch.equal(mask, mask2)
    assert torch.equal(ds.answer, torch.tensor([[mat, -1], [7, -1], [n1, n2]]))
    assert torch.equal(ds.wrong, torch.tensor([[hat, -1], [cat, 13], [5, -1]]))
    assert ds.targets is None and len(ds) == 3
    item = ds[1]
    assert set(item) == {"input_ids", "corrupt_ids", "attention_mask", "answer", "wrong"}
    assert all(t.dtype == torch.int64 for t in item.values())
    assert torch.equal(item["input_ids"], ids[1]) and torch.equal(item["wrong"], ds.wrong[1])


def test_jsonl_ragged_pairs_share_one_mask_and_pad_id(tmp_path, tok_dir, tok):
    records = [
        {"clean": "a cat", "corrupt": "a dog"},
        {"clean": "it was one", "corrupt": "it was two"},
    ]
    ds = build(jsonl(tmp_path, records), tok_dir, pad_token_id=2)  # the model's pad wins
    ids, mask = padded([tok.encode("a cat"), tok.encode("it was one")], 2, 3)
    bad, _ = padded([tok.encode("a dog"), tok.encode("it was two")], 2, 3)
    assert torch.equal(ds.input_ids, ids) and torch.equal(ds.corrupt_ids, bad)
    assert torch.equal(ds.attention_mask, mask) and ds.answer is None and ds.wrong is None
    assert set(ds[0]) == {"input_ids", "corrupt_ids", "attention_mask"}
    short = build(jsonl(tmp_path, records), tok_dir, num_samples=1)  # the file's width stays
    assert short.input_ids.shape == (1, 3) and short.input_ids[0, 2] == tok.pad_token_id


def test_jsonl_uses_the_tokenizers_special_tokens(tmp_path):
    tok_dir = make_tokenizer(tmp_path / "tok", specials=True)
    records = [{"clean": "the cat", "corrupt": "the dog", "answer": "sat"}]
    ds = build(jsonl(tmp_path, records), tok_dir)
    assert ds.input_ids.tolist() == [[3, 4, 6, 2]] and ds.corrupt_ids.tolist() == [[3, 4, 7, 2]]
    assert ds.answer.tolist() == [[8]]  # answers take no [BOS]/[EOS]


def test_gpt2_style_answers_keep_their_leading_space(tmp_path):
    """A byte-level BPE (GPT-2's scheme) trained here: ' Paris' is one token, 'Paris' two; it has
    no pad token, so pairs are padded with its EOS."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    text = ["The capital of France is Paris", "The capital of Italy is Rome"] * 20
    bpe.train_from_iterator(text, vocab_size=300, special_tokens=["<|endoftext|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>")
    tok.save_pretrained(tmp_path / "bpe")
    records = [
        {"clean": "The capital of France is", "corrupt": "The capital of Italy is",
         "answer": " Paris", "wrong": " Rome"},
        {"clean": "France", "corrupt": "Italy", "answer": " Paris", "wrong": " Rome"},
    ]  # fmt: skip
    ds = build(jsonl(tmp_path, records), tmp_path / "bpe", vocab_size=len(tok))
    (paris,), (rome,) = (tok.encode(s, add_special_tokens=False) for s in (" Paris", " Rome"))
    assert ds.answer.tolist() == [[paris], [paris]] and ds.wrong.tolist() == [[rome], [rome]]
    ids, mask = padded(
        [tok.encode(r["clean"]) for r in records], tok.eos_token_id, len(ds.input_ids[0])
    )
    assert tok.pad_token_id is None and torch.equal(ds.input_ids, ids)
    assert torch.equal(ds.attention_mask, mask) and mask[1].sum() < mask[0].sum()
    records[1]["answer"] = "Paris"
    pieces = tok.convert_ids_to_tokens(tok.encode("Paris", add_special_tokens=False))
    raises(DataError, [f"record 1 (line 2): answer 'Paris' is 2 tokens {pieces}", "' Paris'"],
           jsonl(tmp_path, records), tmp_path / "bpe")  # fmt: skip


def test_dataloader_collates_dicts(tmp_path, tok_dir):
    ds = build(jsonl(tmp_path, RECORDS), tok_dir)
    batches = list(DataLoader(ds, batch_size=2))
    assert [b["input_ids"].shape for b in batches] == [(2, 6), (1, 6)]
    first = batches[0]
    assert set(first) == {"input_ids", "corrupt_ids", "attention_mask", "answer", "wrong"}
    assert first["corrupt_ids"].shape == first["attention_mask"].shape == (2, 6)
    assert first["answer"].shape == (2, 2) and torch.equal(first["wrong"], ds.wrong[:2])


# --- .pt ----------------------------------------------------------------------------------------


def test_pt_round_trip(tmp_path, tok_dir):
    ds = build(jsonl(tmp_path, RECORDS), tok_dir)
    obj = {"clean_ids": ds.input_ids, "corrupt_ids": ds.corrupt_ids,
           "attention_mask": ds.attention_mask, "answer": ds.answer, "wrong": ds.wrong}  # fmt: skip
    back = build(save(tmp_path, obj))
    for k in ("input_ids", "corrupt_ids", "attention_mask", "answer", "wrong"):
        assert torch.equal(getattr(back, k), getattr(ds, k)), k
    assert back.targets is None


def test_pt_defaults_mask_and_answer_shape(tmp_path):
    clean = torch.randint(4, VOCAB, (3, 5), dtype=torch.int32)
    corrupt = clean.flip(1)
    ds = build(
        save(tmp_path, {"clean_ids": clean, "corrupt_ids": corrupt, "answer": torch.arange(3)})
    )
    assert ds.input_ids.dtype == torch.int64 and torch.equal(ds.input_ids, clean.long())
    assert torch.equal(ds.attention_mask, torch.ones(3, 5, dtype=torch.long))
    assert ds.answer.tolist() == [[0], [1], [2]] and ds.wrong is None
    assert ds[2]["answer"].shape == (1,)


def test_pt_ragged_lists_are_padded(tmp_path):
    clean = [torch.tensor([4, 5, 6]), torch.tensor([7])]
    corrupt = [torch.tensor([4, 5, 9]), torch.tensor([8])]
    ds = build(save(tmp_path, {"clean_ids": clean, "corrupt_ids": corrupt}), pad_token_id=0)
    assert ds.input_ids.tolist() == [[4, 5, 6], [7, 0, 0]]
    assert ds.corrupt_ids.tolist() == [[4, 5, 9], [8, 0, 0]]
    assert ds.attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]


# --- errors -------------------------------------------------------------------------------------


def raises(cls, words, path, tok_dir=None, **kw):
    with pytest.raises(cls) as e:
        build(path, tok_dir, **kw)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_config_and_file_errors(tmp_path, tok_dir):
    raises(DataError, ["does not exist", "give a .jsonl"], tmp_path / "nope.jsonl")
    raises(DataError, ["is a directory"], tmp_path)
    (tmp_path / "p.txt").write_text("the cat\n")
    raises(DataError, ["unsupported suffix '.txt'", ".jsonl", ".pt"], tmp_path / "p.txt")
    raises(ConfigError, ["num_samples=0", "at least 1"], jsonl(tmp_path, RECORDS), num_samples=0)
    with pytest.raises(ConfigError, match="needs dataset.path=FILE"):
        parse(make_cfg("model=hf", "model.name=x", "dataset=pairs"))
    raises(DataError, ["holds no pairs", "'clean'"], jsonl(tmp_path, ["", "  "]), tok_dir)
    (tmp_path / "empty.pt").write_bytes(b"")
    raises(DataError, ["not a readable .pt file", "torch.save"], tmp_path / "empty.pt")


@pytest.mark.parametrize(
    "records, words",
    [
        ([RECORDS[0], "{not json"], ["line 2 is not JSON", "one JSON object per line"]),
        ([RECORDS[0], "", {"clean": "a cat"}], ["line 3 has no field 'corrupt'", "'clean': TEXT"]),
        ([{"clean": None, "corrupt": "a"}], ["line 1", "'clean' is null"]),
        ([{"clean": 5, "corrupt": "a"}], ["line 1", "'clean' is a int, not text"]),
        (
            [RECORDS[0], "", {"clean": "a cat sat", "corrupt": "a big cat sat"}],
            ["record 1 (line 3): clean is 3 tokens, corrupt is 4", "equal length: reword one half"],
        ),
        ([{"clean": "", "corrupt": ""}], ["record 0 (line 1) gives no tokens"]),
        (
            [{"clean": "a", "corrupt": "the", "answer": "big cat"}],
            ["record 0 (line 1)", "answer 'big cat' is 2 tokens ['big', 'cat']", "single token"],
        ),
        ([{"clean": "a", "corrupt": "the", "wrong": ""}], ["wrong '' is 0 tokens []"]),
        ([{"clean": "a", "corrupt": "the", "answer": -3}], ["answer -3 is not a token", ">= 0"]),
        ([{"clean": "a", "corrupt": "the", "answer": [4, 1.5]}], ["answer 1.5 is not a token"]),
        ([{"clean": "a", "corrupt": "the", "answer": True}], ["answer True is not a token"]),
        ([{"clean": "a", "corrupt": "the", "answer": []}], ["answer is an empty list"]),
        (
            [{"clean": "a", "corrupt": "the", "answer": 4}, {"clean": "a", "corrupt": "the"}],
            ["record 1 (line 2) has no 'answer' but other lines do", "on every line or on none"],
        ),
        (
            [{"clean": "a", "corrupt": "the", "wrong": 40}],
            ["token id 40 in wrong at record 0", "vocabulary of 32"],
        ),
    ],
)
def test_jsonl_errors(tmp_path, tok_dir, records, words):
    raises(DataError, words, jsonl(tmp_path, records), tok_dir)


def test_jsonl_ids_beyond_a_smaller_vocabulary(tmp_path, tok_dir):
    path = jsonl(tmp_path, RECORDS)
    raises(DataError, ["token id 10 in input_ids at record 0", "vocabulary of 10"], path, tok_dir,
           vocab_size=10)  # fmt: skip


IDS = torch.tensor([[4, 5, 6], [7, 8, 9]])


@pytest.mark.parametrize(
    "obj, words",
    [
        (IDS, ["holds a Tensor", "'clean_ids'"]),
        ({"clean_ids": IDS}, ["with keys ['clean_ids']", "'corrupt_ids'"]),
        ({"clean_ids": IDS, "corrupt_ids": IDS, "labels": IDS}, ["does not use: ['labels']"]),
        (
            {"clean_ids": IDS, "corrupt_ids": IDS[:, :2]},
            ["(2, 3) but corrupt_ids (2, 2)", "one shape"],
        ),
        ({"clean_ids": IDS[0], "corrupt_ids": IDS[0]}, ["clean_ids has shape (3,)", "(N, T)"]),
        ({"clean_ids": IDS[:0], "corrupt_ids": IDS[:0]}, ["clean_ids has shape (0, 3)"]),
        (
            {"clean_ids": IDS.float(), "corrupt_ids": IDS},
            ["must be integers", "clean_ids is torch.float32"],
        ),
        (
            {"clean_ids": IDS, "corrupt_ids": IDS, "attention_mask": torch.ones(2, 2)},
            ["attention_mask has shape (2, 2) but clean_ids (2, 3)", "shared by both halves"],
        ),
        (
            {"clean_ids": IDS, "corrupt_ids": IDS, "attention_mask": torch.full((2, 3), 2)},
            ["values other than 0 and 1"],
        ),
        (
            {"clean_ids": IDS, "corrupt_ids": IDS, "answer": torch.arange(3)},
            ["answer has shape (3,) for 2 pairs", "expected (2,) or (2, K)"],
        ),
        (
            {"clean_ids": IDS, "corrupt_ids": IDS, "wrong": torch.tensor([[4], [-2]])},
            ["wrong of record 1 holds the negative id -2", "-1 only pads"],
        ),
        (
            {"clean_ids": IDS, "corrupt_ids": torch.tensor([[4, 5, 6], [7, 8, 99]])},
            ["token id 99 in corrupt_ids at record 1", "vocabulary of 32"],
        ),
        (
            {"clean_ids": IDS, "corrupt_ids": torch.tensor([[4, 5, 6], [7, -1, 9]])},
            ["token id -1 in corrupt_ids at record 1 is negative"],
        ),
        (
            {"clean_ids": [IDS[0], IDS[1]], "corrupt_ids": [IDS[0], IDS[1, :2]]},
            ["record 1: clean is 3 tokens, corrupt is 2", "equal length: re-tokenize one half"],
        ),
        ({"clean_ids": [IDS[0]], "corrupt_ids": IDS}, ["clean_ids is a list of 1", "as many"]),
        ({"clean_ids": [], "corrupt_ids": []}, ["clean_ids is an empty list"]),
    ],
)
def test_pt_errors(tmp_path, obj, words):
    raises(DataError, words, save(tmp_path, obj))
