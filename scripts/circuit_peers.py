"""The published EAP implementations scripts/bench_circuits.py times beside probe's `eap`:
hannamw/EAP-IG's `attribute(..., method="EAP")` and auto-circuit's edge attribution patching
(its registry's "EAP": `mask_gradient_prune_scores` with logit gradients, the answer difference
and every mask at 0), each on a TransformerLens HookedTransformer (`use_attn_result`,
`use_split_qkv_input`, `use_hook_mlp_in`) holding the same GPT-2 weights, unprocessed.

Both need HookedTransformer, which TransformerLens 4 no longer has (3.9 is the last with it), and
hannamw/EAP-IG is not on PyPI: scripts/bench_circuits.py's docstring says how to set up the venv.
Three adaptations, none in the algorithms: EAP-IG's `tokenize_plus` (strings through the
model's tokenizer) is given the batch's token ids as they are; its score matrix, made on 'cuda'
by name, is made on the model's device; auto-circuit's two imports of the KV cache class that
TransformerLens 3.9 renamed (HookedTransformerKeyValueCache, used only for shared prefixes) are
pointed at the new name.

`peers(model, device)` gives {label: (run, scores)}: `run(batch)` the timed call, `scores(batch)`
the per-edge scores in probe's sign and scale (the mean over pairs of the gradient of the logit
difference times corrupt - clean) by EAP-IG's edge names; and the peers skipped, with why.
"""

from __future__ import annotations

import sys
import types


def hooked_transformer(model, device):
    """A TransformerLens HookedTransformer with GPT2LMHeadModel `model`'s weights, no folding or
    centring (so every head's and MLP's write is the HuggingFace model's), EAP's hooks on."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights

    c = model.config
    cfg = HookedTransformerConfig(
        n_layers=c.n_layer, d_model=c.n_embd, n_heads=c.n_head, d_head=c.n_embd // c.n_head,
        d_mlp=c.n_inner or 4 * c.n_embd, d_vocab=c.vocab_size, n_ctx=c.n_positions,
        act_fn="gelu_new", normalization_type="LN", eps=c.layer_norm_epsilon,
        original_architecture="GPT2LMHeadModel", default_prepend_bos=False, device=device,
        use_attn_result=True, use_split_qkv_input=True, use_hook_mlp_in=True,
    )  # fmt: skip
    ht = HookedTransformer(cfg, move_to_device=False)
    ht.load_and_process_state_dict(
        convert_gpt2_weights(model, cfg), fold_ln=False, center_writing_weights=False,
        center_unembed=False, fold_value_biases=False,
    )  # fmt: skip
    return ht.to(device).eval()


def _logit_diff(logits, answers):
    """(n,) answer logit - wrong logit at the last position; answers (n, 2)."""
    import torch

    last = logits[:, -1]
    rows = torch.arange(len(last), device=last.device)
    answers = answers.to(last.device)
    return last[rows, answers[:, 0]] - last[rows, answers[:, 1]]


def eap_ig(model, device):
    """hannamw/EAP-IG's EAP: (run, scores) over one batch."""
    import torch
    from eap import attribute as eap_attribute
    from eap.graph import Graph

    ht = hooked_transformer(model, device)
    graph = Graph.from_model(ht)

    def ids_as_they_are(model, inputs, max_length=None):  # tokenize_plus for token ids
        mask = torch.ones_like(inputs)
        return inputs.to(device), mask.to(device), mask.sum(1).to(device), inputs.shape[1]

    class TorchHere(types.ModuleType):  # torch, with the score matrix made on `device`
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def zeros(*args, device=None, **kwargs):
            return torch.zeros(*args, device=ht.cfg.device, **kwargs)

    eap_attribute.tokenize_plus = ids_as_they_are
    if device != "cuda":
        eap_attribute.torch = TorchHere("torch")

    def metric(logits, clean_logits, input_lengths, label):
        return _logit_diff(logits, label).sum()  # EAP-IG divides the scores by the pairs

    def run(batch):
        answers = torch.cat([batch["answer"], batch["wrong"]], 1)
        loader = [(batch["input_ids"], batch["corrupt_ids"], answers)]
        eap_attribute.attribute(ht, graph, loader, metric, method="EAP", quiet=True)
        ht.zero_grad(set_to_none=True)

    def scores(batch):
        run(batch)
        return {name: float(e.score) for name, e in graph.edges.items()}

    return run, scores


def auto_circuit(model, device):
    """auto-circuit's EAP (mask gradients at mask 0, logit difference): (run, scores)."""
    import torch
    import transformer_lens

    cache = transformer_lens.TransformerLensKeyValueCache
    old = types.ModuleType("transformer_lens.past_key_value_caching")
    old.HookedTransformerKeyValueCache = cache
    sys.modules.setdefault("transformer_lens.past_key_value_caching", old)
    transformer_lens.HookedTransformerKeyValueCache = cache

    from auto_circuit.data import PromptDataLoader, PromptDataset
    from auto_circuit.prune_algos.prune_algos import LOGIT_DIFF_GRAD_PRUNE_ALGO
    from auto_circuit.utils.graph_utils import patchable_model

    ht = hooked_transformer(model, device)
    pm = patchable_model(ht, factorized=True, slice_output="last_seq", separate_qkv=True,
                         device=torch.device(device))  # fmt: skip
    names = {e: _edge_name(e) for e in pm.edges}

    def loader(batch):
        data = PromptDataset(list(batch["input_ids"]), list(batch["corrupt_ids"]),
                             list(batch["answer"]), list(batch["wrong"]))  # fmt: skip
        return PromptDataLoader(data, seq_len=None, diverge_idx=0, batch_size=len(data))

    def run(batch):
        return LOGIT_DIFF_GRAD_PRUNE_ALGO.func(pm, loader(batch), None)

    def scores(batch):
        got = run(batch)
        # the gradient of minus the mean answer difference at mask 0 (the clean run), the mask
        # moving an edge to its corrupt value: minus probe's score
        return {names[e]: -float(e.prune_score(got)) for e in pm.edges}

    return run, scores


def _edge_name(edge) -> str:
    """auto-circuit's edge (`A0.1->A1.2.Q`, `Resid Start`, `MLP 0`, `Resid End`) by EAP-IG's name
    (`a0.h1->a1.h2<q>`, `input`, `m0`, `logits`)."""

    def node(name):
        if name == "Resid Start":
            return "input", ""
        if name == "Resid End":
            return "logits", ""
        if name.startswith("MLP "):
            return f"m{name[4:]}", ""
        layer, head, *qkv = name[1:].split(".")
        return f"a{layer}.h{head}", f"<{qkv[0].lower()}>" if qkv else ""

    (src, _), (dest, qkv) = node(edge.src.name), node(edge.dest.name)
    return f"{src}->{dest}{qkv}"


PEERS = {"hannamw/EAP-IG's EAP": eap_ig, "auto-circuit's EAP": auto_circuit}


def peers(model, device):
    """{label: (run, scores)} of the peers that import here, and [(label, why)] of the rest."""
    try:
        import transformer_lens
    except ImportError as e:
        return {}, [(label, f"TransformerLens is not installed ({e})") for label in PEERS]
    version = getattr(transformer_lens, "__version__", None)
    if version is None:
        from importlib.metadata import version as installed

        version = installed("transformer-lens")
    got, skipped = {}, []
    for label, make in PEERS.items():
        try:
            got[f"{label} (TransformerLens {version})"] = make(model, device)
        except ImportError as e:
            skipped.append((label, f"{type(e).__name__}: {e}"))
    return got, skipped
