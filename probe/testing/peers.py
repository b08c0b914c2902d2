"""hannamw/EAP-IG's EAP run through TransformerLens's own hook points: the peer that the circuits
tests check probe's edge scores against and that scripts/bench_circuits.py times.

EAP-IG's `get_scores_eap`: every node's activation difference added by forward hooks on the
corrupt run and subtracted on the clean one, (batch, positions, senders, width) at once, then
scored at every receiver by backward hooks at the split q/k/v inputs, `hook_mlp_in` and the last
`hook_resid_post` into a (senders, receivers) matrix. TransformerLens 4 (the one that installs
beside transformers 5) has no HookedTransformer; its TransformerBridge wraps the HuggingFace
model, and with grouped-query attention its split key and value inputs are per key/value head,
as probe's receivers are.
"""

from __future__ import annotations

from pathlib import Path


def bridge(model, folder, device: str = "cpu"):
    """A TransformerBridge over a copy of `model` saved into `folder` (eager attention, a tokenizer
    built locally), with EAP-IG's hooks on."""
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from probe.testing.tiny_lms import make_tokenizer

    folder = Path(folder)
    model.save_pretrained(folder / "model")
    hf = AutoModelForCausalLM.from_pretrained(folder / "model", attn_implementation="eager")
    tok = AutoTokenizer.from_pretrained(make_tokenizer(folder / "tok"))
    b = TransformerBridge.boot_transformers(
        str(folder / "model"), hf_model=hf.eval().to(device), tokenizer=tok, device=device
    )
    b.enable_compatibility_mode(no_processing=True, disable_warnings=True)
    b.set_use_split_qkv_input(True)
    b.set_use_attn_result(True)
    b.set_use_hook_mlp_in(True)
    return b


def node_names(b) -> tuple[list[str], list[str]]:
    """EAP-IG's senders (`input`, `a{layer}.h{head}`, `m{layer}`) and receivers (`a{l}.h{h}<q>`,
    per key/value head `<k>` and `<v>`, `m{l}`, `logits`) of the bridged model, in its order."""
    cfg = b.cfg
    L, H = cfg.n_layers, cfg.n_heads
    K = getattr(cfg, "n_key_value_heads", None) or H
    senders = ["input"] + [
        n for j in range(L) for n in [f"a{j}.h{h}" for h in range(H)] + [f"m{j}"]
    ]
    receivers = []
    for j in range(L):
        for c, count in (("q", H), ("k", K), ("v", K)):
            receivers += [f"a{j}.h{h}<{c}>" for h in range(count)]
        receivers.append(f"m{j}")
    return senders, receivers + ["logits"]


def eap_scores(b, batch, metric):
    """EAP-IG's EAP on one batch of pairs: the (senders, receivers) matrix of mean scores, in
    node_names' order (a receiver reads only the senders before it; the rest stay 0).
    `metric(logits, batch)` gives the per-sample value whose gradient is taken."""
    import torch

    cfg = b.cfg
    L, H = cfg.n_layers, cfg.n_heads
    K = getattr(cfg, "n_key_value_heads", None) or H
    device = next(b.parameters()).device
    ids, corrupt = batch["input_ids"].to(device), batch["corrupt_ids"].to(device)
    senders, receivers = node_names(b)
    diff = torch.zeros(*ids.shape, len(senders), cfg.d_model, device=device)
    scores = torch.zeros(len(senders), len(receivers), device=device)

    def act(index, sign):
        def hook(x, hook):
            diff[:, :, index] += sign * x.detach()

        return hook

    def fwd(sign):
        hooks = [("hook_embed", act(0, sign))]
        for j in range(L):
            first = 1 + j * (H + 1)
            hooks.append((f"blocks.{j}.attn.hook_result", act(slice(first, first + H), sign)))
            hooks.append((f"blocks.{j}.hook_mlp_out", act(first + H, sign)))
        return hooks

    def grad(columns: slice, prev: int):
        def hook(g, hook):
            g = g.detach()
            g = g if g.ndim == 4 else g[:, :, None]
            scores[:prev, columns] += torch.einsum("ntfd,ntbd->fb", diff[:, :, :prev], g)

        return hook

    bwd, column = [], 0
    for j in range(L):
        prev = 1 + j * (H + 1)
        for c, count in (("q", H), ("k", K), ("v", K)):
            bwd.append((f"blocks.{j}.hook_{c}_input", grad(slice(column, column + count), prev)))
            column += count
        bwd.append((f"blocks.{j}.hook_mlp_in", grad(slice(column, column + 1), prev + H)))
        column += 1
    bwd.append((f"blocks.{L - 1}.hook_resid_post", grad(slice(column, column + 1), len(senders))))
    with torch.no_grad(), b.hooks(fwd_hooks=fwd(1)):
        b(corrupt)
    with b.hooks(fwd_hooks=fwd(-1), bwd_hooks=bwd):
        logits = b(ids)
        metric(logits, batch).sum().backward()
    return scores / len(ids)


def edge_scores(b, batch, metric) -> dict[str, float]:
    """eap_scores by EAP-IG's edge names (`sender->receiver`), the edges a receiver reads."""
    senders, receivers = node_names(b)
    matrix = eap_scores(b, batch, metric).double().cpu()
    order = {s: i for i, s in enumerate(senders)}
    out = {}
    for r, name in enumerate(receivers):
        if name == "logits":
            reads = len(senders)
        else:
            layer = int(name[1 : name.index(".")] if name.startswith("a") else name[1:])
            reads = order[f"a{layer}.h0"] if name.startswith("a") else order[f"m{layer}"]
        for s in range(reads):
            out[f"{senders[s]}->{name}"] = float(matrix[s, r])
    return out


def circuit_tracer_source() -> Path | None:
    """circuit-tracer 0.5.0's unpacked source, the attribution-graph tests' oracle, from
    $PROBE_CIRCUIT_TRACER_SRC (.ci/run unpacks its wheel there: it cannot be installed beside
    transformers 5), put on sys.path; None where it is not there."""
    import os
    import sys

    folder = os.environ.get("PROBE_CIRCUIT_TRACER_SRC")
    if not folder or not (Path(folder) / "circuit_tracer").is_dir():
        return None
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return Path(folder)
