"""circuit-tracer (PyPI `circuit-tracer` 0.5.0) as the oracle of probe's attribution graphs, and
the memory of its dense adjacency against probe's sparse one.

Both sides load the same tiny model and the same random transcoders from disk:

- the model: a HuggingFace GPT-2 or Llama (grouped-query attention) with random weights (norm
  weights and biases random too, so folding them would change the function), saved with
  save_pretrained beside a word-level tokenizer; circuit-tracer gets it as a TransformerLens
  HookedTransformer built from a matching HookedTransformerConfig and TransformerLens's own
  weight conversion, loaded without folding or centring (fold_ln, center_writing_weights,
  center_unembed, fold_value_biases all off), so both compute the same function;
- the transcoders: circuit-tracer 0.5's ReLU/skip layout (layer_<i>.safetensors with W_enc
  (d_tc, d_in), W_dec (d_tc, d_out), b_enc, b_dec, optional W_skip (d_out, d_in) and JumpReLU's
  `activation_function.threshold`) and its config.yaml, loaded there by
  circuit_tracer.utils.caching.load_transcoders_from_cache (its loader of a local folder);
  the CLT cases ("clt ..."): a random cross-layer transcoder written by probe's
  save_cross_layer in circuit-tracer's CLT layout (W_enc_<l>/W_dec_<l>.safetensors, config.yaml
  with model_kind cross_layer_transcoder), read by the same loader (its load_clt) and by probe's
  load_transcoders.

`compare` (probe's venv) runs circuit-tracer's `attribute` -> Graph, `prune_graph` and
`compute_graph_scores` in circuit-tracer's venv as a subprocess (`peer`, which imports nothing
of probe) and probe's `attribute` + `prune`, and compares node sets, every adjacency entry,
influence, the pruning masks and the scores. `memory` times both in fresh subprocesses at
growing prompt lengths and reads each one's peak resident memory (ru_maxrss) above what it held
once the model and transcoders were loaded.

Reading places: circuit-tracer's `ln2.hook_normalized` is the norm's x / scale *before* its
weight and bias (TransformerLens's LayerNorm and RMSNorm, and circuit-tracer's nnsight mapping
of Gemma's): probe's `mlp_normalized`; probe's `mlp_in` is the MLP's input (after them):
circuit-tracer's `mlp.hook_in`; `resid_mid` is `hook_resid_mid`. The comparison runs each
against its hook, and shows what `mlp_in` against `ln2.hook_normalized` would give.

    PYTHONPATH=$PWD python scripts/graph_peers.py compare
    PYTHONPATH=$PWD python scripts/graph_peers.py memory --lengths 64 256 1024
    PYTHONPATH=$PWD python scripts/graph_peers.py memory --family smollm2 \
        --lengths 8 16 --variants 0 1 3   # SmolLM2-135M's shape, short prompts
    PYTHONPATH=$PWD python scripts/graph_peers.py all  # both, one run

Set up circuit-tracer's venv (torch first, from the same wheel as probe's, so pip keeps it):
`python3 -m venv venv-ct && venv-ct/bin/pip install torch==2.14.1 &&
venv-ct/bin/pip install circuit-tracer==0.5.0` (transformers 4.57.3, transformer-lens
3.2.1, nnsight 0.8.1 came with it); `--peer-python` names another.

The Gemma-2, Gemma-3, Qwen3 and second Llama cases run circuit-tracer's nnsight backend on the
HuggingFace model itself (its TransformerLens backend shares one rotary table across layers, so a
Gemma-3 with two rope bases is not the same function there). circuit-tracer 0.5's nnsight backend
imports `nnsight.intervention.tracing`, which nnsight 0.8 no longer has: put nnsight 0.6 first on
the peer's path, `pip install --target DIR "nnsight>=0.6,<0.7" astor python-socketio msgspec
zstandard` (with DIR/IPython/__init__.py defining `get_ipython()` returning None) and
GRAPH_PEERS_PEER_PATH=DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

PEER_PYTHON = "venv-ct/bin/python"  # circuit-tracer's venv (--peer-python names another)
WORK = Path(os.environ.get("GRAPH_PEERS_WORK", "/tmp/graph_peers"))
VOCAB = 512
SMOLLM2_VOCAB = 49152  # the smollm2 model's vocabulary (its prompts use the first VOCAB ids)
BOS = VOCAB - 1  # the tokenizer's special token (not 0: circuit-tracer's filter(None, ...))
CT_HOOK = {"mlp_in": "mlp.hook_in", "resid_mid": "hook_resid_mid",
           "mlp_normalized": "ln2.hook_normalized"}  # fmt: skip

# (label, family, reads, activation, skip, ct input hook or None for CT_HOOK[reads], max_feature_nodes)
CASES = [
    ("gpt2 mlp_in relu", "gpt2", "mlp_in", "relu", False, None, None),
    ("gpt2 resid_mid jumprelu skip", "gpt2", "resid_mid", "jumprelu", True, None, None),
    ("gpt2 mlp_in relu, max_feature_nodes=200", "gpt2", "mlp_in", "relu", False, None, 200),
    ("llama mlp_in jumprelu skip", "llama", "mlp_in", "jumprelu", True, None, None),
    ("llama resid_mid relu", "llama", "resid_mid", "relu", False, None, None),
    ("gpt2 mlp_normalized relu skip", "gpt2", "mlp_normalized", "relu", True, None, None),
    ("llama mlp_normalized jumprelu", "llama", "mlp_normalized", "jumprelu", False, None, None),
    (
        "gpt2 mlp_in vs ct ln2.hook_normalized",
        "gpt2", "mlp_in", "relu", False, "ln2.hook_normalized", None,
    ),
    (
        "gpt2 with ln_2 weight 1, bias 0: mlp_in vs ct ln2.hook_normalized",
        "gpt2-unit-ln2", "mlp_in", "relu", False, "ln2.hook_normalized", None,
    ),
    # circuit-tracer's nnsight backend on the HuggingFace model itself (its per-architecture
    # mappings: Gemma-2's Gemma Scope places ln2.hook_normalized -> hook_mlp_out, the MLP's write
    # after the post-feedforward norm)
    ("gemma2 mlp_normalized jumprelu skip", "gemma2", "mlp_normalized", "jumprelu", True, None, None),
    ("gemma2 resid_mid relu", "gemma2", "resid_mid", "relu", False, None, None),
    ("gemma3 mlp_normalized jumprelu skip", "gemma3", "mlp_normalized", "jumprelu", True, None, None),
    ("gemma3 mlp_in relu", "gemma3", "mlp_in", "relu", False, None, None),
    # circuit-tracer's token vectors times Gemma-3's embedding scale (see token_columns)
    ("gemma3 mlp_normalized jumprelu skip, ct token vectors scaled", "gemma3", "mlp_normalized",
     "jumprelu", True, None, None),
    ("qwen3 mlp_in jumprelu skip", "qwen3", "mlp_in", "jumprelu", True, None, None),
    ("llama (nnsight) mlp_in relu skip", "llama-nnsight", "mlp_in", "relu", True, None, None),
    # cross-layer transcoders (activation "clt <activation>"), in circuit-tracer's CLT layout
    ("gpt2 clt resid_mid relu", "gpt2", "resid_mid", "clt relu", False, None, None),
    ("llama clt mlp_in jumprelu", "llama", "mlp_in", "clt jumprelu", False, None, None),
    ("gpt2 clt mlp_normalized jumprelu, max_feature_nodes=200", "gpt2", "mlp_normalized",
     "clt jumprelu", False, None, 200),
]  # fmt: skip
NNSIGHT = ("gemma2", "gemma3", "qwen3", "llama-nnsight")  # families run on circuit-tracer's nnsight
# the MLP's write: the MLP's output, or (Gemma-2, Gemma-3) the post-feedforward norm's
CT_OUTPUT = {"gemma2": "hook_mlp_out", "gemma3": "hook_mlp_out", "qwen3": "mlp.hook_out",
             "llama-nnsight": "mlp.hook_out"}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# the shared model and transcoders (written from probe's venv)
# ---------------------------------------------------------------------------------------------
def build_model(family: str, folder: Path, n_ctx: int = 2048, seed: int = 0) -> Path:
    """A tiny random `family` (gpt2 | llama) model with random norm weights, saved with its
    tokenizer in `folder`; gpt2-unit-ln2: the gpt2 one with its MLP norms' weight 1, bias 0;
    smollm2: a Llama of SmolLM2-135M's shape (30 blocks, width 576, 9 heads over 3 key/value
    heads, intermediate 1536, vocabulary 49,152; untied head, as circuit-tracer's
    TransformerLens conversion reads it)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    torch.manual_seed(seed)
    if family in NNSIGHT:
        model = nnsight_family_model(family, n_ctx)
    elif family == "smollm2":  # SmolLM2-135M's shape, random weights
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=SMOLLM2_VOCAB, hidden_size=576, intermediate_size=1536,
            num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
            max_position_embeddings=n_ctx, rms_norm_eps=1e-5, rope_theta=100000.0,
            bos_token_id=BOS, eos_token_id=BOS, tie_word_embeddings=False,
        )  # fmt: skip
        model = LlamaForCausalLM(config)
    elif family.startswith("gpt2"):
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=VOCAB, n_positions=n_ctx, n_embd=64, n_layer=2, n_head=4,
            initializer_range=0.15, bos_token_id=BOS, eos_token_id=BOS,
            attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0, tie_word_embeddings=True,
        )  # fmt: skip
        model = GPT2LMHeadModel(config)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=n_ctx,
            initializer_range=0.15, rms_norm_eps=1e-5, rope_theta=10000.0,
            bos_token_id=BOS, eos_token_id=BOS, tie_word_embeddings=False,
        )  # fmt: skip
        model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and ("ln" in name or "norm" in name):
                if name.endswith("weight"):
                    p.copy_(1 + 0.3 * torch.randn_like(p))
                else:
                    p.copy_(0.1 * torch.randn_like(p))
        if family in ("gemma2", "gemma3"):  # Gemma's gain is 1 + weight: gains 1 + 0.3 N(0, 1)
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.sub_(1.0)
        if family == "gpt2-unit-ln2":
            for block in model.transformer.h:
                block.ln_2.weight.fill_(1.0)
                block.ln_2.bias.zero_()
    model.eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(VOCAB - 1)} | {"<|bos|>": BOS}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|bos|>", pad_token="<|bos|>",
        unk_token="t0",
    )  # fmt: skip
    fast.save_pretrained(folder)
    config_file = folder / "tokenizer_config.json"  # a class name transformers 4 knows too
    tok_config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps(tok_config | {"tokenizer_class": "PreTrainedTokenizerFast"}))
    return folder


def nnsight_family_model(family: str, n_ctx: int):
    """A tiny random Gemma-2 (softcaps, a sliding window of 4), Gemma-3 (q/k norms, local and
    global layers with their two rope bases), Qwen3 or Llama, written by transformers 5 and read
    by circuit-tracer's transformers 4 (the logits of both are compared)."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=n_ctx, initializer_range=0.15, bos_token_id=BOS,
                  eos_token_id=BOS, pad_token_id=BOS, tie_word_embeddings=False)  # fmt: skip
    if family == "gemma2":
        config = transformers.Gemma2Config(
            sliding_window=4, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
            query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention"], **common,
        )  # fmt: skip
        return transformers.Gemma2ForCausalLM(config)
    if family == "gemma3":
        config = transformers.Gemma3TextConfig(
            sliding_window=4, query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention"], **common,
        )  # fmt: skip
        return transformers.Gemma3ForCausalLM(config)
    if family == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))


def load_hf(folder: Path):
    """The saved model, float32, eval, eager attention."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()


def make_transcoders(width, layers, reads, activation, skip, *, l0=None, seed=0):
    """probe's random transcoders (about half the features active), or with `l0` encoder biases
    lowered so that about `l0` of 4 x width features fire per position."""
    import torch

    from probe.testing.random_transcoders import random_transcoders

    tset = random_transcoders(
        width, layers, reads=reads, activation=activation, skip=skip, seed=seed
    )
    if l0 is not None:
        share = torch.tensor(l0 / (4 * width), dtype=torch.float64)
        shift = float(2**0.5 * torch.erfinv(1 - 2 * share))  # N(0, 1)'s upper `share` quantile
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for t in tset.transcoders.values():  # (W_enc ~ N(0, 1 / width): pre-activations
                # ~ N(0, ~1) on norm outputs of unit rms)
                t.b_enc.copy_(-shift * torch.ones_like(t.b_enc) + 0.05 * torch.randn(
                    t.b_enc.shape, generator=g))  # fmt: skip
                if t.threshold is not None:
                    t.threshold.zero_()
    return tset


def save_ct_transcoders(
    tset, folder: Path, input_hook: str, output_hook: str = "hook_mlp_out"
) -> Path:
    """`tset` in circuit-tracer 0.5's ReLU/skip layout: layer_<i>.safetensors and config.yaml."""
    import yaml
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for layer, t in sorted(tset.transcoders.items()):
        tensors = {
            "W_enc": t.W_enc.detach().T.contiguous(),
            "W_dec": t.W_dec.detach().contiguous(),
            "b_enc": t.b_enc.detach().contiguous(),
            "b_dec": t.b_dec.detach().contiguous(),
        }
        if t.threshold is not None:
            tensors["activation_function.threshold"] = t.threshold.detach().contiguous()
        if t.W_skip is not None:
            tensors["W_skip"] = t.W_skip.detach().contiguous()
        path = folder / f"layer_{layer}.safetensors"
        save_file({k: v.float().cpu() for k, v in tensors.items()}, str(path))
        paths.append(str(path))
    config = {
        "model_kind": "transcoder_set",
        "feature_input_hook": input_hook,
        "feature_output_hook": output_hook,
        "scan": "graph-peers",
        "transcoders": paths,
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return folder


def load_ct_transcoders(folder: Path, reads: str):
    """probe's TranscoderSet read back from the circuit-tracer layout save_ct_transcoders wrote
    (both sides load the same files)."""
    import yaml
    from safetensors.torch import load_file

    from probe.models.transcoder import Transcoder, TranscoderSet

    config = yaml.safe_load((Path(folder) / "config.yaml").read_text())
    sets = {}
    for layer, path in enumerate(config["transcoders"]):
        t = load_file(path)
        threshold = t.get("activation_function.threshold")
        sets[layer] = Transcoder(
            t["W_enc"].T.contiguous(), t["b_enc"], t["W_dec"], t["b_dec"], layer=layer,
            activation="jumprelu" if threshold is not None else "relu", threshold=threshold,
            W_skip=t.get("W_skip"),
        )  # fmt: skip
    return TranscoderSet(sets, reads=reads)


def prompt_ids(n_tokens: int, seed: int = 0):
    """BOS then n_tokens - 1 random ids."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.cat(
        [torch.tensor([BOS]), torch.randint(0, VOCAB - 1, (n_tokens - 1,), generator=g)]
    )


# ---------------------------------------------------------------------------------------------
# circuit-tracer's side (its venv; imports nothing of probe)
# ---------------------------------------------------------------------------------------------
def ct_model(model_dir: Path, tc_dir: Path):
    """circuit-tracer's TransformerLens replacement model on the saved HF model's weights."""
    import torch
    from circuit_tracer.replacement_model.replacement_model_transformerlens import (
        TransformerLensReplacementModel,
    )
    from circuit_tracer.utils.caching import load_transcoders_from_cache
    from transformer_lens import HookedTransformerConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    c = hf.config
    if c.model_type == "gpt2":
        from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights

        cfg = HookedTransformerConfig(
            n_layers=c.n_layer, d_model=c.n_embd, n_heads=c.n_head, d_head=c.n_embd // c.n_head,
            d_mlp=c.n_inner or 4 * c.n_embd, d_vocab=c.vocab_size, n_ctx=c.n_positions,
            act_fn="gelu_new", normalization_type="LN", eps=c.layer_norm_epsilon,
            original_architecture="GPT2LMHeadModel", default_prepend_bos=False,
            device="cpu", dtype=torch.float32, model_name="tiny-gpt2",
        )  # fmt: skip
        state = convert_gpt2_weights(hf, cfg)
    else:
        from transformer_lens.pretrained.weight_conversions import convert_llama_weights

        cfg = HookedTransformerConfig(
            n_layers=c.num_hidden_layers, d_model=c.hidden_size, n_heads=c.num_attention_heads,
            d_head=c.hidden_size // c.num_attention_heads, d_mlp=c.intermediate_size,
            d_vocab=c.vocab_size, n_ctx=c.max_position_embeddings, act_fn="silu",
            normalization_type="RMS", eps=c.rms_norm_eps, positional_embedding_type="rotary",
            rotary_dim=c.hidden_size // c.num_attention_heads, rotary_base=c.rope_theta,
            rotary_adjacent_pairs=False, gated_mlp=True, final_rms=True,
            n_key_value_heads=c.num_key_value_heads, original_architecture="LlamaForCausalLM",
            default_prepend_bos=False, device="cpu", dtype=torch.float32,
            model_name="tiny-llama",
        )  # fmt: skip
        state = convert_llama_weights(hf, cfg)
    model = TransformerLensReplacementModel(cfg, tokenizer=tok, move_to_device=False)
    model.load_and_process_state_dict(
        state, fold_ln=False, center_writing_weights=False, center_unembed=False,
        fold_value_biases=False,
    )  # fmt: skip
    transcoders, _ = load_transcoders_from_cache(
        tc_dir.name, cache_dir=tc_dir.parent, device=torch.device("cpu"), dtype=torch.float32,
        lazy_encoder=False, lazy_decoder=False,
    )  # fmt: skip
    model._configure_replacement_model(transcoders)
    model.eval()
    return model, hf


def ct_nnsight_model(model_dir: Path, tc_dir: Path):
    """circuit-tracer's nnsight replacement model on the saved HF model itself."""
    import torch
    from circuit_tracer.replacement_model.replacement_model_nnsight import NNSightReplacementModel
    from circuit_tracer.utils.caching import load_transcoders_from_cache

    transcoders, _ = load_transcoders_from_cache(
        tc_dir.name, cache_dir=tc_dir.parent, device=torch.device("cpu"), dtype=torch.float32,
        lazy_encoder=False, lazy_decoder=False,
    )  # fmt: skip
    return NNSightReplacementModel.from_pretrained_and_transcoders(
        str(model_dir), transcoders, device=torch.device("cpu"), dtype=torch.float32
    )


def run_peer(args) -> None:
    """circuit-tracer's graph of the prompt, pruned and scored, into an npz."""
    import torch
    from circuit_tracer import attribute
    from circuit_tracer.graph import compute_graph_scores, compute_node_influence, prune_graph

    torch.set_num_threads(args.threads)
    ids = torch.tensor(json.loads(Path(args.tokens).read_text()))
    if args.nnsight:
        from transformers import AutoModelForCausalLM

        model = ct_nnsight_model(Path(args.model), Path(args.transcoders))
        if args.scaled_token_vectors:  # the embedding module's output, as the gradient's place
            model.embed_weight = model.embed_weight * model.config.hidden_size**0.5
        hf = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="eager").eval()
        with torch.no_grad():  # the model as transformers 4 computes it
            tl_logits = hf_logits = hf(ids[None]).logits[0, -1].float()
    else:
        model, hf = ct_model(Path(args.model), Path(args.transcoders))
        with torch.no_grad():  # the function both sides compute
            tl_logits = model(ids[None])[0, -1].float()
            hf_logits = hf(ids[None]).logits[0, -1].float()
    graph = attribute(
        ids, model, batch_size=args.batch_size, max_feature_nodes=args.max_feature_nodes,
        max_n_logits=10, desired_logit_prob=0.95,
    )  # fmt: skip
    pruned = prune_graph(graph, node_threshold=0.8, edge_threshold=0.98)
    replacement, completeness = compute_graph_scores(graph)
    weights = torch.zeros(graph.adjacency_matrix.shape[0])
    weights[-len(graph.logit_targets) :] = graph.logit_probabilities
    influence = compute_node_influence(graph.adjacency_matrix, weights)
    sel = graph.selected_features
    np.savez(
        args.out,
        adjacency=graph.adjacency_matrix.numpy(),
        features=graph.active_features[sel].numpy(),
        activations=graph.activation_values[sel].float().numpy(),
        n_active=np.int64(graph.active_features.shape[0]),
        logit_tokens=graph.logit_token_ids.numpy(),
        logit_probs=graph.logit_probabilities.float().numpy(),
        influence=influence.numpy(),
        node_mask=pruned.node_mask.numpy(),
        edge_mask=pruned.edge_mask.numpy(),
        cumulative=pruned.cumulative_scores.numpy(),
        scores=np.array([replacement, completeness]),
        tl_vs_hf=np.float64((tl_logits - hf_logits).abs().max()),
        peer_logits=hf_logits.numpy(),
    )


# ---------------------------------------------------------------------------------------------
# probe's side and the comparison (probe's venv)
# ---------------------------------------------------------------------------------------------
def ours(model, ids, tset, batch_size, max_feature_nodes=None, floor=0.0):
    from probe.graphs.attribution import GraphOptions, attribute

    options = GraphOptions(batch_size=batch_size, max_feature_nodes=max_feature_nodes, floor=floor)
    graph = attribute(model, ids, tset, options)
    return graph.prune(0.8, 0.98)


def peer_call(python, role_args, threads=2, env=None) -> subprocess.CompletedProcess:
    """This script's `role_args` run by `python` (circuit-tracer's venv: without PYTHONPATH, so
    it imports nothing of probe)."""
    env = dict(env or os.environ)
    if python == PEER_PYTHON or "venv-ct" in python:
        env.pop("PYTHONPATH", None)
        if os.environ.get("GRAPH_PEERS_PEER_PATH"):  # e.g. nnsight 0.6 for the nnsight backend
            env["PYTHONPATH"] = os.environ["GRAPH_PEERS_PEER_PATH"]
    env |= {"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # fmt: skip
    cmd = [python, str(Path(__file__).resolve()), *role_args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)


def rel(a, b) -> float:
    scale = float(np.abs(b).max()) or 1.0
    return float(np.abs(a - b).max()) / scale if a.size else 0.0


def compare_case(case, args) -> dict:
    import torch

    label, family, reads, activation, skip, ct_hook, max_nodes = case
    torch.manual_seed(0)
    model_dir = WORK / f"model-{family}"
    if not (model_dir / "config.json").exists():
        build_model(family, model_dir)
    model = load_hf(model_dir)
    tc_dir = WORK / f"tc-{''.join(c for c in label.replace(' ', '_') if c not in ',=()')}"
    if activation.startswith("clt "):  # both sides read circuit-tracer's CLT files
        from probe.models.clt_files import save_cross_layer
        from probe.models.transcoder_files import load_transcoders
        from probe.testing.random_transcoders import random_cross_layer

        clt = random_cross_layer(64, 2, reads=reads, activation=activation[4:], seed=3)
        save_cross_layer(clt, tc_dir)
        transcoders = load_transcoders(tc_dir)
    else:
        tset = make_transcoders(64, 2, reads, activation, skip, seed=3)
        save_ct_transcoders(
            tset, tc_dir, ct_hook or CT_HOOK[reads], CT_OUTPUT.get(family, "hook_mlp_out")
        )
        transcoders = load_ct_transcoders(tc_dir, reads)
    ids = prompt_ids(args.compare_tokens, seed=1)
    tokens = WORK / "tokens.json"
    tokens.write_text(json.dumps(ids.tolist()))
    out = WORK / "peer.npz"
    role = ["peer", "--model", str(model_dir), "--transcoders", str(tc_dir), "--tokens",
            str(tokens), "--out", str(out), "--batch-size", str(args.batch_size)]  # fmt: skip
    if max_nodes:
        role += ["--max-feature-nodes", str(max_nodes)]
    if family in NNSIGHT:
        role += ["--nnsight"]
    if "ct token vectors scaled" in label:
        role += ["--scaled-token-vectors"]
    done = peer_call(args.peer_python, role)
    if done.returncode != 0:
        raise RuntimeError(f"circuit-tracer failed on {label}:\n{done.stderr[-3000:]}")
    ct = dict(np.load(out))
    g = ours(model, ids, transcoders, args.batch_size, max_nodes)
    row = diff(label, g, ct)
    with torch.no_grad():  # transformers 5 (probe) against circuit-tracer's transformers 4
        logits = model(ids[None]).logits[0, -1].float().numpy()
    row["hf5 vs peer logits"] = float(np.abs(logits - ct["peer_logits"]).max())
    if "note" not in row:
        row.update(token_columns(g, ct, model))
    return row


def token_columns(g, ct, model) -> dict:
    """The adjacency without the token nodes' columns, and probe's token columns over
    circuit-tracer's: circuit-tracer's nnsight backend takes a token's vector as the raw
    embedding row, so where the embedding module scales its output (Gemma-3's
    Gemma3TextScaledWordEmbedding) its token edges are 1 / scale of the direct effect, which
    probe takes at the module's output (the frozen-forward perturbation's)."""
    a = g.adjacency.to_dense().double().numpy()
    b = ct["adjacency"].astype(np.float64)
    tok = slice(g.offsets["token"], g.offsets["token"] + g.n_pos)
    others = np.ones(a.shape[1], bool)
    others[tok] = False
    out = {"adjacency, tokens' columns aside": rel(a[:, others], b[:, others])}
    big = np.abs(b[:, tok]) > 1e-3 * np.abs(b[:, tok]).max()
    ratio = a[:, tok][big] / b[:, tok][big]
    scale = getattr(model.get_input_embeddings(), "scalar_embed_scale", 1.0)
    out["tokens' columns probe / ct"] = (
        f"{ratio.min():.6g}..{ratio.max():.6g} (embed scale {scale:.6g})"
    )
    return out


def diff(label, g, ct) -> dict:
    a = g.adjacency.to_dense().double().numpy()
    n = g.n_nodes
    same_shape = a.shape == ct["adjacency"].shape
    row = {"case": label, "nodes": n, "ct nodes": ct["adjacency"].shape[0]}
    row["features"] = bool(
        g.features.numpy().shape == ct["features"].shape
        and (g.features.numpy() == ct["features"]).all()
    )
    row["active"] = f"{g.active_features}/{int(ct['n_active'])}"
    row["logits"] = bool(
        g.logit_tokens.numpy().shape == ct["logit_tokens"].shape
        and (g.logit_tokens.numpy() == ct["logit_tokens"]).all()
    )
    if not (same_shape and row["features"] and row["logits"]):
        row["note"] = "node sets differ"
        return row
    b = ct["adjacency"].astype(np.float64)
    row["activation"] = rel(g.activations.double().numpy(), ct["activations"])
    row["probability"] = rel(g.logit_probs.double().numpy(), ct["logit_probs"])
    row["adjacency"] = rel(a, b)
    big = np.abs(a - b) > 1e-4 * np.abs(b).max()
    row["entries > 1e-4"] = int(big.sum())
    if big.any():
        t, s = np.nonzero(big)
        row["worst"] = describe(g, t[:5], s[:5])
    row["influence"] = rel(g.influence.numpy(), ct["influence"].astype(np.float64))
    row["cumulative"] = rel(g.cumulative.numpy(), ct["cumulative"].astype(np.float64))
    row["node masks"] = int((g.node_kept.numpy() != ct["node_mask"]).sum())
    mask = np.zeros((n, n), bool)
    idx = g.adjacency.coalesce().indices().numpy()
    mask[idx[0][g.edge_kept.numpy()], idx[1][g.edge_kept.numpy()]] = True
    row["edge masks"] = int((mask != ct["edge_mask"]).sum())
    row["kept"] = f"{int(g.node_kept.sum())} nodes, {int(mask.sum())} edges"
    row["replacement"] = abs(g.scores["replacement"] - float(ct["scores"][0]))
    row["completeness"] = abs(g.scores["completeness"] - float(ct["scores"][1]))
    row["scores"] = f"{g.scores['replacement']:.4f} / {g.scores['completeness']:.4f}"
    row["tl vs hf"] = float(ct["tl_vs_hf"])
    return row


def describe(g, targets, sources) -> str:
    kinds = g.nodes()
    return "; ".join(
        f"{kinds.kind[t]}({kinds.layer[t]},{kinds.pos[t]})<-{kinds.kind[s]}({kinds.layer[s]},{kinds.pos[s]})"
        for t, s in zip(targets, sources, strict=True)
    )


def compare(args) -> list[dict]:
    rows = []
    for case in [CASES[i] for i in (args.cases or range(len(CASES)))]:
        start = time.time()
        row = compare_case(case, args)
        print(f"{case[0]}: {json.dumps(row)} ({time.time() - start:.0f} s)", flush=True)
        rows.append(row)
    return rows


def compare_table(rows, args) -> str:
    head = ("case", "nodes", "active", "features", "logits", "activation", "probability", "adjacency",
            "entries > 1e-4", "influence", "cumulative", "node masks", "edge masks",
            "replacement", "completeness", "kept", "scores")  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = []
        for h in head:
            v = r.get(h, "-")
            if isinstance(v, bool):
                v = "equal" if v else "differ"
            elif isinstance(v, float):
                v = f"{v:.1e}" if v else "0"
            cells.append(str(v))
        lines.append("| " + " | ".join(cells) + " |")
    notes = [f"- {r['case']}: {r['note']}" for r in rows if "note" in r]
    notes += [f"- {r['case']}: differing entries {r['worst']}" for r in rows if "worst" in r]
    return "\n".join(lines + ([""] + notes if notes else []))


# ---------------------------------------------------------------------------------------------
# memory: one side at one length, in a fresh process
# ---------------------------------------------------------------------------------------------
def rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_mem(args) -> None:
    """Attribute and prune one prompt of args.length tokens; print JSON figures."""
    import torch

    torch.set_num_threads(args.threads)
    ids = torch.tensor(json.loads(Path(args.tokens).read_text()))
    if args.side == "peer":
        from circuit_tracer import attribute
        from circuit_tracer.graph import compute_graph_scores, prune_graph

        model, hf = ct_model(Path(args.model), Path(args.transcoders))
        del hf
    else:
        from probe.graphs.attribution import GraphOptions, attribute

        model = load_hf(Path(args.model))
        tset = load_ct_transcoders(Path(args.transcoders), "mlp_in")
        batch = None if args.planned else args.batch_size  # None: the memory plan's
    import gc

    warm = ids[:8]  # one small graph first, so lazy imports and one-time setup are not counted
    if args.side == "peer":
        prune_graph(attribute(warm, model, batch_size=args.batch_size))
    else:
        options = GraphOptions(batch_size=batch, floor=args.floor)
        attribute(model, warm, tset, options).prune()
    gc.collect()
    base, start = rss_mb(), time.perf_counter()
    if args.side == "peer":
        graph = attribute(ids, model, batch_size=args.batch_size)
        n_nodes, stored = graph.adjacency_matrix.shape[0], graph.adjacency_matrix.numel()
    else:
        graph = attribute(model, ids, tset, options)
        n_nodes, stored = graph.n_nodes, graph.adjacency._nnz()
        args.batch_size = graph.batch
    t_attr, p_attr = time.perf_counter() - start, peak_mb()
    if args.side == "peer":
        pruned = prune_graph(graph)
        scores = compute_graph_scores(graph)
        floor = 0.0
    else:
        graph.prune()
        scores = (graph.scores["replacement"], graph.scores["completeness"])
        floor = graph.floor
    t_all, p_all = time.perf_counter() - start, peak_mb()
    if args.side == "peer":
        node_mask, edges = pruned.node_mask.numpy(), np.stack(np.nonzero(pruned.edge_mask.numpy()))
    else:
        node_mask = graph.node_kept.numpy()
        edges = graph.adjacency.coalesce().indices().numpy()[:, graph.edge_kept.numpy()]
    np.savez(args.out, node_mask=node_mask, edges=edges, scores=np.array(scores))
    print(json.dumps({
        "base_mb": base, "attribute_mb": max(0.0, p_attr - base), "all_mb": max(0.0, p_all - base),
        "attribute_s": t_attr, "all_s": t_all, "nodes": int(n_nodes), "stored": int(stored),
        "floor": floor, "batch": args.batch_size,
    }))  # fmt: skip


VARIANTS = (  # (label, side, floor for probe: None = its default rule, probe's batch planned)
    ("circuit-tracer", "peer", None, False),
    ("probe, default floor", "ours", None, False),
    ("probe, floor 0", "ours", 0.0, False),
    ("probe, batch of the memory plan", "ours", None, True),
)


def memory(args) -> list[dict]:
    """Every variant at each length, each in a fresh process, one after the other."""
    family = args.family
    model_dir = WORK / f"model-{family}"
    if not (model_dir / "config.json").exists():
        build_model(family, model_dir)
    width, layers = (576, 30) if family == "smollm2" else (64, 2)
    tset = make_transcoders(width, layers, "mlp_in", "relu", False, l0=args.l0, seed=5)
    tc_dir = save_ct_transcoders(tset, WORK / f"tc-memory-{family}", "mlp.hook_in")
    env = dict(os.environ) | {"OMP_NUM_THREADS": str(args.threads)}
    if args.mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    rows = []
    for length in args.lengths:
        tokens = WORK / f"tokens-{length}.json"
        tokens.write_text(json.dumps(prompt_ids(length, seed=2).tolist()))
        role = ["mem", "--model", str(model_dir), "--transcoders", str(tc_dir), "--tokens",
                str(tokens), "--batch-size", str(args.batch_size), "--threads",
                str(args.threads)]  # fmt: skip
        peer_file = WORK / f"mem-peer-{length}.npz"
        for i, (label, side, floor, planned) in enumerate(VARIANTS):
            if args.variants and i not in args.variants:
                continue
            out = peer_file if side == "peer" else WORK / f"mem-ours{i}-{length}.npz"
            call = [*role, "--out", str(out), "--side", side]
            if floor is not None:
                call += ["--floor", str(floor)]
            if planned:
                call += ["--planned"]
            python = args.peer_python if side == "peer" else sys.executable
            done = peer_call(python, call, args.threads, env=env)
            row = {"tokens": length, "variant": label}
            if done.returncode != 0:
                row["error"] = done.stderr[-2000:]
                print(f"{length} tokens, {label}: failed\n{row['error']}", flush=True)
            else:
                row |= json.loads(done.stdout.strip().splitlines()[-1])
                if side == "ours" and peer_file.exists():
                    row["same"] = same_pruning(out, peer_file)
                print(f"{length} tokens, {label}: {json.dumps(row)}", flush=True)
            rows.append(row)
    return rows


def same_pruning(ours_file: Path, peer_file: Path) -> dict:
    """How the two pruned graphs differ: nodes and edges kept by one side only, score gaps."""
    o, p = np.load(ours_file), np.load(peer_file)
    if o["node_mask"].shape != p["node_mask"].shape:  # other node sets: nothing to match
        return {"nodes kept": int(p["node_mask"].sum()), "node masks": "sets differ",
                "edges kept": 0, "edge masks": "-", "scores": float("nan")}  # fmt: skip
    node_diff = int((o["node_mask"] != p["node_mask"]).sum())
    oe = set(map(tuple, o["edges"].T.tolist()))
    pe = set(map(tuple, p["edges"].T.tolist()))
    return {
        "nodes kept": int(p["node_mask"].sum()), "node masks": node_diff,
        "edges kept": len(pe), "edge masks": len(oe ^ pe),
        "scores": float(np.abs(o["scores"] - p["scores"]).max()),
    }  # fmt: skip


def memory_table(rows) -> str:
    head = ("tokens", "nodes", "variant", "entries stored", "floor",
            "peak MB: attribute", "peak MB: + prune and scores", "circuit-tracer's peak / this",
            "s", "pruned nodes, edges differing from circuit-tracer's", "largest score gap",
            "batch")  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    peers = {r["tokens"]: r for r in rows if r["variant"] == "circuit-tracer" and "error" not in r}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['tokens']} | - | {r['variant']} | failed |" + " |" * 8)
            continue
        p = peers.get(r["tokens"])
        ratio = (
            f"{p['all_mb'] / max(r['all_mb'], 0.1):.1f}x"
            if p and r["variant"] != "circuit-tracer"
            else "-"
        )
        same = r.get("same")
        differ = f"{same['node masks']}, {same['edge masks']}" if same else "-"
        gap = f"{same['scores']:.1e}" if same else "-"
        lines.append(
            f"| {r['tokens']} | {r['nodes']:,} | {r['variant']} | {r['stored']:,} | {r['floor']:g} "
            f"| {r['attribute_mb']:,.0f} | {r['all_mb']:,.0f} | {ratio} | {r['all_s']:.1f} "
            f"| {differ} | {gap} | {r.get('batch', '-')} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("role", choices=("compare", "memory", "all", "peer", "mem"))
    parser.add_argument("--peer-python", default=PEER_PYTHON)
    parser.add_argument("--compare-tokens", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--l0", type=float, default=4.0, help="memory runs: features a position")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cases", type=int, nargs="+", help="compare: these of CASES only")
    # the subprocess roles
    parser.add_argument("--model")
    parser.add_argument("--transcoders")
    parser.add_argument("--tokens")
    parser.add_argument("--out")
    parser.add_argument("--side", choices=("ours", "peer"))
    parser.add_argument("--max-feature-nodes", type=int)
    parser.add_argument(
        "--nnsight", action="store_true", help="peer: circuit-tracer's nnsight backend"
    )
    parser.add_argument("--scaled-token-vectors", action="store_true",
                        help="peer: token vectors times sqrt(width) (Gemma-3's embedding scale)")  # fmt: skip
    parser.add_argument("--floor", type=float, help="mem, probe: the floor (default: its rule)")
    parser.add_argument("--planned", action="store_true",
                        help="mem, probe: the batch of its memory plan (not --batch-size)")  # fmt: skip
    parser.add_argument("--family", choices=("gpt2", "smollm2"), default="gpt2",
                        help="memory: the model (smollm2: SmolLM2-135M's shape)")  # fmt: skip
    parser.add_argument("--variants", type=int, nargs="+",
                        help="memory: these of VARIANTS only (0 circuit-tracer, 1-3 probe)")  # fmt: skip
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        help="memory: MALLOC_MMAP_THRESHOLD_ for every run (glibc's default: dynamic)",
    )
    args = parser.parse_args(argv)
    if args.role == "peer":
        return run_peer(args)
    if args.role == "mem":
        return run_mem(args)
    import torch

    torch.set_num_threads(args.threads)
    WORK.mkdir(parents=True, exist_ok=True)
    if args.role in ("compare", "all"):
        table = compare_table(compare(args), args)
        print(table)
    if args.role in ("memory", "all"):
        table = memory_table(memory(args))
        print(table)


if __name__ == "__main__":
    main()
