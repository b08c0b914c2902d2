"""A small transformer of its own family for the circuit tests and the docs' figures, described
to probe by `model.anatomy` keys (OVERRIDES): `frozen=True` makes it linear in its residual stream (attention
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
    pattern: torch.Tensor  # (a buffer: each head's fixed pattern, for `frozen`)

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


# -- a planted circuit: the answer carried through three chosen heads -----------------------------
VOCAB, WIDTH, HEADS, DH = 12, 32, 4, 8
S1, S2, S3, JUNK = slice(12, 16), slice(16, 20), slice(20, 24), slice(24, 32)
ROUTE = [(0, 1), (1, 2), (2, 0)]  # (layer, head): a0.h1 -> a1.h2 -> a2.h0
ROUTE_EDGES = ["input->a0.h1<v>", "a0.h1->a1.h2<v>", "a1.h2->a2.h0<v>", "a2.h0->logits"]


def planted() -> Toy:
    """A 3-layer, 4-head Toy whose weights carry the answer (the token at position 0) through
    the ROUTE heads, each moving it into the next one's value input, while every other head and
    MLP reads and writes a subspace the answer never touches."""
    model = Toy(VOCAB, WIDTH, layers=3, heads=HEADS, norms=False, seed=3)
    g = torch.Generator().manual_seed(5)
    junk = lambda *shape: torch.randn(*shape, generator=g) * 0.5  # noqa: E731
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.embed.weight[:, :VOCAB] = torch.eye(VOCAB)
        model.pos.weight[:, JUNK] = junk(16, 8)
        sources = {0: slice(0, 4), 1: S1, 2: S2}
        targets = {0: S1, 1: S2, 2: S3}
        for layer, block in enumerate(model.blocks):
            if not isinstance(block, ToyBlock):  # (a ModuleList's items are Modules to mypy)
                raise RuntimeError("a Toy's blocks are ToyBlocks")
            up, down = block.mlp[0], block.mlp[2]
            if not (isinstance(up, nn.Linear) and isinstance(down, nn.Linear)):
                raise RuntimeError("a ToyBlock's MLP is Linear, activation, Linear")
            attn = block.attn
            for h in range(HEADS):
                cols = slice(h * DH, (h + 1) * DH)
                attn.q.weight[cols, JUNK], attn.k.weight[cols, JUNK] = junk(8, 8), junk(8, 8)
                if (layer, h) in ROUTE:  # the value copies the previous step's subspace on
                    attn.v.weight[cols.start : cols.start + 4, sources[layer]] = torch.eye(4)
                    attn.o.weight[targets[layer], cols.start : cols.start + 4] = torch.eye(4)
                else:
                    attn.v.weight[cols, JUNK], attn.o.weight[JUNK, cols] = junk(8, 8), junk(8, 8)
            up.weight[:, JUNK], down.weight[JUNK] = junk(64, 8), junk(8, 64)
        model.head.weight[:4, S3] = torch.eye(4)
    return model


def planted_pairs() -> dict:
    """6 pairs of 5 tokens for `planted`: the answer at position 0 of the clean half, a wrong
    one there in the corrupt half."""
    g = torch.Generator().manual_seed(2)
    clean = torch.randint(4, VOCAB, (6, 5), generator=g)
    answer = torch.randint(0, 4, (6,), generator=g)
    wrong = (answer + torch.randint(1, 4, (6,), generator=g)) % 4
    clean[:, 0] = answer
    corrupt = clean.clone()
    corrupt[:, 0] = wrong
    return {"input_ids": clean, "corrupt_ids": corrupt, "answer": answer[:, None],
            "wrong": wrong[:, None]}  # fmt: skip
