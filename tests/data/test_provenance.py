"""probe.data.provenance: what names a dataset and its samples, checked against the files the tests
write (torchvision's own ImageFolder listing, hashlib over the file, the documents written)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import numpy as np
import pytest
import torch
from torch.utils.data import Subset

from probe.data import provenance
from probe.data.batches import build_batches
from probe.data.provenance import describe
from probe.plan import DataSpec, ModelSpec
from tests.helpers import image_folder

DOCS = ["the cat sat on the mat", "a dog ran", "big red hat and then it was one two three four"]


def configs(name, **kw):
    return DataSpec(name=name, **kw), ModelSpec(name="no-such-model", library="hf")


def built(name, **kw):
    cfg, model_cfg = configs(name, **kw)
    return cfg, build_batches(cfg, model_cfg, seed=0)


def sha256(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


# --- imagefolder ------------------------------------------------------------------------------


@pytest.fixture
def image_root(tmp_path):
    return image_folder(tmp_path / "images")


def test_imagefolder_paths_and_classes_are_torchvisions(image_root):
    from torchvision.datasets import ImageFolder

    truth = ImageFolder(str(image_root))
    cfg, batches = built("imagefolder", root=str(image_root), resize=8, crop=8)
    p = describe(cfg, batches)
    index = np.arange(len(truth.samples))
    want = [os.path.relpath(path, image_root).replace(os.sep, "/") for path, _ in truth.samples]
    assert p.per_sample["path"](index).tolist() == want
    assert "cat/deep/two.png" in want
    assert p.lists == {"class_names": truth.classes} and truth.classes == ["ant", "cat", "zebra"]
    targets = torch.cat([b.targets for b in batches])
    assert targets.tolist() == [t for _, t in truth.samples]  # the batches are as before
    listing = sorted((rel, os.path.getsize(image_root / rel)) for rel in want)
    text = "".join(f"{rel}\t{n}\n" for rel, n in listing)
    assert p.identity == {
        "dataset": "imagefolder",
        "num_samples": 5,
        "root": str(image_root.resolve()),
        "images": 5,
        "classes": 3,
        "hash": hashlib.sha256(text.encode()).hexdigest(),
        "hash_of": "paths+sizes",
    }
    assert p.samples([4, 0])["path"].tolist() == [want[4], want[0]]


def test_imagefolder_num_samples_and_subsets_map_to_the_folder(image_root):
    cfg, batches = built("imagefolder", root=str(image_root), num_samples=3, resize=8, crop=8)
    assert isinstance(batches.dataset, Subset)
    p = describe(cfg, batches.dataset)
    whole = describe(*built("imagefolder", root=str(image_root), resize=8, crop=8))
    assert p.identity["num_samples"] == 3 and p.identity["images"] == 5
    assert p.identity["hash"] == whole.identity["hash"]  # the folder, not the cut, is hashed
    every = whole.per_sample["path"](np.arange(5))
    assert p.per_sample["path"](np.arange(3)).tolist() == every[:3].tolist()
    with pytest.raises(IndexError, match="sample index 3"):
        p.per_sample["path"](np.array([0, 3]))
    shuffled = describe(cfg, Subset(batches.dataset, [2, 0]))  # a Subset of a Subset
    assert shuffled.per_sample["path"](np.array([0, 1])).tolist() == [every[2], every[0]]
    with pytest.raises(IndexError):
        shuffled.per_sample["path"](np.array([-1]))


def test_a_changed_image_changes_the_folder_hash(image_root):
    before = describe(*built("imagefolder", root=str(image_root))).identity["hash"]
    with open(image_root / "ant" / "x.png", "ab") as f:
        f.write(b"\0")
    assert describe(*built("imagefolder", root=str(image_root))).identity["hash"] != before


# --- text -------------------------------------------------------------------------------------


def write_jsonl(tmp_path, ids):
    """DOCS as .jsonl, a blank line after the first record; `ids[i]` None leaves the id out."""
    records = [
        {"text": d} | ({} if i is None else {"id": i}) for d, i in zip(DOCS, ids, strict=True)
    ]
    lines = [json.dumps(r) for r in records]
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(lines[:1] + [""] + lines[1:]) + "\n")
    return path


def text(path, tok_dir, **kw):
    return built("text", path=str(path), tokenizer=str(tok_dir), **kw)


def test_text_rows_name_their_documents(tmp_path, tok_dir, tok):
    path = write_jsonl(tmp_path, ["doc-a", None, 7])
    cfg, batches = text(path, tok_dir, seq_len=8)
    p = describe(cfg, batches)
    names = p.per_sample["document"](np.arange(3)).tolist()
    assert names == ["doc-a", "docs.jsonl:3", "7"]  # no id: the file's line (1-based)
    written = {"doc-a": DOCS[0], "docs.jsonl:3": DOCS[1], "7": DOCS[2]}
    for row, name in zip(batches.dataset.input_ids, names, strict=True):
        want = tok.encode(written[name])[:8]
        assert row[: len(want)].tolist() == want
    assert p.identity == {
        "dataset": "text",
        "num_samples": 3,
        "path": str(path.resolve()),
        "bytes": path.stat().st_size,
        "hash": sha256(path),
        "hash_of": "content",
        "documents": 3,
        "tokenizer": str(tok_dir),
        "seq_len": 8,
        "pack": 0,
    }
    assert p.lists == {}


def test_text_txt_and_parquet_ids(tmp_path, tok_dir):
    txt = tmp_path / "docs.txt"
    txt.write_text("\n".join(DOCS[:1] + ["", "   "] + DOCS[1:]) + "\n")
    p = describe(*text(txt, tok_dir, num_samples=2))
    assert p.identity["num_samples"] == 2 and p.identity["documents"] == 3
    assert p.per_sample["document"](np.array([1, 0])).tolist() == ["docs.txt:4", "docs.txt:1"]
    with pytest.raises(IndexError):
        p.per_sample["document"](np.array([2]))  # beyond num_samples
    import pandas as pd

    pq = tmp_path / "docs.parquet"
    pd.DataFrame({"text": [DOCS[0], "", DOCS[1]], "id": ["x", "y", None]}).to_parquet(pq)
    p = describe(*text(pq, tok_dir))
    assert p.per_sample["document"](np.arange(2)).tolist() == ["x", "docs.parquet#2"]
    assert p.identity["hash"] == sha256(pq)
    bare = tmp_path / "bare.parquet"
    pd.DataFrame({"text": DOCS}).to_parquet(bare)
    p = describe(*text(bare, tok_dir))
    assert p.per_sample["document"](np.arange(3)).tolist() == [
        f"bare.parquet#{i}" for i in range(3)
    ]


@pytest.mark.parametrize("prepend_bos", [False, True])
def test_packed_rows_name_their_first_and_last_documents(tmp_path, tok_dir, tok, prepend_bos):
    """With dataset.prepend_bos each packed row is a special token and 4 joined ids."""
    path = write_jsonl(tmp_path, ["a", "b", "c"])
    flat, owner = [], []  # owner: the document of each joined token; EOS ends the one before
    for d, doc in enumerate(DOCS):
        if flat:
            flat.append(tok.eos_token_id)
            owner.append(owner[-1])
        ids = tok.encode(doc, add_special_tokens=False)
        flat += ids
        owner += [d] * len(ids)
    cfg, batches = text(path, tok_dir, seq_len=5, pack=True, prepend_bos=prepend_bos)
    n = 4 if prepend_bos else 5  # joined ids per row
    rows = range(0, len(flat), n)
    ids = batches.dataset.input_ids
    if prepend_bos:
        assert ids[:, 0].tolist() == [tok.bos_token_id] * len(rows)
        ids = ids[:, 1:]
    assert ids[:, 0].tolist() == [flat[i] for i in rows]
    p = describe(cfg, batches)
    index = np.arange(len(rows))
    first = ["abc"[owner[i]] for i in rows]
    last = ["abc"[owner[min(i + n, len(flat)) - 1]] for i in rows]
    want_first, want_last = (
        (["a", "a", "b", "c", "c", "c"], ["a", "b", "c", "c", "c", "c"])
        if prepend_bos
        else (["a", "a", "b", "c", "c"], ["a", "b", "c", "c", "c"])
    )
    assert p.per_sample["document"](index).tolist() == first == want_first
    assert p.per_sample["last_document"](index).tolist() == last == want_last
    assert p.identity["pack"] == 1 and p.identity.get("prepend_bos", 0) == int(prepend_bos)
    cut = describe(*text(path, tok_dir, seq_len=5, pack=True, num_samples=2,
                         prepend_bos=prepend_bos))  # fmt: skip
    assert cut.per_sample["document"](np.arange(2)).tolist() == first[:2]
    with pytest.raises(IndexError):
        cut.per_sample["document"](np.array([2]))


def test_large_files_are_named_by_size_and_mtime(tmp_path, tok_dir, monkeypatch):
    path = write_jsonl(tmp_path, [1, 2, 3])
    monkeypatch.setattr(provenance, "HASH_LIMIT", 10)
    p = describe(*text(path, tok_dir))
    st = path.stat()
    stamp = f"{st.st_size}:{st.st_mtime_ns}".encode()
    assert p.identity["hash_of"] == "size+mtime" and p.identity["mtime_ns"] == st.st_mtime_ns
    assert p.identity["hash"] == hashlib.sha256(stamp).hexdigest()


# --- files of tensors, generated data, a caller's batches ---------------------------------------


def test_tensor_and_token_files_are_hashed(tmp_path):
    x = tmp_path / "x.pt"
    torch.save({"inputs": torch.randn(5, 3), "targets": torch.arange(5)}, x)
    p = describe(*built("tensors", path=str(x), num_samples=4))
    assert p.identity == {
        "dataset": "tensors",
        "num_samples": 4,
        "path": str(x.resolve()),
        "bytes": x.stat().st_size,
        "hash": sha256(x),
        "hash_of": "content",
    }
    assert p.per_sample == {} and p.lists == {}
    ids = tmp_path / "ids.pt"
    torch.save(torch.arange(12).reshape(3, 4), ids)
    p = describe(*built("tokens", path=str(ids)))
    assert p.identity["hash"] == sha256(ids) and p.identity["num_samples"] == 3
    assert p.samples(np.arange(3)) == {}


def test_generated_data_is_named_by_its_parameters():
    cfg, model_cfg = configs("synthetic", num_samples=4, image_size=8, num_classes=5)
    p = describe(cfg, build_batches(cfg, model_cfg, seed=3))
    params = {"seed": 3, "shape": "3x8x8", "num_classes": 5}
    text = json.dumps({"generator": "synthetic", **params}, sort_keys=True)
    assert p.identity == {
        "dataset": "synthetic",
        "num_samples": 4,
        **params,
        "hash": hashlib.sha256(text.encode()).hexdigest(),
        "hash_of": "parameters",
    }
    longer = describe(
        cfg, build_batches(dataclasses.replace(cfg, num_samples=9), model_cfg, seed=3)
    )
    other = describe(cfg, build_batches(cfg, model_cfg, seed=4))
    assert longer.identity["hash"] == p.identity["hash"] != other.identity["hash"]
    cfg, model_cfg = configs("fakedata", num_samples=2, image_size=6, num_classes=3)
    fake = describe(cfg, build_batches(cfg, model_cfg, seed=2)).identity
    assert (fake["seed"], fake["shape"], fake["num_classes"]) == (2, "3x6x6", 3)
    cfg, model_cfg = configs("random_tokens", num_samples=3, seq_len=7, vocab_size=11)
    tokens = describe(cfg, build_batches(cfg, model_cfg, seed=5))
    assert {k: tokens.identity[k] for k in ("seed", "seq_len", "vocab_size", "num_samples")} == {
        "seed": 5,
        "seq_len": 7,
        "vocab_size": 11,
        "num_samples": 3,
    }
    assert tokens.per_sample == {}


def test_a_callers_batches_are_named_by_kind_alone():
    from probe.data.user_batches import UserBatches

    batches = UserBatches([torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(1, 3)])
    cfg = DataSpec(name="python", num_samples=batches.num_samples)
    assert describe(cfg, batches).identity == {"dataset": "python", "num_samples": 5}
    unknown = DataSpec(name="python")
    assert describe(unknown, iter([])).identity == {"dataset": "python"}
