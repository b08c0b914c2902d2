"""An independent computation of edge scores on HuggingFace GPT-2, Llama and GPT-NeoX models:
plain `register_forward_hook`s, `torch.autograd.grad`, the families' module names and column
layouts written out here, and every receiver given its own copy of the residual stream (the
TransformerLens way: (N, T, receivers, D) copies, one per head and q/k/v), so its gradient comes
straight from autograd. Metric: logit_diff at the last position (every token real)."""

from __future__ import annotations

import torch

FAMILIES = {
    "gpt2": {"blocks": "transformer.h", "ln1": "ln_1", "ln2": "ln_2", "o": "attn.c_proj",
             "mlp": "mlp", "final": "transformer.ln_f", "embed": "transformer.wte",
             "proj": ["attn.c_attn"], "layout": "fused"},
    "llama": {"blocks": "model.layers", "ln1": "input_layernorm", "ln2": "post_attention_layernorm",
              "o": "self_attn.o_proj", "mlp": "mlp", "final": "model.norm",
              "embed": "model.embed_tokens",
              "proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], "layout": "split"},
    "gpt_neox": {"blocks": "gpt_neox.layers", "ln1": "input_layernorm",
                 "ln2": "post_attention_layernorm", "o": "attention.dense", "mlp": "mlp",
                 "final": "gpt_neox.final_layer_norm", "embed": "gpt_neox.embed_in",
                 "proj": ["attention.query_key_value"], "layout": "per_head"},
}  # fmt: skip


def logit_diff(logits, batch):
    last = logits[:, -1].double()
    rows = torch.arange(len(last))
    return last[rows, batch["answer"][:, 0]] - last[rows, batch["wrong"][:, 0]]


class Hand:
    def __init__(self, model, family: str):
        self.model, self.f = model, FAMILIES[family]
        cfg = model.config
        self.blocks = list(model.get_submodule(self.f["blocks"]))
        self.L, self.H = len(self.blocks), cfg.num_attention_heads
        self.K = getattr(cfg, "num_key_value_heads", None) or self.H
        self.D = cfg.hidden_size
        self.dh = self.D // self.H
        self.parallel = family == "gpt_neox" and cfg.use_parallel_residual

    def sub(self, block, name):
        return block.get_submodule(name)

    # -- names -----------------------------------------------------------------------------
    def senders(self):
        out = ["input"]
        for layer in range(self.L):
            out += [f"a{layer}.h{h}" for h in range(self.H)] + [f"m{layer}"]
        return out

    def receivers(self, layer):
        """(name, kind, head) of the layer's attention receivers in q, k, v order."""
        out = [(f"a{layer}.h{h}<q>", 0, h) for h in range(self.H)]
        out += [(f"a{layer}.h{j}<k>", 1, j) for j in range(self.K)]
        return out + [(f"a{layer}.h{j}<v>", 2, j) for j in range(self.K)]

    def reads(self, receiver: str):
        """The senders a receiver reads."""
        s = self.senders()
        if receiver == "logits":
            return s
        layer = int(receiver[1:].split(".")[0].split("<")[0])
        before = s[: 1 + layer * (self.H + 1)]
        if receiver.startswith("m") and not self.parallel:
            return before + [f"a{layer}.h{h}" for h in range(self.H)]
        return before

    def columns(self, kind, head):
        """(projection index, first output column) of a receiver."""
        dh, H, K = self.dh, self.H, self.K
        if self.f["layout"] == "split":
            return kind, head * dh
        if self.f["layout"] == "fused":
            return 0, [0, H * dh, (H + K) * dh][kind] + head * dh
        return 0, head * 3 * dh + kind * dh

    def weight(self, module):
        """(out, in) weight and bias of a Linear or a Conv1D."""
        if type(module).__name__ == "Conv1D":
            return module.weight.T, module.bias
        return module.weight, module.bias

    # -- plain runs ----------------------------------------------------------------------------
    def writes(self, batch, ids_key="input_ids", embed=None):
        """{sender: (N, T, D) write} of one run."""
        out, handles = {}, []
        first = self.blocks[0]

        def keep_input(m, args, kwargs):
            out["input"] = (args[0] if args else kwargs["hidden_states"]).detach()

        handles.append(first.register_forward_pre_hook(keep_input, with_kwargs=True))
        for layer, block in enumerate(self.blocks):
            o = self.sub(block, self.f["o"])

            def keep_z(m, args, layer=layer, o=o):
                z = args[0].detach()
                w, _ = self.weight(o)  # (D, H*dh)
                for h in range(self.H):
                    cols = slice(h * self.dh, (h + 1) * self.dh)
                    out[f"a{layer}.h{h}"] = z[..., cols] @ w[:, cols].T.detach()

            handles.append(o.register_forward_pre_hook(keep_z))
            handles.append(
                self.sub(block, self.f["mlp"]).register_forward_hook(
                    lambda m, a, y, layer=layer: out.__setitem__(f"m{layer}", y.detach())
                )
            )
        if embed is not None:
            handles.append(self.model.get_submodule(self.f["embed"]).register_forward_hook(embed))
        try:
            with torch.no_grad():
                logits = self.model(input_ids=batch[ids_key]).logits
        finally:
            for h in handles:
                h.remove()
        return out, logits

    def grads(self, batch, embed=None, replace=None, metric=logit_diff):
        """{receiver: (N, T, D) dMetric/d(its own copy of the residual)} and the metric, with
        optional forward hooks (`embed` on the embedding; `replace`: [(module, hook)])."""
        copies, handles, x_in = {}, [], {}
        for layer, block in enumerate(self.blocks):
            ln1 = self.sub(block, self.f["ln1"])
            handles.append(ln1.register_forward_pre_hook(
                lambda m, a, layer=layer: x_in.__setitem__(layer, a[0])))  # fmt: skip
            receivers = self.receivers(layer)
            for p, name in enumerate(self.f["proj"]):
                proj = self.sub(block, name)
                mine = [(r, k, h) for r, k, h in receivers if self.columns(k, h)[0] == p]

                def split(m, args, output, layer=layer, mine=mine, ln1=ln1, proj=proj):
                    x = x_in[layer]
                    rep = x.unsqueeze(2).repeat(1, 1, len(mine), 1)
                    copies.update({r: (rep, i) for i, (r, _, _) in enumerate(mine)})
                    y = ln1.forward(rep)
                    w, b = self.weight(proj)
                    out = output.clone()
                    for i, (_, k, h) in enumerate(mine):
                        c = self.columns(k, h)[1]
                        cols = slice(c, c + self.dh)
                        val = y[:, :, i] @ w[cols].T
                        out[..., cols] = val + (b[cols] if b is not None else 0)
                    return out

                handles.append(proj.register_forward_hook(split))
            ln2 = self.sub(block, self.f["ln2"])

            def own(m, args, key):
                copy = args[0].clone()
                copies[key] = (copy, None)
                return (copy, *args[1:])

            handles.append(
                ln2.register_forward_pre_hook(lambda m, a, key=f"m{layer}": own(m, a, key))
            )
        final = self.model.get_submodule(self.f["final"])
        handles.append(final.register_forward_pre_hook(lambda m, a: own(m, a, "logits")))
        if embed is not None:
            handles.append(self.model.get_submodule(self.f["embed"]).register_forward_hook(embed))
        for module, hook in replace or []:
            handles.append(module.register_forward_hook(hook))
        try:
            with torch.enable_grad():
                logits = self.model(input_ids=batch["input_ids"]).logits
                value = metric(logits, batch)
                keys = list(copies)
                tensors = list(dict.fromkeys(copies[k][0] for k in keys))
                got = torch.autograd.grad(value.sum(), tensors, allow_unused=True)
        finally:
            for h in handles:
                h.remove()
        by_tensor = {id(t): g for t, g in zip(tensors, got, strict=True)}
        out = {}
        for k in keys:
            t, i = copies[k]
            g = by_tensor[id(t)]
            g = torch.zeros_like(t) if g is None else g
            out[k] = g if i is None else g[:, :, i]
        return out, value.detach()

    # -- scores --------------------------------------------------------------------------
    def edge_scores(self, diff: dict, grads: dict, senders=None) -> dict:
        """{edge: mean over samples of sum over positions of diff[sender] . grads[receiver]}."""
        out = {}
        for r, g in grads.items():
            for s in self.reads(r):
                if senders is None or s in senders:
                    out[f"{s}->{r}"] = float((diff[s] * g).sum((1, 2)).double().mean())
        return out

    def eap(self, batch):
        clean, _ = self.writes(batch)
        corrupt, _ = self.writes(batch, "corrupt_ids")
        grads, _ = self.grads(batch)
        return self.edge_scores({k: corrupt[k] - clean[k] for k in clean}, grads)

    def _embedding(self, batch):
        emb = self.model.get_submodule(self.f["embed"])
        with torch.no_grad():
            return emb(batch["input_ids"]), emb(batch["corrupt_ids"])

    def eap_ig_inputs(self, batch, steps: int):
        """The Riemann sum k = 1..steps of the gradients with the token embeddings moved from
        the corrupt half's to the clean one's."""
        clean, _ = self.writes(batch)
        corrupt, _ = self.writes(batch, "corrupt_ids")
        e_clean, e_corrupt = self._embedding(batch)
        total = {}
        for k in range(1, steps + 1):
            a = k / steps
            embed = lambda m, args, out, a=a: e_corrupt + a * (e_clean - e_corrupt)  # noqa: E731
            grads, _ = self.grads(batch, embed=embed)
            for r, g in grads.items():
                total[r] = total.get(r, 0) + g / steps
        return self.edge_scores({k: corrupt[k] - clean[k] for k in clean}, total)

    def eap_ig_activations(self, batch, steps: int):
        """Per sender group (the input, a layer's heads, an MLP), the Riemann sum of the
        gradients with that group's output moved from its corrupt value to its clean one."""
        clean, _ = self.writes(batch)
        corrupt, _ = self.writes(batch, "corrupt_ids")
        diff = {k: corrupt[k] - clean[k] for k in clean}
        z = {}
        for half in ("input_ids", "corrupt_ids"):
            z[half] = self._z(batch[half])
        e_clean, e_corrupt = self._embedding(batch)
        out = {}
        groups = [("input", ["input"], None)]
        for layer, block in enumerate(self.blocks):
            heads = [f"a{layer}.h{h}" for h in range(self.H)]
            groups += [(("heads", layer), heads, block), (("mlp", layer), [f"m{layer}"], block)]
        for key, senders, block in groups:
            total = {}
            for k in range(1, steps + 1):
                a = k / steps
                embed, replace = None, []
                if key == "input":
                    embed = lambda m, args, o, a=a: e_corrupt + a * (e_clean - e_corrupt)  # noqa: E731
                elif key[0] == "heads":
                    zc, zx = z["input_ids"][key[1]], z["corrupt_ids"][key[1]]
                    o = self.sub(block, self.f["o"])
                    replace = [(o, None, zx + a * (zc - zx))]
                else:
                    mc, mx = clean[senders[0]], corrupt[senders[0]]
                    value = mx + a * (mc - mx)
                    replace = [(self.sub(block, self.f["mlp"]), lambda m, args, y, v=value: v)]
                grads, _ = self._grads_with(batch, embed, replace)
                for r, g in grads.items():
                    total[r] = total.get(r, 0) + g / steps
            out.update(self.edge_scores(diff, total, set(senders)))
        return out

    def _z(self, ids):
        z, handles = {}, []
        for layer, block in enumerate(self.blocks):
            o = self.sub(block, self.f["o"])
            handles.append(o.register_forward_pre_hook(
                lambda m, a, layer=layer: z.__setitem__(layer, a[0].detach())))  # fmt: skip
        with torch.no_grad():
            self.model(input_ids=ids)
        for h in handles:
            h.remove()
        return z

    def _grads_with(self, batch, embed, replace):
        """grads() with forward hooks, and pre-hooks given as (module, None, new input)."""
        pre, post = [], []
        for item in replace:
            if item[1] is None:
                pre.append(item[0].register_forward_pre_hook(lambda m, a, v=item[2]: (v,)))
            else:
                post.append(item)
        try:
            return self.grads(batch, embed=embed, replace=post)
        finally:
            for h in pre:
                h.remove()

    # -- patching --------------------------------------------------------------------------
    def inputs(self, batch):
        """{receiver: (N, T, D) the residual it reads} on the clean run."""
        out, handles = {}, []
        for layer, block in enumerate(self.blocks):
            ln1, ln2 = self.sub(block, self.f["ln1"]), self.sub(block, self.f["ln2"])
            handles.append(
                ln1.register_forward_pre_hook(
                    lambda m, a, layer=layer: out.__setitem__(("attn", layer), a[0].detach())
                )
            )
            handles.append(ln2.register_forward_pre_hook(
                lambda m, a, layer=layer: out.__setitem__(f"m{layer}", a[0].detach())))  # fmt: skip
        final = self.model.get_submodule(self.f["final"])
        handles.append(final.register_forward_pre_hook(
            lambda m, a: out.__setitem__("logits", a[0].detach())))  # fmt: skip
        with torch.no_grad():
            self.model(input_ids=batch["input_ids"])
        for h in handles:
            h.remove()
        return out

    def patched(self, batch, sender, receivers, frozen=False):
        """The metric change when each receiver reads `sender`'s corrupt write instead of its
        clean one: in its live input (edge patching), or, `frozen`, in its clean input."""
        clean, _ = self.writes(batch)
        corrupt, _ = self.writes(batch, "corrupt_ids")
        delta = corrupt[sender] - clean[sender]
        base = self.inputs(batch)
        handles, live = [], {}
        for r in receivers:
            if r == "logits" or r.startswith("m"):
                module = (self.model.get_submodule(self.f["final"]) if r == "logits"
                          else self.sub(self.blocks[int(r[1:])], self.f["ln2"]))  # fmt: skip
                handles.append(module.register_forward_pre_hook(
                    lambda m, a, r=r: ((base[r] if frozen else a[0]) + delta, *a[1:])))  # fmt: skip
                continue
            layer = int(r[1:].split(".")[0])
            block = self.blocks[layer]
            ln1 = self.sub(block, self.f["ln1"])
            kind = "qkv".index(r[-2])
            head = int(r.split(".h")[1].split("<")[0])
            p, c = self.columns(kind, head)
            proj = self.sub(block, self.f["proj"][p])
            handles.append(ln1.register_forward_pre_hook(
                lambda m, a, layer=layer: live.__setitem__(layer, a[0])))  # fmt: skip

            def rewrite(m, args, output, layer=layer, c=c, ln1=ln1, proj=proj):
                x = base[("attn", layer)] if frozen else live[layer]
                y = ln1.forward(x + delta)
                w, b = self.weight(proj)
                cols = slice(c, c + self.dh)
                out = output.clone()
                out[..., cols] = y @ w[cols].T + (b[cols] if b is not None else 0)
                return out

            handles.append(proj.register_forward_hook(rewrite))
        try:
            with torch.no_grad():
                logits = self.model(input_ids=batch["input_ids"]).logits
        finally:
            for h in handles:
                h.remove()
        with torch.no_grad():
            base_logits = self.model(input_ids=batch["input_ids"]).logits
        return float((logit_diff(logits, batch) - logit_diff(base_logits, batch)).mean())
