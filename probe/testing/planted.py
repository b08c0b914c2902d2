"""The planted problem: a tiny GPT-2 whose MLPs are ReLU dictionaries of known directions, and
token sequences sampled from the model itself, so a transcoder fit can be scored on whether it
finds the directions (the honest test of a trainer).

Each block's MLP computes `relu(x @ c_fc + b) @ c_proj` on its input x (the ln_2 output): unit j
reads along `encoder[j]` (c_fc's column j = gain x a unit direction, centred so it lies in the
space a LayerNorm's output spans) and writes `decoder[j]` (c_proj's row j). Its bias is set so
that it fires on `fire_rate` of the tokens the model generates (the quantile of its
pre-activation over calibration sequences, block by block, re-sampled `rounds` times as the
sequences change with the biases). A transcoder of width n_inner can recover the MLP exactly.

The embeddings are large enough (std `embed_std`, tied with the LM head) that the model's
next-token distribution is far from uniform, and the decoder rows write outputs as large as the
embeddings, so the sequences it samples depend on its MLPs (`mlp_losses` measures how much).
Attention and position embeddings are large too, so an MLP's input varies with the context, not
only with the token: with GPT-2's default init (weights of std 0.02) the rows are 256 clusters (the
tokens; 0.1% of their variance within a token), on which any encoder that tells the clusters apart
reconstructs as well and the planted directions cannot be told from others; with these weights 73%
(block 0) and 86% (block 1) of the variance is within a token.

Default sizes (`PlantedSpec()`): d_model 64, n_inner 256, 2 blocks, 4 heads, vocabulary 256,
fire rate 3% (7.7 units active a token on average), 4096 sequences of 32 tokens (131,072 token
rows). The suite's test uses a smaller `PlantedSpec(sequences=...)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from probe.hooks.hookset import HookSet


@dataclass(frozen=True)
class PlantedSpec:
    """The sizes of a planted problem (see the module docstring)."""

    d_model: int = 64
    n_inner: int = 256
    n_layer: int = 2
    n_head: int = 4
    vocab_size: int = 256
    fire_rate: float = 0.03
    sequences: int = 4096
    length: int = 32
    gain: float = 4.0  # encoder columns' norm: pre-activations gain x (x . direction) + bias
    out_norm: float = 1.5  # decoder rows' norm
    embed_std: float = 0.3  # token embeddings (tied with the LM head)
    position_std: float = 0.3  # position embeddings
    attn_std: float = 0.3  # attention's query, key and value weights
    attn_out: float = 0.3  # attention's output weights x sqrt(d_model)
    rounds: int = 3  # calibrations of the biases
    calibration_sequences: int = 512
    seed: int = 0


@dataclass
class Planted:
    """A built planted problem: the model folder, the token ids file (`input_ids`,
    `attention_mask`: what dataset=tokens reads), each block's planted encoder directions
    (n_inner, d_model; unit rows) and decoder rows (n_inner, d_model), and the share of tokens each
    unit fires on over the sampled sequences (block -> (n_inner,))."""

    model_dir: Path
    ids_path: Path
    encoders: dict[int, torch.Tensor]
    decoders: dict[int, torch.Tensor]
    fire_rates: dict[int, torch.Tensor]
    spec: PlantedSpec


def _model(spec: PlantedSpec):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=spec.vocab_size, n_embd=spec.d_model, n_layer=spec.n_layer,
        n_head=spec.n_head, n_inner=spec.n_inner, n_positions=max(64, spec.length),
        activation_function="relu", bos_token_id=0, eos_token_id=0, pad_token_id=None,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(spec.seed)
        model: Any = GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(spec.seed + 1)
    with torch.no_grad():
        model.transformer.wte.weight.copy_(
            torch.randn(spec.vocab_size, spec.d_model, generator=g) * spec.embed_std
        )
        model.transformer.wpe.weight.copy_(
            torch.randn(*model.transformer.wpe.weight.shape, generator=g) * spec.position_std
        )
        for block in model.transformer.h:
            d = spec.d_model
            block.attn.c_attn.weight.copy_(torch.randn(d, 3 * d, generator=g) * spec.attn_std)
            block.attn.c_proj.weight.copy_(torch.randn(d, d, generator=g) * spec.attn_out / d**0.5)
            enc = torch.randn(spec.n_inner, spec.d_model, generator=g)
            enc = enc - enc.mean(1, keepdim=True)  # a LayerNorm's output has mean 0
            enc = enc / enc.norm(dim=1, keepdim=True)
            dec = torch.randn(spec.n_inner, spec.d_model, generator=g)
            dec = dec / dec.norm(dim=1, keepdim=True) * spec.out_norm
            block.mlp.c_fc.weight.copy_(enc.T * spec.gain)  # Conv1D: (d_model, n_inner)
            block.mlp.c_fc.bias.zero_()
            block.mlp.c_proj.weight.copy_(dec)  # Conv1D: (n_inner, d_model)
            block.mlp.c_proj.bias.zero_()
    return model.eval()


@torch.no_grad()
def sample(model, sequences: int, length: int, seed: int, batch: int = 4096) -> torch.Tensor:
    """(sequences, length) token ids drawn from the model at temperature 1 (the Gumbel-max
    draw), the first token uniform."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    out = []
    for start in range(0, sequences, batch):
        n = min(batch, sequences - start)
        ids = torch.randint(0, vocab, (n, 1), generator=g)
        past, step = None, ids
        for _ in range(length - 1):
            res = model(input_ids=step, past_key_values=past, use_cache=True)
            past = res.past_key_values
            noise = torch.rand(res.logits.shape[0], vocab, generator=g, dtype=torch.float64)
            step = (res.logits[:, -1].double() - (-noise.log()).log()).argmax(-1, keepdim=True)
            ids = torch.cat([ids, step], 1)
        out.append(ids)
    return torch.cat(out)


@torch.no_grad()
def _mlp_inputs(model, ids: torch.Tensor, block: int) -> torch.Tensor:
    """(tokens, d_model) inputs of block `block`'s MLP."""
    got = []
    with HookSet("probe.testing.planted") as hooks:
        hooks.forward_pre(
            model.transformer.h[block].mlp,
            lambda _m, args: got.append(args[0].reshape(-1, args[0].shape[-1])),
        )
        for start in range(0, len(ids), 512):
            model(input_ids=ids[start : start + 512])
    return torch.cat(got)


@torch.no_grad()
def _calibrate(model, spec: PlantedSpec) -> None:
    for r in range(spec.rounds):
        ids = sample(model, spec.calibration_sequences, spec.length, spec.seed + 100 + r)
        for b, block in enumerate(model.transformer.h):
            pre = _mlp_inputs(model, ids, b) @ block.mlp.c_fc.weight
            block.mlp.c_fc.bias.copy_(-torch.quantile(pre, 1 - spec.fire_rate, dim=0))


@torch.no_grad()
def make_planted(dir, spec: PlantedSpec | None = None) -> Planted:
    """Build the planted problem in `dir`: the model (save_pretrained into dir/model) and
    `spec.sequences` sampled sequences (dir/ids.pt); the global random state untouched. Runs on
    one thread (small matrices: several threads only wait on each other)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _make_planted(Path(dir), spec or PlantedSpec())
    finally:
        torch.set_num_threads(threads)


def _make_planted(dir: Path, spec: PlantedSpec) -> Planted:
    model = _model(spec)
    _calibrate(model, spec)
    model.save_pretrained(dir / "model")
    ids = sample(model, spec.sequences, spec.length, spec.seed + 7)
    torch.save({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, dir / "ids.pt")
    encoders, decoders, rates = {}, {}, {}
    for b, block in enumerate(model.transformer.h):
        w = block.mlp.c_fc.weight.T
        encoders[b] = w / w.norm(dim=1, keepdim=True)
        decoders[b] = block.mlp.c_proj.weight.clone()
        pre = _mlp_inputs(model, ids, b) @ block.mlp.c_fc.weight + block.mlp.c_fc.bias
        rates[b] = (pre > 0).double().mean(0)
    return Planted(dir / "model", dir / "ids.pt", encoders, decoders, rates, spec)


@torch.no_grad()
def mlp_losses(model_dir, ids: torch.Tensor) -> dict[str, float]:
    """The model's mean next-token cross-entropy over `ids` (`clean`), with each block's MLP
    output zeroed in turn (`zero_<block>`), and of the uniform guess (`uniform`): how much the
    sequences depend on the MLPs."""
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(model_dir).eval()

    def ce() -> float:
        total = 0.0
        for start in range(0, len(ids), 512):
            chunk = ids[start : start + 512]
            logits = model(input_ids=chunk).logits[:, :-1]
            total += float(
                torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1), reduction="sum"
                )
            )
        return total / (len(ids) * (ids.shape[1] - 1))

    out = {"clean": ce(), "uniform": float(torch.log(torch.tensor(model.config.vocab_size)))}
    for b, block in enumerate(model.transformer.h):
        with HookSet("probe.testing.planted") as hooks:
            hooks.forward(block.mlp, lambda _m, _a, o: torch.zeros_like(o))
            out[f"zero_{b}"] = ce()
    return out


def directions_found(planted: torch.Tensor, learned: torch.Tensor, cosine: float = 0.9) -> float:
    """The share of planted encoder directions (rows of `planted`) whose best learned encoder row
    (rows of `learned`, (d_tc, d_model)) has cosine >= `cosine` with them."""
    p = planted / planted.norm(dim=1, keepdim=True)
    q = learned / learned.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return float(((p @ q.T).max(1).values >= cosine).double().mean())


def capture_run(planted: Planted, run_dir) -> Path:
    """A probe run of the planted model over its sequences with each MLP's input and output as
    token rows (probes=mlp_io): what `python -m probe.fit` reads. The run directory."""
    from probe.launch.run import run
    from probe.testing.compose import make_cfg

    cfg = make_cfg("model=hf", f"model.name={planted.model_dir}", "model.task=causal_lm",
                   "dataset=tokens", f"dataset.path={planted.ids_path}", "dataset.batch_size=512",
                   "probes=mlp_io")  # fmt: skip
    run(cfg, run_dir=Path(run_dir))
    return Path(run_dir)


def planted_encoders(model_dir) -> dict[int, torch.Tensor]:
    """Each block's planted encoder directions (n_inner, d_model; unit rows) read back from the
    saved model's c_fc weights."""
    from safetensors.torch import load_file

    tensors = load_file(str(Path(model_dir) / "model.safetensors"))
    out = {}
    for name, w in tensors.items():
        parts = name.split(".")
        if name.endswith("mlp.c_fc.weight") and "h" in parts:
            block = int(parts[parts.index("h") + 1])
            out[block] = (w.T / w.T.norm(dim=1, keepdim=True)).float()
    return dict(sorted(out.items()))
