"""A small transformer of its own family for the circuit tests, described to probe by
`model.anatomy` keys (OVERRIDES): `frozen=True` makes it linear in its residual stream (attention
patterns fixed, identity norms, a linear MLP), so that every answer metric linear in the logits is
linear in every receiver's input."""

from __future__ import annotations

import torch
from torch import nn

OVERRIDES = {
    "attn_norm": "ln_1", "mlp_norm": "ln_2", "qkv": ["attn.q", "attn.k", "attn.v"],
    "qkv_layout": "split", "attn_out": "attn.o", "mlp_out": "mlp", "final_norm": "ln_f",
    "unembed": "head", "heads": None,
}  # fmt: skip


def overrides(heads: int) -> dict:
    return {**OVERRIDES, "heads": heads}


class ToyAttention(nn.Module):
    def __init__(self, width: int, heads: int, frozen: bool, length: int = 16):
        super().__init__()
        self.heads, self.frozen = heads, frozen
        self.q, self.k = nn.Linear(width, width, bias=False), nn.Linear(width, width, bias=False)
        self.v, self.o = nn.Linear(width, width), nn.Linear(width, width)
        g = torch.Generator().manual_seed(width + heads)
        fixed = torch.rand(heads, length, length, generator=g).tril()
        self.register_buffer("pattern", fixed / fixed.sum(-1, keepdim=True))

    def forward(self, h):
        n, t, d = h.shape
        split = lambda x: x.view(n, t, self.heads, -1).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q(h)), split(self.k(h)), split(self.v(h))
        if self.frozen:
            pattern = self.pattern[:, :t, :t]
        else:
            scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
            causal = torch.ones(t, t, dtype=torch.bool, device=h.device).tril()
            pattern = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        z = (pattern @ v).transpose(1, 2).reshape(n, t, d)
        return self.o(z)


class ToyBlock(nn.Module):
    def __init__(self, width: int, heads: int, frozen: bool, norms: bool):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width) if norms else nn.Identity()
        self.attn = ToyAttention(width, heads, frozen)
        self.ln_2 = nn.LayerNorm(width) if norms else nn.Identity()
        act = nn.Identity() if frozen else nn.GELU()
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), act, nn.Linear(2 * width, width))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Toy(nn.Module):
    """Token and position embeddings, `layers` ToyBlocks, a final norm and an unembedding;
    `norms`: LayerNorms (default: unless frozen), else identities."""

    def __init__(self, vocab=12, width=16, layers=3, heads=2, frozen=False, seed=0, norms=None):
        super().__init__()
        norms = not frozen if norms is None else norms
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.embed, self.pos = nn.Embedding(vocab, width), nn.Embedding(16, width)
            self.blocks = nn.ModuleList(
                ToyBlock(width, heads, frozen, norms) for _ in range(layers)
            )
            self.ln_f = nn.LayerNorm(width) if norms else nn.Identity()
            self.head = nn.Linear(width, vocab)
        self.eval()

    def forward(self, input_ids):
        x = self.embed(input_ids) + self.pos(torch.arange(input_ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def pairs(vocab: int, n: int = 4, length: int = 5, seed: int = 1, at=(1, 3)) -> dict:
    """A dataset=pairs batch: random clean ids, corrupt ids differing at positions `at`, an
    answer and a wrong token each."""
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(0, vocab, (n, length), generator=g)
    corrupt = clean.clone()
    for p in at:
        corrupt[:, p] = torch.randint(0, vocab, (n,), generator=g)
    return {
        "input_ids": clean,
        "corrupt_ids": corrupt,
        "attention_mask": torch.ones_like(clean),
        "answer": torch.randint(0, vocab, (n, 1), generator=g),
        "wrong": torch.randint(0, vocab, (n, 1), generator=g),
    }
