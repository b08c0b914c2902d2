"""scripts/bench_fit_real_lm.py's data steps (the LM it trains and the fits it measures are in
docs/bench/fit_real_lm.md, not here): which docstring paragraphs count as prose, the tokenizer
trained twice on the same text is the same tokenizer and round-trips the text, the token stream
equals the saved tokenizer's own encoding with EOS after each paragraph, and the unigram
cross-entropy equals a numpy count."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_fit_real_lm.py"
_spec = importlib.util.spec_from_file_location("bench_fit_real_lm", SCRIPT)
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

DOCSTRING = """Return the number of items in the container, counting each one once.

    The count is taken when the call is made, so items added afterwards by
    another thread are not included in the value it returns.

    >>> len_of([1, 2, 3])
    3

    Args: container: the container whose items are counted by this function here

    Too short to keep.

    x = f(a_1[0]) + g(b_2[1]) * {k: v for k, v in pairs} # code, not prose at all
"""

PARAGRAPHS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps by the fire.",
    "A function returns a value; a generator yields many values, one at a time.",
    "Numbers such as 3.14 and 2.71 appear in text too, with commas, colons: and quotes.",
    "Every paragraph here is short, plain English, written for the tokenizer to learn from.",
] * 8


def test_prose_paragraphs_keeps_prose_unwrapped_and_drops_the_rest():
    assert bench.prose_paragraphs(DOCSTRING) == [
        "Return the number of items in the container, counting each one once.",
        "The count is taken when the call is made, so items added afterwards by another "
        "thread are not included in the value it returns.",
    ]


def test_tokenizer_is_deterministic_and_round_trips(tmp_path):
    from transformers import AutoTokenizer

    first = bench.train_tokenizer(PARAGRAPHS, 300, tmp_path / "a")
    second = bench.train_tokenizer(PARAGRAPHS, 300, tmp_path / "b")
    assert first.get_vocab() == second.get_vocab()
    loaded = AutoTokenizer.from_pretrained(tmp_path / "a")
    assert loaded.bos_token == loaded.eos_token == bench.SPECIAL
    assert loaded.all_special_ids == [loaded.eos_token_id]
    for text in PARAGRAPHS[:4]:
        ids = loaded(text, add_special_tokens=False)["input_ids"]
        assert ids == second(text, add_special_tokens=False)["input_ids"]
        assert loaded.decode(ids) == text
    stream = bench.token_stream(first, PARAGRAPHS[:3])
    expected = []
    for text in PARAGRAPHS[:3]:
        expected += loaded(text, add_special_tokens=False)["input_ids"] + [loaded.eos_token_id]
    assert stream.tolist() == expected


def test_unigram_cross_entropy_equals_a_numpy_count():
    rng = np.random.default_rng(0)
    train, held = rng.integers(0, 7, 200), rng.integers(0, 9, 50)
    counts = np.bincount(train, minlength=10) + 1.0
    expected = -np.log(counts[held] / counts.sum()).mean()
    got = bench.unigram_cross_entropy(torch.from_numpy(train), torch.from_numpy(held), 10)
    assert abs(got - expected) < 1e-12
