"""Small trainings for the watch's tests and benchmarks: a CNN with BatchNorm, an in-place ReLU and a residual
add, a tiny GPT-2, their seeded batches, and one loop that runs watched or not.

A training is deterministic on the CPU with one thread (`one_thread`): two runs of the same
seed give bitwise equal weights, so any change the watch made would show.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

import probe

EVERY_SITE = ["output", "input", "grad_output", "grad_input", "param", "param_grad", "param_update"]


class Block(nn.Module):
    """conv, bn, += identity, relu: resnet's in-place pattern."""

    def __init__(self, width: int):
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.bn(self.conv(x))
        out += x
        return self.relu(out)


class SmallCNN(nn.Module):
    """3x8x8 inputs, 4 classes: conv1, bn1, an in-place relu, two blocks, a pooled linear head."""

    def __init__(self, width: int = 4, classes: int = 4):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = Block(width)
        self.layer2 = Block(width)
        self.fc = nn.Linear(width, classes)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer2(self.layer1(x))
        return self.fc(x.mean(dim=(2, 3)))


def cnn(seed: int = 0) -> SmallCNN:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return SmallCNN()


def gpt2(seed: int = 0) -> nn.Module:
    """A 2-layer width-32 GPT2LMHeadModel (probe.testing.tiny_lms' config, vocabulary 40) in
    train mode, its dropout on."""
    from transformers import GPT2LMHeadModel

    from probe.testing.tiny_lms import tiny_config

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return GPT2LMHeadModel(tiny_config("gpt2", 40)).train()


def image_batches(steps: int, size: int = 8, seed: int = 1) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 3, 8, 8, generator=g), torch.randint(0, 4, (size,), generator=g))
            for _ in range(steps)]  # fmt: skip


def token_batches(steps: int, size: int = 4, length: int = 6, seed: int = 1) -> list:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(3, 40, (size, length), generator=g)} for _ in range(steps)]


def image_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def token_loss(model, batch):
    return model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss


@contextlib.contextmanager
def one_thread():
    """Torch on one thread: its CPU backward is then bitwise repeatable."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def train(model, optimizer, batches, loss_fn, watch: dict | None = None, seed: int = 0,
          hand=None):  # fmt: skip
    """Seeded training over `batches`, watched with probe.watch(**watch) when given; `hand`
    (a callable(step, model, optimizer, phase)) looks on at "before" and "after" each optimizer
    step. Returns the per-step losses."""
    torch.manual_seed(seed)
    losses = []
    w = probe.watch(model, optimizer=optimizer, **watch) if watch is not None else None
    with w if w is not None else contextlib.nullcontext():
        for step, batch in enumerate(batches):
            optimizer.zero_grad()
            loss = loss_fn(model, batch)
            loss.backward()
            if w is not None:
                w.loss(loss)
            if hand is not None:
                hand(step, model, optimizer, "before")
            optimizer.step()
            if hand is not None:
                hand(step, model, optimizer, "after")
            losses.append(loss.item())
    return losses


def state_of(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter, buffer and optimizer state tensor, by name."""
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, s in optimizer.state.items():
        for k, v in s.items():
            if isinstance(v, torch.Tensor):
                out[f"optim.{names[id(p)]}.{k}"] = v.detach().clone()
    return out


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


DEEP_BLOCKS = 30  # SmolLM2-135M's depth
DEEP_PROBES = {  # ~100 sites of a Llama: each block's output, attention and MLP, a few parameters
    "blocks": {"layers": ["model.layers.*"], "types": ["LlamaDecoderLayer"],
               "capture": ["output", "grad_output"]},
    "attn": {"layers": ["model.layers.*.self_attn"], "capture": ["output"]},
    "mlp": {"layers": ["model.layers.*.mlp"], "capture": ["output"]},
    "final": {"layers": ["model.norm"], "capture": ["output"]},
    "params": {"layers": ["model.layers.0.self_attn.q_proj", "model.layers.15.mlp.down_proj",
                          "lm_head"], "capture": ["param", "param_grad", "param_update"]},
}  # fmt: skip


def deep_llama(blocks: int = DEEP_BLOCKS, width: int = 16, seed: int = 0) -> nn.Module:
    """A Llama-shaped causal LM (LlamaForCausalLM, vocabulary 40) of `blocks` decoder blocks at
    width `width`, in train mode: a real model's depth at a tiny size (DEEP_PROBES watch it)."""
    from transformers import LlamaForCausalLM

    from probe.testing.tiny_lms import tiny_config

    config = tiny_config("llama", 40)
    config.num_hidden_layers, config.hidden_size, config.intermediate_size = (
        blocks,
        width,
        2 * width,
    )
    config.num_attention_heads, config.num_key_value_heads = 2, 1
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return LlamaForCausalLM(config).train()
