"""The logit lens, the tuned lens and direct logit attribution on tiny GPT-2, Llama and GPT-NeoX
models saved with save_pretrained: every value against a hand computation with plain hooks, the
final norm and the LM head, in numpy where it can be."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from probe.plan import parse
from probe.testing.tiny_lms import make_tiny
from tests.helpers import run_probe

N, T = 5, 6


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny GPT-2, Llama and GPT-NeoX (vocabulary 50) and a pairs file of N pairs of T tokens."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    root = tmp_path_factory.mktemp("lens")
    out = {kind: make_tiny(kind, root / kind, vocab_size=50) for kind in ("gpt2", "llama")}
    config = GPTNeoXConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2,
                           num_attention_heads=4, intermediate_size=64, max_position_embeddings=64)  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(0)
        GPTNeoXForCausalLM(config).save_pretrained(root / "neox")
    out["neox"] = root / "neox"
    g = torch.Generator().manual_seed(3)
    clean = torch.randint(3, 50, (N, T), generator=g)
    corrupt = clean.clone()
    corrupt[:, 2] = torch.randint(3, 50, (N,), generator=g)
    pairs = {"clean_ids": clean, "corrupt_ids": corrupt,
             "answer": torch.randint(3, 50, (N,), generator=g),
             "wrong": torch.randint(3, 50, (N,), generator=g)}  # fmt: skip
    torch.save(pairs, root / "pairs.pt")
    return out, root / "pairs.pt", pairs


def args_of(models, kind, *extra):
    paths, pairs_path, _ = models
    return ["model=hf", f"model.name={paths[kind]}", "model.task=causal_lm", "dataset=pairs",
            f"dataset.path={pairs_path}", "dataset.batch_size=2", "probes=none", *extra]  # fmt: skip


def by_hand(path, ids):
    """(each block's lens logits (L, N, T, V), final logits, the model) from plain hooks."""
    from transformers import AutoModelForCausalLM

    from probe.hooks.module_select import block_names
    from probe.models.anatomy import anatomy

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    body = anatomy(model, block_names(model))
    modules = dict(model.named_modules())
    seen = []
    hooks = [modules[b].register_forward_hook(lambda m, a, o: seen.append(o[0] if isinstance(o, tuple) else o))
             for b in body.blocks]  # fmt: skip
    with torch.no_grad():
        final = model(input_ids=ids).logits
        lens = [modules[body.unembed](modules[body.final_norm](h)) for h in seen]
    for h in hooks:
        h.remove()
    return torch.stack(lens).double().numpy(), final.double().numpy(), model, body


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.parametrize("kind", ["gpt2", "llama", "neox"])
def test_the_logit_lens_equals_hand_decoding_and_the_last_layer_the_models_logits(
    tmp_path, models, kind
):
    _, _, pairs = models
    _, f = run_probe(tmp_path, *args_of(models, kind, "lens=logit"))
    lens, final, _, _ = by_hand(models[0][kind], pairs["clean_ids"])
    logq, logp = log_softmax(lens), log_softmax(final)[None]
    kl = (np.exp(logp) * (logp - logq)).sum(-1)  # (L, N, T)
    entropy = -(np.exp(logq) * logq).sum(-1)
    top1 = logp.argmax(-1)
    at_top1 = np.take_along_axis(logq, top1[..., None], -1)[..., 0]
    next_ce = -np.take_along_axis(
        logq[:, :, :-1], pairs["clean_ids"][None, :, 1:, None].numpy(), -1
    )[..., 0]
    for name, want in (("kl", kl.mean(-1)), ("entropy", entropy.mean(-1)),
                       ("top1_prob", np.exp(at_top1).mean(-1)), ("next_ce", next_ce.mean(-1)),
                       ("agree", (logq.argmax(-1) == top1).mean(-1))):  # fmt: skip
        np.testing.assert_allclose(f[f"lens/{name}"][:], want.T, rtol=1e-4, atol=1e-5, err_msg=name)
    np.testing.assert_allclose(f["lens/kl"][:, -1], 0, atol=1e-5)  # the last layer is the model
    answer = pairs["answer"].numpy()
    rows = np.arange(N)
    np.testing.assert_allclose(
        f["lens/answer_prob"][:], np.exp(logq[:, rows, -1, answer]).T, rtol=1e-4
    )
    table = pd.read_csv(tmp_path / "lens.csv")
    np.testing.assert_allclose(table["kl"], kl.mean((1, 2)), rtol=1e-4, atol=1e-6)
    positions = f["lens/top1_prob_positions"][:]
    np.testing.assert_allclose(positions, np.exp(at_top1).transpose(1, 0, 2), rtol=1e-4, atol=1e-6)
    topk = f["lens/topk"][:]  # the first samples' top 5 tokens per layer and position
    np.testing.assert_array_equal(topk[:, :, :, 0], lens.argmax(-1).transpose(1, 0, 2)[: len(topk)])


def test_the_tuned_lens_with_zero_translators_is_the_logit_lens(tmp_path, models):
    state = {}
    for i in range(2):
        state[f"layer_translators.{i}.weight"] = torch.zeros(32, 32)
        state[f"layer_translators.{i}.bias"] = torch.zeros(32)
    (tmp_path / "tuned").mkdir()
    torch.save(state, tmp_path / "tuned" / "params.pt")
    _, logit = run_probe(tmp_path / "logit", *args_of(models, "gpt2", "lens=logit"))
    _, tuned = run_probe(
        tmp_path / "t", *args_of(models, "gpt2", "lens=tuned", f"lens.path={tmp_path / 'tuned'}")
    )
    for name in ("kl", "entropy", "next_ce", "answer_prob"):  # (the last layer: the model's
        # logits for the logit lens, decoded again through a zero translator for the tuned one)
        np.testing.assert_allclose(
            logit[f"lens/{name}"][:], tuned[f"lens/{name}"][:], rtol=1e-5, atol=1e-6
        )
        np.testing.assert_array_equal(logit[f"lens/{name}"][:, 0], tuned[f"lens/{name}"][:, 0])
    state["layer_translators.1.bias"] = torch.linspace(
        -1, 1, 32
    )  # (a constant: LayerNorm removes it)
    torch.save(state, tmp_path / "tuned" / "params.pt")
    _, moved = run_probe(
        tmp_path / "m", *args_of(models, "gpt2", "lens=tuned", f"lens.path={tmp_path / 'tuned'}")
    )
    assert np.abs(moved["lens/kl"][:, 1] - logit["lens/kl"][:, 1]).max() > 1e-3


@pytest.mark.parametrize("kind", ["gpt2", "llama", "neox"])
def test_dla_components_sum_to_the_logit_difference_and_heads_equal_a_hand_computation(
    tmp_path, models, kind
):
    _, _, pairs = models
    _, f = run_probe(tmp_path, *args_of(models, kind, "lens=dla"))
    values = f["dla/values"][:].astype(np.float64)
    names = [n.decode() for n in f["dla/components"][:]]
    own = f["dla/logit_diff"][:, 0]
    np.testing.assert_allclose(values.sum(1), own, rtol=1e-4, atol=1e-5)  # completeness
    _, final, model, body = by_hand(models[0][kind], pairs["clean_ids"])
    np.testing.assert_allclose(
        own,
        (final[:, -1, pairs["answer"]] - final[:, -1, pairs["wrong"]]).diagonal(),
        rtol=1e-4,
        atol=1e-5,
    )
    # head 1 of block 0 by hand: its slice of the projection's input times its weight slice,
    # through the final norm with its scale frozen at the final residual
    modules = dict(model.named_modules())
    held = {}
    proj = modules[body.attn_out[0]]
    h1 = proj.register_forward_pre_hook(lambda m, a: held.setdefault("z", a[0]))
    h2 = modules[body.final_norm].register_forward_pre_hook(lambda m, a: held.setdefault("x", a[0]))
    with torch.no_grad():
        model(input_ids=pairs["clean_ids"])
    h1.remove()
    h2.remove()
    heads, width = body.heads, held["z"].shape[-1]
    d = width // heads
    z = held["z"][:, -1, d : 2 * d].double()
    w = proj.weight.double()
    w = w[d : 2 * d] if type(proj).__name__ == "Conv1D" else w[:, d : 2 * d].T
    write = z @ w
    x = held["x"][:, -1].double()
    norm = modules[body.final_norm]
    rms = "RMSNorm" in type(norm).__name__
    if not rms:
        write, x = write - write.mean(-1, keepdim=True), x - x.mean(-1, keepdim=True)
    eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", 1e-5))
    scale = torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    u = modules[body.unembed].weight.double()
    direction = u[pairs["answer"]] - u[pairs["wrong"]]
    want = (write * scale * norm.weight.double() * direction).sum(-1).detach().numpy()
    column = names.index(f"attn_head|{body.attn_out[0]}|1")
    np.testing.assert_allclose(values[:, column], want, rtol=1e-4, atol=1e-6)
    table = pd.read_csv(tmp_path / "dla.csv")
    total = table[table.component == "total"]["mean"].item()
    assert total == pytest.approx(table[table.component == "logit_diff"]["mean"].item(), abs=1e-5)


@pytest.mark.parametrize(
    "extra, words",
    [
        (["model.task=base", "lens=logit"], "no unembedding (an LM head)"),
        (
            ["lens=tuned", "lens.path=@BAD"],
            "but the residual stream of transformer.h.0 has width 32",
        ),
        (
            ["dataset=random_tokens", "dataset.num_samples=2", "lens=dla"],
            "this dataset gives no answers",
        ),
    ],
)
def test_bad_lens_input_is_a_named_error(tmp_path, models, extra, words, cli_in_process):
    bad = tmp_path / "bad"
    bad.mkdir()
    torch.save({f"layer_translators.{i}.{k}": torch.zeros(*s) for i in range(2)
                for k, s in (("weight", (16, 16)), ("bias", (16,)))}, bad / "params.pt")  # fmt: skip
    given = [a.replace("@BAD", str(bad)) for a in args_of(models, "gpt2", *extra)]
    if "dataset=random_tokens" in extra:
        given = [a for a in given if not a.startswith(("dataset=pairs", "dataset.path"))]
    out = cli_in_process(*given, f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode == 2, out.stderr[-2000:]
    assert words in out.stderr and "Traceback" not in out.stderr


def test_a_lens_over_bare_tensors_names_the_token_batches_it_reads(tmp_path, models):
    """probe.run with a lens over batches of bare token-id tensors (no dict, so no token layout):
    a DataError naming the form the lens reads, not an indexing error."""
    from transformers import AutoModelForCausalLM

    import probe
    from probe.errors import DataError

    model = AutoModelForCausalLM.from_pretrained(models[0]["gpt2"])
    data = [torch.randint(3, 50, (2, T))]
    with pytest.raises(
        DataError, match="lens=logit reads token batches: give each batch as a dict"
    ):
        probe.run(model, data, "none", out=tmp_path / "run", lens="logit", progress=False)


def test_dla_refuses_a_post_norm_model(tmp_path, cli_in_process):
    from transformers import BertForMaskedLM

    from probe.testing.tiny_lms import tiny_config

    with torch.random.fork_rng():
        torch.manual_seed(0)
        BertForMaskedLM(tiny_config("bert", 40)).save_pretrained(tmp_path / "bert")
    out = cli_in_process("model=hf", f"model.name={tmp_path / 'bert'}", "model.task=masked_lm",
                         "dataset=random_tokens", "dataset.num_samples=2", "dataset.seq_len=4",
                         "probes=none", "lens=dla", "lens.tokens=[5,6]",
                         f"hydra.run.dir={tmp_path / 'run'}")  # fmt: skip
    assert out.returncode == 2 and "is a post-norm model" in out.stderr


def test_lens_at_the_last_position_reads_that_position_alone(tmp_path, models):
    _, every = run_probe(tmp_path / "all", *args_of(models, "gpt2", "lens=logit"))
    _, last = run_probe(
        tmp_path / "last", *args_of(models, "gpt2", "lens=logit", "lens.positions=last")
    )
    positions = last["lens/top1_prob_positions"][:]
    np.testing.assert_allclose(
        positions[:, :, -1], every["lens/top1_prob_positions"][:, :, -1], rtol=1e-6
    )
    assert np.isnan(positions[:, :, :-1]).all()
    np.testing.assert_allclose(last["lens/top1_prob"][:], positions[:, :, -1], rtol=1e-6)
    assert np.isnan(last["lens/next_ce"][:]).all()  # no next token at the last position
    np.testing.assert_allclose(last["lens/answer_prob"][:], every["lens/answer_prob"][:], rtol=1e-6)


def test_an_unknown_family_names_the_aliases_and_the_keys(tmp_path, lm, cli_in_process):
    """A model of a family the anatomy does not know: the alias is refused, naming the keys;
    given by hand (model.anatomy.mlp_out), it resolves below each block."""
    from probe.hooks.module_select import select_modules
    from probe.models.build import build_model
    from probe.testing.compose import make_cfg

    _, path, _ = lm
    args = ["model=custom", "model._target_=probe.testing.models.LinearLM", "dataset=pairs",
            f"dataset.path={path}", "probes=none", "+probes.x.layers=[@mlp_out]"]  # fmt: skip
    out = cli_in_process(*args, f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode == 2
    assert "@mlp_out cannot be resolved for a 'LinearLM' model" in out.stderr
    assert "model.anatomy.mlp_out=SUFFIX" in out.stderr
    plan = parse(make_cfg(*args, "+model.anatomy.mlp_out=lin"))
    chosen = select_modules(build_model(plan.model, 0), plan.probes)
    assert [s.name for s in chosen] == ["blocks.0.lin", "blocks.1.lin", "blocks.2.lin"]
