"""Labelled text: a class per document and a label per whitespace-separated word, aligned to the
tokens of a WordPiece and a byte-level BPE tokenizer built here (words split into several
sub-tokens) and checked against the tokenizer's own word ids; `.pt` token labels with padding on
either side; and the errors that name the record."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import probe
from probe.errors import ConfigError, DataError
from probe.testing.tiny_lms import make_tiny_gpt2
from tests.helpers import run_probe

DOCS = [
    ("the cat sat unbelievable", ["DET", "NOUN", "VERB", "ADJ"], "pos"),
    ("dogs running played", ["NOUN", "VERB", "VERB"], "neg"),
    (
        "a dog sat on the unbelievable cats",
        ["DET", "NOUN", "VERB", "ADP", "DET", "ADJ", "NOUN"],
        "pos",
    ),
    ("running", ["VERB"], "neg"),
]


def wordpiece(dir):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ["the", "cat", "un", "##believ", "##able", "run", "##ning", "dog", "##s", "sat",
             "play", "##ed", "a", "on", "c", "##at"]  # fmt: skip
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", *words])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                   cls_token="[CLS]", sep_token="[SEP]")  # fmt: skip
    fast.save_pretrained(dir)
    return fast


def byte_bpe(dir):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    corpus = ["the cat sat on the mat", "a dog ran", "the dogs sat"] * 5
    bpe.train_from_iterator(corpus, vocab_size=280, min_frequency=1, special_tokens=["<eos>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<eos>",
                                   pad_token="<eos>", padding_side="left")  # fmt: skip
    fast.save_pretrained(dir)
    return fast


TOKENIZERS = {"wordpiece": wordpiece, "byte_bpe": byte_bpe}


def expected(tok, subtokens: str, seq_len: int):
    """Per document: ids and labels from the tokenizer's own word ids (these texts have no
    punctuation, so its words are the whitespace-separated ones)."""
    names = list(dict.fromkeys(tag for _, tags, _ in DOCS for tag in tags))
    out = []
    for text, tags, _ in DOCS:
        enc = tok(text, truncation=True, max_length=seq_len)
        labels, seen = [], set()
        for w in enc.word_ids():
            first = w is not None and w not in seen
            labels.append(
                names.index(tags[w]) if w is not None and (first or subtokens == "all") else -1
            )
            seen.add(w)
        out.append((enc["input_ids"], labels))
    return out, names


@pytest.fixture(scope="module")
def labelled_docs(tmp_path_factory):
    root = tmp_path_factory.mktemp("labels")
    path = root / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"text": t, "tags": g, "mood": m}) for t, g, m in DOCS))
    return root, path


@pytest.mark.parametrize("subtokens", ["first", "all"])
@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
def test_word_labels_land_on_their_tokens(labelled_docs, kind, subtokens, tmp_path):
    root, path = labelled_docs
    tok = TOKENIZERS[kind](tmp_path / "tok")
    docs, names = expected(tok, subtokens, 64)
    assert any(sum(1 for x in labels if x != -1) > len(DOCS[i][1]) or subtokens == "first"
               for i, (_, labels) in enumerate(docs))  # fmt: skip
    split = [len(ids) - sum(1 for s in tok(t)["input_ids"] if s in tok.all_special_ids) > len(w.split())
             for (ids, _), (t, w, _) in zip(docs, [(t, t, m) for t, _, m in DOCS], strict=True)]  # fmt: skip
    assert any(split)  # some word is several sub-tokens
    model = make_tiny_gpt2(tmp_path / "lm", vocab_size=len(tok))
    _, f = run_probe(tmp_path / "run", "model=hf", f"model.name={model}", "model.task=causal_lm",
                     "dataset=text", f"dataset.path={path}", f"dataset.tokenizer={tmp_path / 'tok'}",
                     "dataset.word_labels_field=tags", "dataset.label_field=mood",
                     f"dataset.label_subtokens={subtokens}", "dataset.seq_len=64",
                     "probes=residual")  # fmt: skip
    f.close()
    with probe.open_run(tmp_path / "run") as run:
        stored = run.file["tokens/label"][: run.num_tokens]
        ids = run.file["tokens/id"][: run.num_tokens]
        targets = run.file["samples/target"][: run.num_samples]
        classes = [c.decode() for c in run.file["dataset/class_names"][:]]
        label_names = [c.decode() for c in run.file["dataset/token_label_names"][:]]
        streamed = next(iter(run.dataset("transformer.h.0", batch_size=10_000, shuffle=False)))[1]
    np.testing.assert_array_equal(ids, np.concatenate([i for i, _ in docs]))
    np.testing.assert_array_equal(stored, np.concatenate([labels for _, labels in docs]))
    np.testing.assert_array_equal(streamed.numpy(), stored)  # the stream's labels: these rows'
    assert label_names == names and classes == ["pos", "neg"]
    np.testing.assert_array_equal(targets, [0, 1, 0, 1])


def test_token_labels_of_a_pt_file_with_padding_on_either_side(tmp_path):
    """Left-padded and right-padded rows: /tokens/label holds each real token's label, in
    order."""
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 0, 0], [4, 4, 4, 4, 4]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    labels = torch.tensor([[-1, -1, 2, 0, 1], [1, 1, 0, -1, -1], [0, 1, 2, 0, 1]])
    torch.save(
        {"input_ids": ids, "attention_mask": mask, "token_labels": labels}, tmp_path / "ids.pt"
    )
    _, f = run_probe(tmp_path / "run", "model=custom", "model._target_=probe.testing.models.TokenContext",
                     "dataset=tokens", f"dataset.path={tmp_path / 'ids.pt'}", "dataset.batch_size=2",
                     "+probes.t.layers=[lexical]", "+probes.t.rows=tokens", "probes=none")  # fmt: skip
    with f:
        np.testing.assert_array_equal(f["tokens/label"][:], labels[mask.bool()].numpy())
        np.testing.assert_array_equal(f["tokens/id"][:], ids[mask.bool()].numpy())


def test_label_errors_name_the_record_and_the_way_out(labelled_docs, tmp_path):
    from probe.data.token_sets import token_dataset
    from probe.plan import parse
    from probe.testing.compose import make_cfg

    root, _ = labelled_docs
    wordpiece(tmp_path / "tok")
    bad = root / "bad.jsonl"
    bad.write_text(json.dumps({"text": "the cat", "tags": ["DET", "NOUN"]}) + "\n"
                   + json.dumps({"text": "a dog sat", "tags": ["DET"]}))  # fmt: skip

    def build(path, *more):
        plan = parse(make_cfg("dataset=text", f"dataset.path={path}",
                              f"dataset.tokenizer={tmp_path / 'tok'}", *more))  # fmt: skip
        return token_dataset(plan.data, plan.model, 0, None, None)

    with pytest.raises(DataError) as e:
        build(bad, "dataset.word_labels_field=tags")
    assert "line 2" in str(e.value) and "3 whitespace-separated words but 1 labels" in str(e.value)
    with pytest.raises(DataError) as e:
        build(bad, "dataset.word_labels_field=pos")
    assert "'pos'" in str(e.value) and "line 1" in str(e.value)
    with pytest.raises(ConfigError) as e:
        build(bad, "dataset.word_labels_field=tags", "dataset.pack=true")
    assert "dataset.pack=false" in str(e.value)
    txt = root / "plain.txt"
    txt.write_text("the cat\n")
    with pytest.raises(DataError) as e:
        build(txt, "dataset.label_field=mood")
    assert ".jsonl or .parquet" in str(e.value)
    with pytest.raises(DataError) as e:
        build(bad, "dataset.word_labels_field=tags", "dataset.label_subtokens=last")
    assert "first or all" in str(e.value)


@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
def test_prepend_bos_moves_each_label_with_its_token(labelled_docs, kind, tmp_path):
    """dataset.prepend_bos: a row without a special token first gets one, labelled -1, and its
    tokens and labels shift by one (cut to seq_len); a row that has one is unchanged."""
    from probe.data.token_sets import token_dataset
    from probe.plan import DataSpec, ModelSpec

    _, path = labelled_docs
    tok = TOKENIZERS[kind](tmp_path / "tok")
    specials = set(tok.all_special_ids)
    model = ModelSpec(name="no-such-model", library="hf")

    def build(prepend_bos: bool):
        spec = DataSpec(name="text", path=str(path), tokenizer=str(tmp_path / "tok"), seq_len=6,
                        word_labels_field="tags", prepend_bos=prepend_bos)  # fmt: skip
        ds = token_dataset(spec, model, 0, None, None)[0]
        return [(i[m].tolist(), t[m].tolist()) for i, t, m in
                zip(ds.input_ids, ds.token_labels, ds.attention_mask.bool(), strict=True)]  # fmt: skip

    shifted = 0
    for (ids, labels), (plain, plain_labels) in zip(build(True), build(False), strict=True):
        if plain[0] in specials:
            assert (ids, labels) == (plain, plain_labels)
        else:
            shifted += 1
            assert ids == [ids[0], *plain[:5]] and ids[0] in specials
            assert labels == [-1, *plain_labels[:5]]
    assert shifted == (0 if kind == "wordpiece" else len(DOCS))
