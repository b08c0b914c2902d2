"""Small models for the tests and the benchmarks, built by name
(`model=custom model._target_=probe.testing.models.TinyNet`).

Some misbehave on purpose (raise, signal their own process, make NaN, die mid-run), some plant a
known answer (token rows that hold their own identity, a dead and a saturated channel), and two are
tiny language models. Every `Tracked` instance is remembered (`built_models`) so a test can check
that a run left no hook on it (`assert_no_hooks`); `registrations` counts or refuses the hooks
hung on a model.
"""

from __future__ import annotations

import os
import signal
import time
import weakref
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.modules import module as module_globals

BUILT: list[weakref.ref] = []


def built_models() -> list[nn.Module]:
    return [m for m in (r() for r in BUILT) if m is not None]


MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                "_forward_pre_hooks_with_kwargs")  # fmt: skip
GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                "_global_backward_pre_hooks", "_global_forward_hooks_with_kwargs",
                "_global_forward_hooks_always_called")  # fmt: skip
REGISTRATIONS = (  # what probe hangs on a model: module forward hooks and tensor hooks
    (nn.Module, "register_forward_hook"),
    (nn.Module, "register_forward_pre_hook"),
    (torch.Tensor, "register_hook"),
)


def assert_no_hooks(model: nn.Module, *tensors: torch.Tensor) -> None:
    """No hook left on any module of `model` (every hook dict torch keeps on a module), on its
    parameters, on `tensors`, nor among torch's module-global hooks."""
    for name, m in model.named_modules():
        left = [d for d in MODULE_HOOKS if getattr(m, d)]
        assert not left, f"hooks left on {name!r}: {left}"
    for name, p in model.named_parameters():
        assert not p._backward_hooks and not p._post_accumulate_grad_hooks, f"hooks on {name}"
    for i, t in enumerate(tensors):
        assert not t._backward_hooks, f"tensor {i} keeps {len(t._backward_hooks)} hooks"
    left = [d for d in GLOBAL_HOOKS if getattr(module_globals, d)]
    assert not left, f"global hooks left: {left}"


EVERY_REGISTRATION = (  # and what a watched training hangs on parameters and its optimizer
    *REGISTRATIONS,
    (nn.Module, "register_full_backward_hook"),
    (torch.Tensor, "register_post_accumulate_grad_hook"),
    (torch.optim.Optimizer, "register_step_pre_hook"),
    (torch.optim.Optimizer, "register_step_post_hook"),
)


@contextmanager
def registrations(refuse: int | None = None, kinds=REGISTRATIONS):
    """Counts the hook registrations made inside (`kinds`, all together); the `refuse`-th raises
    RuntimeError('registration K refused'). Yields the list of calls so far (one None each), so
    `len()` of it is the count."""
    calls: list = []
    saved = [(owner, name, owner.__dict__[name]) for owner, name in kinds]

    def counted(original):
        def register(*args, **kwargs):
            calls.append(None)
            if len(calls) == refuse:
                raise RuntimeError(f"registration {refuse} refused")
            return original(*args, **kwargs)

        return register

    for owner, name, original in saved:
        setattr(owner, name, counted(original))
    try:
        yield calls
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


class Tracked(nn.Module):
    def __init__(self):
        super().__init__()
        BUILT.append(weakref.ref(self))


class TinyNet(Tracked):
    """3x8x8 inputs: conv, relu, linear; `delay` seconds of sleep per forward slows a run down, and
    while a file named by `hold` exists every forward waits (a test holds a run mid-way)."""

    def __init__(self, num_classes: int = 10, delay: float = 0.0, hold: str | None = None):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(4 * 8 * 8, num_classes)
        self.delay = delay
        self.hold = hold

    def forward(self, x):
        if self.delay:
            time.sleep(self.delay)
        while self.hold and os.path.exists(self.hold):
            time.sleep(0.05)
        return self.fc(self.relu(self.conv(x)).flatten(1))


class Inner(nn.Module):
    def forward(self, *, x):
        return x * 2


class KeywordOnly(Tracked):
    """`inner` is called with a keyword argument only, so it has no positional input."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.inner = Inner()
        self.fc = nn.Linear(3 * 8 * 8, num_classes)

    def forward(self, x):
        return self.fc(self.inner(x=x).flatten(1))


class Raises(TinyNet):
    """Its forward raises on every call after the first `ok_calls`."""

    def __init__(self, num_classes: int = 10, ok_calls: int = 0):
        super().__init__(num_classes)
        self.ok_calls = ok_calls

    def forward(self, x):
        if self.ok_calls <= 0:
            raise RuntimeError("deliberate failure inside forward")
        self.ok_calls -= 1
        return super().forward(x)


class NonFinite(nn.Module):
    """NaN where the input is negative, Inf where it is above 0.5."""

    def forward(self, x):
        x = torch.where(x < 0, torch.full_like(x, float("nan")), x)
        return torch.where(x > 0.5, torch.full_like(x, float("inf")), x)


class MakesNaN(Tracked):
    """conv (finite) -> bad (first NaN/Inf) -> fc (NaN from there on)."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bad = NonFinite()
        self.fc = nn.Linear(4 * 8 * 8, num_classes)

    def forward(self, x):
        return self.fc(self.bad(self.conv(x)).flatten(1))


class SignalsItself(TinyNet):
    """Sends `SignalsItself.signal` to its own process on forward call `SignalsItself.at_call`
    (class attributes, so a resumed run with the same config can leave them unset)."""

    at_call: int | None = None
    signal: int = 2  # SIGINT

    def __init__(self, num_classes: int = 10):
        super().__init__(num_classes)
        self.calls = 0

    def forward(self, x):
        if self.calls == SignalsItself.at_call:
            os.kill(os.getpid(), SignalsItself.signal)
        self.calls += 1
        return super().forward(x)


class RecordsResources(TinyNet):
    """Appends this process's open file descriptors and RSS (KiB) to `log` when built: built once
    per job of a sweep, it samples the process between jobs."""

    def __init__(self, num_classes: int = 10, log: str = ""):
        super().__init__(num_classes)
        with open("/proc/self/status") as f:
            rss = next(int(x.split()[1]) for x in f if x.startswith("VmRSS:"))
        fds = len(os.listdir("/proc/self/fd"))
        with open(log, "a") as f:
            f.write(f"{fds} {rss}\n")


class TinyLM(nn.Module):
    """A language model of two residual MLP blocks over token embeddings: forward(input_ids,
    attention_mask) -> (N, T, vocab) logits; padded positions are zeroed before the head."""

    def __init__(self, vocab: int = 50, width: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, width))
            for _ in range(2)
        )
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids, attention_mask=None):
        h = self.embed(input_ids)
        for block in self.blocks:
            h = h + block(h)
        if attention_mask is not None:
            h = h * attention_mask[..., None]
        return self.head(h)


class SignalsItselfLM(TinyLM):
    """TinyLM that sends SIGINT to its own process on forward call `at_call` (see SignalsItself)."""

    at_call: int | None = None

    def __init__(self, vocab: int = 50, width: int = 8):
        super().__init__(vocab, width)
        self.calls = 0

    def forward(self, input_ids, attention_mask=None):
        if self.calls == SignalsItselfLM.at_call:
            os.kill(os.getpid(), signal.SIGINT)
        self.calls += 1
        return super().forward(input_ids, attention_mask)


SIGNAL_AT: list[int | None] = [None]  # forward call at which signalling_lm sends SIGNAL[0]
SIGNAL: list[int] = [signal.SIGINT]  # (SIGKILL: a kill no handler sees)


def signalling_lm(path: str) -> nn.Module:
    """A transformers causal LM loaded from `path` that sends SIGNAL[0] (SIGINT) to its own
    process on forward call SIGNAL_AT[0] (a run's every forward counts: a grid's source, target
    and cells)."""
    from transformers import AutoModelForCausalLM

    from probe.hooks.hookset import HookSet

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    calls = [0]

    def count(module, args, kwargs):
        if calls[0] == SIGNAL_AT[0]:
            os.kill(os.getpid(), SIGNAL[0])
        calls[0] += 1

    HookSet("signal").forward_pre(model, count, with_kwargs=True)  # (held for the model's life)
    return model


class SmoothNet(Tracked):
    """3x8x8 inputs: conv, tanh, conv, tanh, mean pool, linear. Smooth and curved along the
    path from zero to an activation, so integrated gradients' error shrinks with the steps."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.conv2 = nn.Conv2d(6, 6, 3, padding=1)
        self.fc = nn.Linear(6, num_classes)

    def forward(self, x):
        h = torch.tanh(self.conv2(torch.tanh(3 * self.conv1(x))))
        return self.fc(h.mean((2, 3)))


class LinearBlock(nn.Module):
    """x + W x + a causal running mean of x: linear in x, and mixing the positions."""

    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        steps = torch.arange(1, x.shape[1] + 1, device=x.device)[None, :, None]
        return x + self.lin(x) + x.cumsum(1) / steps


class LinearLM(Tracked):
    """Token ids -> embedding -> LinearBlocks -> logits: every logit is linear in every block's
    output, so attribution patching is exact on it."""

    def __init__(self, vocab: int = 50, width: int = 8, layers: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(LinearBlock(width) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids, attention_mask=None):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class RowsOfIds(nn.Module):
    """Token rows that hold their own identity: `echo` outputs (N, T, 2) = (the token id, its
    position) as floats, so a stream's rows can be traced back to the file (feed each sequence
    its own index as every token id)."""

    def __init__(self):
        super().__init__()
        self.echo = nn.Identity()
        self.head = nn.Linear(2, 2)

    def forward(self, input_ids, attention_mask=None):
        steps = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        return self.head(self.echo(torch.stack([input_ids, steps], -1).float()))


class TokenContext(nn.Module):
    """What a token row can hold, planted: `lexical` outputs the current token one-hot (the word
    type), `context` the previous token one-hot (zeros at position 0: nothing of the current
    word), `mixed` a fixed random projection of both (full-rank features for an lstsq check)."""

    def __init__(self, vocab: int = 20, width: int = 12):
        super().__init__()
        self.vocab = vocab
        self.lexical, self.context = nn.Identity(), nn.Identity()
        self.mixed = nn.Linear(2 * vocab, width)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            self.mixed.weight.copy_(torch.randn(width, 2 * vocab, generator=g))
            self.mixed.bias.copy_(torch.randn(width, generator=g))

    def forward(self, input_ids, attention_mask=None):
        now = nn.functional.one_hot(input_ids, self.vocab).float()
        before = torch.cat([torch.zeros_like(now[:, :1]), now[:, :-1]], 1)
        return self.mixed(torch.cat([self.lexical(now), self.context(before)], -1))


class PadLoud(nn.Module):
    """Token rows whose padding is the loudest: `loud` outputs the token one-hot plus 100 at
    every padded position, so a top-k that let padding in would show it first."""

    def __init__(self, vocab: int = 20):
        super().__init__()
        self.vocab = vocab
        self.loud = nn.Identity()

    def forward(self, input_ids, attention_mask=None):
        h = nn.functional.one_hot(input_ids, self.vocab).float()
        if attention_mask is not None:
            h = h + 100.0 * (1 - attention_mask[..., None].float())
        return self.loud(h + 0.01 * torch.arange(input_ids.shape[1], device=h.device)[:, None])


# -- planted statistics and a run that dies ---------------------------------------------------
DEAD = 2  # the channel forced negative before the ReLU
SATURATED = 1  # the channel pushed far into tanh's bound


class DeadChannel(nn.Module):
    """conv -> (channel DEAD set to -1 - |x|) -> ReLU, and a tanh branch with channel SATURATED * 50."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.relu = nn.ReLU()
        self.tanh = nn.Tanh()
        self.head = nn.Linear(4, num_classes)

    def forward(self, x):
        h = self.conv(x)
        mask = torch.zeros(1, h.shape[1], 1, 1, dtype=torch.bool)
        mask[:, DEAD] = True
        h = torch.where(mask, -1.0 - h.abs(), h)
        scale = torch.ones(1, h.shape[1], 1, 1)
        scale[:, SATURATED] = 50.0
        t = self.tanh(torch.sign(h) * (h.abs() + 1.0) * scale)
        r = self.relu(h)
        return self.head((r + t).mean(dim=(2, 3)))


class DiesOnThirdBatch(nn.Module):
    """A tiny conv net whose process is killed (os._exit) at its third forward: a run cut short."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4, num_classes)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 3:
            time.sleep(1.0)  # let the writer thread flush the first two batches
            os._exit(9)
        return self.head(self.conv(x).mean(dim=(2, 3)))
