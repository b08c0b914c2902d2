"""Shared fixtures of the analysis tests: a tiny GPT-2's run of MLP rows that the transcoder
fits (per-layer and cross-layer) read."""

from __future__ import annotations

import pytest
import torch

from probe.testing.tiny_lms import make_tiny, make_tokenizer
from tests.helpers import run_probe


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    """A tiny GPT-2's MLP inputs and outputs and ln_2 inputs, 128 x 32 token rows."""
    root = tmp_path_factory.mktemp("fit")
    model = make_tokenizer(make_tiny("gpt2", root / "gpt2", vocab_size=50))  # (specials: ids 0-3)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (128, 32), generator=g)  # (0-3: the tokenizer's special tokens)
    torch.save({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, root / "ids.pt")
    _, f = run_probe(root / "run", "model=hf", f"model.name={model}", "model.task=causal_lm",
                     "dataset=tokens", f"dataset.path={root / 'ids.pt'}", "dataset.batch_size=64",
                     "probes=none", "+probes.tc.layers=[@blocks.mlp,@blocks.ln_2]",
                     "+probes.tc.capture=[input,output]", "+probes.tc.rows=tokens",
                     "+probes.tc.match=any")  # fmt: skip
    f.close()
    return root / "run"
