"""The logit lens (and the tuned lens): every lens layer's residual stream decoded through the
model's own final norm and unembedding, compared with the model's final distribution.

Per batch, per layer and real token (in chunks of rows, so no vocabulary-wide tensor of the
whole batch is held): KL(final || lens), entropy, the lens's probability and rank of the final
top-1 token and whether its own top-1 agrees, the cross-entropy of the next token, and with a
pairs dataset the probability, rank and cross-entropy of the answer at the answer position. They
leave as per-sample rows of /lens/<metric> (samples x layers: the mean over a sample's tokens),
/lens/top1_prob_positions (samples x layers x positions) and, once, the top-k tokens of the first
samples. The tuned lens adds each layer's affine translator first: h + A_l h + b_l.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from probe.errors import ConfigError
from probe.hooks.hookset import HookSet
from probe.hooks.names import flatten
from probe.plan import LensSpec

PER_TOKEN = ("kl", "entropy", "top1_prob", "top1_rank", "agree")
ANSWER = ("answer_prob", "answer_rank", "answer_ce")
CHUNK = 1 << 23  # lens logits held at once (rows x vocabulary)


class Lens:
    """The lens layers' outputs held through one forward, then decoded. A context manager: its
    hooks (one HookSet) are hung on entry, all or none, and removed on any exit."""

    def __init__(
        self, cfg: LensSpec, layers: list[tuple[str, torch.nn.Module]], norm, unembed, body
    ):
        self.cfg, self.layers, self.norm, self.unembed = cfg, layers, norm, unembed
        self.names = [n for n, _ in layers]
        self.last = body.blocks[-1] if body.blocks else None  # (its lens is the model's logits)
        tuned = cfg.name == "tuned"
        self.translators = load_translators(cfg.path, self.names, body) if tuned else {}
        self.held: dict[str, torch.Tensor] | None = None
        self.hooks = HookSet("lens")

    def __enter__(self) -> Lens:
        self.hooks.enter(self._hang)
        return self

    def _hang(self) -> None:
        for name, module in self.layers:
            self.hooks.forward(module, self._keep(name), name=name)

    def __exit__(self, *exc) -> None:
        self.hooks.__exit__(*exc)

    def _keep(self, name: str):
        def hook(module, args, output):
            if self.held is not None and name not in self.held:  # (a 2nd call: the 1st's)
                self.held[name] = next(t for _, t in flatten(output)).detach().clone()

        return hook

    def begin(self) -> None:
        self.held = {}

    def end(self) -> dict[str, torch.Tensor]:
        held, self.held = self.held or {}, None
        return held

    def decode(self, name: str, h: torch.Tensor) -> torch.Tensor:
        """Lens logits of residual rows h (R, D): translator, final norm, unembedding."""
        if name in self.translators:
            a, b = self.translators[name]
            h = h + h @ a.to(h).T + b.to(h)
        return self.unembed(self.norm(h)).float()

    def rows(self, held, logits, ids, tokens, side, position) -> tuple[dict, dict]:
        """({extra name: (N, ...) float32 host tensor}, {once name: array}) of one batch. With
        lens.positions=last only each sample's answer position (its last real token) is read."""
        n, t = ids.shape
        mask = torch.ones(n, t, dtype=torch.bool) if tokens.mask is None else tokens.mask.cpu()
        at = _answer_positions(tokens, position, n, t)
        if self.cfg.positions == "last":
            mask = torch.zeros(n, t, dtype=torch.bool)
            mask[torch.arange(n), at] = True
        follows = torch.zeros(n, t, dtype=torch.bool)
        follows[:, :-1] = mask[:, 1:] & mask[:, :-1]  # a real token followed by a real token
        read = mask.reshape(-1).nonzero().squeeze(1)  # the (sample, position) rows read
        final = logits.float().reshape(n * t, -1)[read.to(logits.device)]
        following = torch.cat([ids[:, 1:], ids[:, -1:]], 1).reshape(-1)[read]
        out = {m: torch.zeros(n, len(self.names)) for m in (*PER_TOKEN, "next_ce")}
        out["top1_prob_positions"] = torch.full((n, len(self.names), t), math.nan)
        answers = "answer" in side
        if answers:
            out.update({m: torch.zeros(n, len(self.names)) for m in ANSWER})
        keep = min(int(self.cfg.samples), n)
        topk = np.full((keep, len(self.names), t, int(self.cfg.topk)), -1, np.int64)
        real = mask.sum(1).clamp(min=1).float()
        for name in self.names:
            h = held[name]
            if h.ndim != 3 or h.shape[:2] != (n, t):
                raise ConfigError(
                    f"lens: layer {name!r} gives {tuple(h.shape)}, not the residual stream "
                    f"(N, T, D) = ({n}, {t}, D); give lens.layers that are blocks (@blocks)"
                )
        layers = {
            name: held[name].reshape(n * t, -1)[read.to(held[name].device)] for name in self.names
        }
        first = int((read < keep * t).sum())  # the leading rows of the kept samples (top-k)
        answer = None  # each sample's answer row among the read ones, and its answer ids
        if answers:
            where = torch.full((n * t,), -1, dtype=torch.long)
            where[read] = torch.arange(len(read))
            rows_at = where[torch.arange(n) * t + at]
            outside = bool((rows_at < 0).any())  # an answer position outside the rows read
            answer = None if outside else (rows_at, side["answer"].reshape(n, -1))
        every = self._values(layers, final, following, first, answer)
        for j, name in enumerate(self.names):
            scattered = [k for k in every[name] if k != "topk" and k not in ANSWER]
            values = {k: _scatter(every[name][k], read, n, t) for k in scattered}
            for m in PER_TOKEN:
                out[m][:, j] = (values[m].nan_to_num() * mask).sum(1) / real
            count = follows.sum(1)
            ce = (values["next_ce"].nan_to_num() * follows).sum(1) / count.clamp(min=1)
            out["next_ce"][:, j] = ce.masked_fill(count == 0, math.nan)
            out["top1_prob_positions"][:, j] = values["top1_prob"]
            kept = _scatter(every[name]["topk"], read[:first], keep, t)
            topk[:, j] = kept.nan_to_num(-1).long().numpy()
            if answers:
                found = (
                    every[name]
                    if answer is not None
                    else self._answers(name, held[name], logits, at, side)
                )
                for m in ANSWER:
                    out[m][:, j] = found[m]
        out["tokens"] = mask.sum(1).float()[:, None]
        out["next_tokens"] = follows.sum(1).float()[:, None]
        return {f"lens/{k}": v for k, v in out.items()}, {
            "lens/topk": topk,
            "lens/layers": np.array(self.names, dtype=object),
        }

    def _values(self, layers: dict, final, following, first: int, answer=None) -> dict[str, dict]:
        """Per layer and read row: the per-token metrics, and the top-k ids of the `first` rows,
        in chunks of rows; the final distribution's share of the work done once per chunk. With
        `answer` (each sample's answer row, its answer ids) the answer metrics from the same
        lens logits."""
        step = max(1, CHUNK // final.shape[-1])
        parts: dict[str, dict[str, list]] = {name: {} for name in layers}
        k = int(self.cfg.topk)
        found = {name: {m: torch.full((0,), math.nan) for m in ANSWER} for name in layers}
        if answer is not None:
            found = {name: {m: torch.zeros(len(answer[0])) for m in ANSWER} for name in layers}
        for lo in range(0, len(final), step):
            logp = final[lo : lo + step].log_softmax(-1)
            p = logp.exp()
            own = (p * logp).sum(-1)  # sum p log p, for KL(final || lens)
            top1 = logp.argmax(-1, keepdim=True)
            nexts = following[lo : lo + step, None].to(logp.device)
            for name, rows in layers.items():
                if name == self.last and name not in self.translators:
                    logq = logp  # the model's last block decoded is the model's own logits
                else:
                    logq = self.decode(name, rows[lo : lo + step]).log_softmax(-1).to(logp.device)
                at_top1 = logq.gather(-1, top1)
                got = {
                    "kl": own - (p * logq).sum(-1),
                    "entropy": -(logq.exp() * logq).sum(-1),
                    "top1_prob": at_top1.squeeze(-1).exp(),
                    "top1_rank": (logq > at_top1).sum(-1).float(),
                    "agree": (logq.argmax(-1, keepdim=True) == top1).squeeze(-1).float(),
                    "next_ce": -logq.gather(-1, nexts).squeeze(-1),
                }
                if lo < first:
                    got["topk"] = logq[: first - lo].topk(k, -1).indices.float()
                if answer is not None:
                    _answer_rows(found[name], logq, answer, lo)
                for key, v in got.items():
                    parts[name].setdefault(key, []).append(v.cpu())
        out = {}
        for name, got in parts.items():
            out[name] = {key: torch.cat(v) for key, v in got.items()}
            out[name].setdefault("topk", torch.zeros(0, k))
            out[name].update(found[name])
        return out

    def _answers(self, name, h, logits, at, side) -> dict[str, torch.Tensor]:
        """The answer's total probability, its first token's rank and its cross-entropy under the
        lens at each sample's answer position."""
        rows = torch.arange(len(h), device=h.device)
        if name == self.last and name not in self.translators:
            last = logits[torch.arange(len(h), device=logits.device), at.to(logits.device)]
            logq = last.float().log_softmax(-1)
        else:
            logq = self.decode(name, h[rows, at.to(h.device)]).log_softmax(-1)
        ids = side["answer"].to(logq.device).reshape(len(h), -1)
        picked = logq.gather(1, ids.clamp(min=0)).masked_fill(ids < 0, -math.inf)
        total = picked.logsumexp(1)
        first = logq.gather(1, ids[:, :1].clamp(min=0))
        return {
            "answer_prob": total.exp().cpu(),
            "answer_rank": (logq > first).sum(1).float().cpu(),
            "answer_ce": (-total).cpu(),
        }


def _answer_rows(found: dict, logq: torch.Tensor, answer, lo: int) -> None:
    """The answer metrics of the samples whose answer row lies in this chunk of lens logits."""
    rows_at, ids = answer
    inside = ((rows_at >= lo) & (rows_at < lo + len(logq))).nonzero().squeeze(1)
    if not len(inside):
        return
    logq = logq[(rows_at[inside] - lo).to(logq.device)]
    mine = ids[inside].to(logq.device)
    total = logq.gather(1, mine.clamp(min=0)).masked_fill(mine < 0, -math.inf).logsumexp(1)
    first = logq.gather(1, mine[:, :1].clamp(min=0))
    found["answer_prob"][inside] = total.exp().cpu()
    found["answer_rank"][inside] = (logq > first).sum(1).float().cpu()
    found["answer_ce"][inside] = (-total).cpu()


def _scatter(values: torch.Tensor, read: torch.Tensor, n: int, t: int) -> torch.Tensor:
    """(N, T, ...) with the read rows' values and NaN (-1 for ids) elsewhere."""
    out = torch.full((n * t, *values.shape[1:]), math.nan)
    out[read] = values.float()
    return out.reshape(n, t, *values.shape[1:])


def _answer_positions(tokens, position, n: int, t: int) -> torch.Tensor:
    last = tokens.last.cpu() if tokens is not None else torch.full((n,), t - 1)
    if position is None:
        return last
    return last + 1 + position if position < 0 else torch.full((n,), position)


def load_translators(path, names: list[str], body) -> dict:
    """{layer: (A, b)} from a tuned-lens folder (params.pt: layer_translators.I.weight (D, D) and
    .bias (D,), I the layer's index among the lens layers), or a .pt of that state dict."""
    if not path:
        raise ConfigError("lens=tuned needs lens.path=DIR (a tuned lens: params.pt of translators)")
    p = Path(path)
    file = p / "params.pt" if p.is_dir() else p
    if not file.is_file():
        raise ConfigError(f"lens.path={str(path)!r} holds no params.pt; give a tuned lens folder")
    state = torch.load(file, map_location="cpu", weights_only=True)
    out = {}
    for i, name in enumerate(names):
        a, b = state.get(f"layer_translators.{i}.weight"), state.get(f"layer_translators.{i}.bias")
        if a is None or b is None:
            raise ConfigError(
                f"lens.path={str(path)!r} has no layer_translators.{i}.weight/.bias for lens layer "
                f"{i} ({name}); it holds {len([k for k in state if k.endswith('.weight')])} "
                "translators: give as many lens.layers as it was trained for"
            )
        width = body.width
        if tuple(a.shape) != (width, width) or tuple(b.shape) != (width,):
            raise ConfigError(
                f"lens.path={str(path)!r}: translator {i} is {tuple(a.shape)} + {tuple(b.shape)}, "
                f"but the residual stream of {name} has width {width}; it was trained for another "
                "model"
            )
        out[name] = (a.float(), b.float())
    return out
