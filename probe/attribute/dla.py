"""Direct logit attribution: the final residual split into what each component wrote (the
embeddings, each attention head through its slice of the output projection, each projection's
bias, each MLP), each projected through the final norm with its scale frozen at the final
residual and onto the unembedding direction of answer minus wrong tokens.

A LayerNorm or RMSNorm with its scale frozen is linear (a LayerNorm's centring is too), so the
components, the norm's bias and the unembedding's bias sum to the logit difference the model
gives at that position. A post-norm model (each block normalises its residual), a final norm
of another kind and final logit softcapping are refused by name: the sum would not hold.
"""

from __future__ import annotations

import torch

from probe.errors import ConfigError
from probe.hooks.hookset import HookSet
from probe.models.norms import formula_of


class DirectLogit:
    """Hooks holding each component's write at every position through one forward, then per
    sample each component's direct effect on the answer's logit difference. A context manager:
    its hooks (one HookSet) are hung on entry, all or none, and removed on any exit."""

    def __init__(self, model, body, norm, unembed, tokens=None):
        _refuse(model, body, norm)
        self.body, self.norm, self.unembed, self.tokens = body, norm, unembed, tokens
        modules = dict(model.named_modules())
        self.first_block = modules[body.blocks[0]]
        self.attn = [(n, modules[n]) for n in body.attn_out]
        self.mlp = [(n, modules[n]) for n in body.mlp_out]
        self.heads = body.heads
        self.held: dict | None = None
        self.hooks = HookSet("dla")
        self.names = self._names()

    def _names(self) -> list[tuple[str, str, int]]:
        """(component, layer, head) of each column, in order."""
        out = [("embed", "", -1)]
        for (a, _), (m, _) in zip(self.attn, self.mlp, strict=True):
            out += [("attn_head", a, h) for h in range(self.heads)]
            out += [("attn_bias", a, -1), ("mlp", m, -1)]
        return [*out, ("norm_bias", "", -1), ("unembed_bias", "", -1)]

    def __enter__(self) -> DirectLogit:
        self.hooks.enter(self._hang)
        return self

    def _hang(self) -> None:
        hooks = self.hooks
        first = self.body.blocks[0]
        hooks.forward_pre(self.first_block, self._keep("embed", first=True), name=first)
        for name, m in self.attn:
            hooks.forward_pre(m, self._keep(f"z:{name}", first=True), name=name)
        for name, m in self.mlp:
            hooks.forward(m, self._keep(f"mlp:{name}"), name=name)
        hooks.forward_pre(self.norm, self._keep("final", first=True), name="final norm")

    def __exit__(self, *exc) -> None:
        self.hooks.__exit__(*exc)

    def _keep(self, key: str, first: bool = False):
        def hook(module, args, output=None):
            if self.held is None or key in self.held:
                return
            value = args[0] if first else output
            value = value[0] if isinstance(value, tuple) else value
            self.held[key] = value.detach().clone()

        return hook

    def begin(self) -> None:
        self.held = {}

    def end(self) -> dict:
        held, self.held = self.held or {}, None
        return held

    def rows(self, held, logits, ids, tokens, side, position) -> tuple[dict, dict]:
        """({"dla/values": (N, components)}, {"dla/components": names}) of one batch."""
        n, t = ids.shape
        at = _position(tokens, position, n, t).to(held["final"].device)
        rows = torch.arange(n, device=at.device)
        final = held["final"][rows, at].double()
        direction = self._direction(side, n).to(final.device)
        frozen = self._frozen(final)
        columns = [self._project(held["embed"][rows, at], frozen, direction)]
        for (a, m_a), (m, _) in zip(self.attn, self.mlp, strict=True):
            z = held[f"z:{a}"][rows, at].double().reshape(n, self.heads, -1)
            weight = _output_weight(m_a).double().to(z.device)  # (in = heads x d_head, out)
            per_head = torch.einsum(
                "nhd,hdo->nho", z, weight.reshape(self.heads, -1, weight.shape[1])
            )
            for h in range(self.heads):
                columns.append(self._project(per_head[:, h], frozen, direction))
            bias = m_a.bias if getattr(m_a, "bias", None) is not None else None
            columns.append(
                self._project(bias.double().expand(n, -1), frozen, direction)
                if bias is not None
                else torch.zeros(n, dtype=torch.float64, device=final.device)
            )
            columns.append(self._project(held[f"mlp:{m}"][rows, at], frozen, direction))
        beta = getattr(self.norm, "bias", None)
        columns.append(
            (beta.double() * direction).sum(-1).expand(n)
            if beta is not None
            else torch.zeros(n, dtype=torch.float64, device=final.device)
        )
        columns.append(self._unembed_bias(side, n).to(final.device))
        values = torch.stack([c.to(final.device) for c in columns], 1)
        names = [f"{c}|{layer}|{head}" for c, layer, head in self.names]
        scores = logits[torch.arange(n, device=logits.device), at.to(logits.device)].double()
        answer, wrong = self._ids(side, n)
        own = _picked(scores, answer, wrong)  # the model's own, for the table beside the sum
        return {"dla/values": values.float().cpu(), "dla/logit_diff": own.float().cpu()[:, None]}, {
            "dla/components": names
        }

    def _frozen(self, final: torch.Tensor):
        """(center?, 1 / scale, gamma) of the final norm at the final residual."""
        formula, eps = formula_of(self.norm, gain=True)  # (its gain's convention too)
        layer_norm = formula.centres
        centred = final - final.mean(-1, keepdim=True) if layer_norm else final
        scale = torch.rsqrt(centred.square().mean(-1, keepdim=True) + eps)
        gamma = self.norm.weight.double().to(final.device) + formula.offset
        return layer_norm, scale, gamma

    @staticmethod
    def _project(c, frozen, direction) -> torch.Tensor:
        centre, scale, gamma = frozen
        c = c.double().to(scale.device)
        if centre:
            c = c - c.mean(-1, keepdim=True)
        return (c * scale * gamma * direction).sum(-1)

    def _direction(self, side, n: int) -> torch.Tensor:
        """(N, D): the mean unembedding row of the answer tokens minus the wrong ones'."""
        w = self.unembed.weight.double()
        answer, wrong = self._ids(side, n)
        return _mean_rows(w, answer) - _mean_rows(w, wrong)

    def _unembed_bias(self, side, n: int) -> torch.Tensor:
        b = getattr(self.unembed, "bias", None)
        if b is None:
            return torch.zeros(n, dtype=torch.float64)
        answer, wrong = self._ids(side, n)
        b = b.double()[:, None]
        return (_mean_rows(b, answer) - _mean_rows(b, wrong))[:, 0].cpu()

    def _ids(self, side, n: int):
        if self.tokens is not None:
            answer, wrong = (torch.tensor([t]).expand(n, 1) for t in self.tokens)
            return answer, wrong
        return side["answer"].reshape(n, -1), side["wrong"].reshape(n, -1)


def _mean_rows(w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean of w's rows at each sample's ids (-1: padding, left out)."""
    ids = ids.to(w.device)
    valid = (ids >= 0).double()
    rows = w[ids.clamp(min=0)] * valid[..., None]
    return rows.sum(1) / valid.sum(1, keepdim=True).clamp(min=1)


def _picked(scores: torch.Tensor, answer: torch.Tensor, wrong: torch.Tensor) -> torch.Tensor:
    """Each sample's mean logit of its answer ids minus its wrong ids' (-1: padding)."""

    def mean(ids):
        ids = ids.to(scores.device)
        got = scores.gather(1, ids.clamp(min=0))
        valid = (ids >= 0).double()
        return (got * valid).sum(1) / valid.sum(1).clamp(min=1)

    return mean(answer) - mean(wrong)


def _output_weight(module) -> torch.Tensor:
    """The output projection as (in, out): HF's Conv1D stores it so, nn.Linear transposed."""
    w = module.weight
    return w if type(module).__name__ == "Conv1D" else w.T


def _position(tokens, position, n: int, t: int) -> torch.Tensor:
    last = tokens.last.cpu() if tokens is not None else torch.full((n,), t - 1)
    if position is None:
        return last
    return last + 1 + position if position < 0 else torch.full((n,), position)


def _refuse(model, body, norm) -> None:
    config = getattr(model, "config", None)
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        raise ConfigError(
            f"lens=dla: {body.family} caps its final logits (final_logit_softcapping={cap}), so "
            "the components' writes do not add up to the logit difference; use lens=logit"
        )
    if body.post_norm:
        raise ConfigError(
            f"lens=dla: {body.family} is a post-norm model (each block normalises its residual), "
            "so no component's write reaches the logits linearly; use lens=logit"
        )
    if body.sandwich:
        raise ConfigError(
            f"lens=dla: {body.family} norms each attention's and MLP's output again before the "
            "residual stream (post_attn_norm, post_mlp_norm), so the projections' writes are not "
            "what the residual gets; use lens=logit"
        )
    try:
        formula_of(norm, gain=True)
    except ConfigError as e:
        raise ConfigError(f"lens=dla: the final norm cannot be frozen: {e}; use lens=logit") from e
    if not body.heads or not body.attn_out or len(body.attn_out) != len(body.mlp_out):
        raise ConfigError(
            f"lens=dla needs each block's attention output projection, its heads and its MLP; "
            f"for {body.family!r} set model.anatomy.attn_out, mlp_out and heads"
        )
