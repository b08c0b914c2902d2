"""circuit-tracer's per-feature example files for a graph's features (`graph.examples=RUN`):
what each kept feature responds to over a dataset, in the files its local viewer reads.

RUN is a run of the same model over a dataset with the graph's transcoder set as a site
(`transcoders` on a probe: `transcoder.features` with `stats.topk`, probe.hooks.transcoder_site):
it holds each feature's top activating tokens. For each feature node a graph kept, this writes
`features/<feature>.json` beside the viewer's JSON (`<feature>` the node's `feature` field, the
Cantor pairing of layer and feature) in circuit-tracer's feature format
(circuit_tracer/frontend/feature_models.py): the examples (RUN's top tokens, best first, each
with CONTEXT tokens around it and the feature's activation at every one of them, computed again
by the model: the example's own value is checked against RUN's, so a RUN of another model or set
is refused), the tokens the feature's decoder row raises and lowers most through the
unembedding (top_logits, bottom_logits), its largest activation and its frequency over RUN's
tokens. The graph's JSON then names `./data/features` as every layer's source, the path
circuit-tracer's local server serves from the viewer's folder, and `features` as the
`feature_json_base_url` Neuronpedia's format reads (a hosting address replaces it there).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from probe.errors import ConfigError, DataError
from probe.graphs.graph_json import cantor_pairing
from probe.hooks.hookset import HookSet
from probe.hooks.transcoder_site import encoder_of
from probe.models.cross_layer_transcoder import AnyTranscoders, CrossLayerTranscoder
from probe.models.transcoder import normalized

SITE = "transcoder.features"
FEATURES_DIR = "features"  # beside the viewer's JSON
LOCAL_SOURCE = "./data/features"  # where circuit-tracer's viewer reads them through its server
CONTEXT = (12, 4)  # tokens before and after an example's token
LOGITS = 10  # tokens in top_logits and bottom_logits
_BLOCK = re.compile(r"^(?:.*\.)?(\d+)\.(.+)$")


def feature_modules(run) -> dict[int, str]:
    """{block: the module of `run` holding that block's transcoder.features}."""
    found = {}
    for layer, site in run.keys:
        match = _BLOCK.match(layer)
        if site == SITE and match:
            found[int(match.group(1))] = layer
    if not found:
        raise DataError(
            f"graph.examples={str(run.path)!r} holds no transcoder features: run the model over a "
            "dataset with a probe of transcoders=SET (the graph's set) and stats.topk=K "
            "(docs/features.md)"
        )
    return found


class FeatureFiles:
    """The example files of a graph run's features, from RUN's examples and the model."""

    def __init__(self, model, parts, transcoders: AnyTranscoders, tokenizer) -> None:
        self.model, self.parts, self.transcoders = model, parts, transcoders
        self.tokenizer = tokenizer
        self.run_path = Path()

    def write(self, run, features: list[tuple[int, int]], folder: Path) -> int:
        """`folder`/features/<feature>.json for each (layer, feature) from `run` (an open
        probe.read.runs.Run of the examples); how many were written. One forward of the model
        per example sample, for every feature's examples in it."""
        self.run_path = Path(run.path)
        out = Path(folder) / FEATURES_DIR
        out.mkdir(parents=True, exist_ok=True)
        modules = feature_modules(run)
        missing = sorted({layer for layer, _ in features} - set(modules))
        if missing:
            raise DataError(
                f"graph.examples={str(self.run_path)!r} holds the features of blocks "
                f"{sorted(modules)}, and a graph kept features of blocks {missing}; select "
                "every block in its probe"
            )
        tokens = run.tokens()
        by_sample = {
            int(s): g.sort_values("position")["id"].to_numpy() for s, g in tokens.groupby("sample")
        }
        rows, units = {}, {}
        for layer in sorted({lay for lay, _ in features}):
            wanted = sorted({f for lay, f in features if lay == layer})
            top = run.topk(modules[layer], SITE, unit=wanted, context=(0, 0))
            stats = run.units(modules[layer], SITE).set_index("unit")
            for feature in wanted:
                rows[layer, feature] = top[top["unit"] == feature].sort_values("rank")
                units[layer, feature] = stats.loc[feature]
        examples = self.examples(rows, by_sample)
        for (layer, feature), unit in units.items():
            model = self.feature(layer, feature, rows[layer, feature], examples, unit)
            (out / f"{cantor_pairing(layer, feature)}.json").write_text(json.dumps(model))
        return len(units)

    def examples(self, rows: dict, by_sample: dict) -> dict:
        """{(layer, feature, rank): an example of circuit-tracer's format}: the CONTEXT tokens
        around each of RUN's top tokens and the feature's activation at each, from one forward
        of the model per sample (its tokens up to the last one an example shows)."""
        before, after = CONTEXT
        by: dict[int, list[tuple[int, int, int, int, float]]] = {}
        for (layer, feature), table in rows.items():
            for row in table.itertuples():
                by.setdefault(int(row.sample), []).append((layer, feature, int(row.rank),
                                                           int(row.position), float(row.value)))  # fmt: skip
        out = {}
        for sample, items in by.items():
            ids = by_sample[sample]
            end = min(len(ids), max(pos for *_, pos, _ in items) + after + 1)
            acts = self.activations(sorted({i[0] for i in items}), torch.tensor(ids[:end]))
            for layer, feature, rank, pos, value in items:
                lo, hi = max(0, pos - before), min(end, pos + after + 1)
                here = acts[layer][lo:hi, feature]
                if not torch.isclose(here[pos - lo], torch.tensor(value), rtol=1e-3, atol=1e-4):
                    raise ConfigError(
                        f"graph.examples={str(self.run_path)!r}: feature {feature} of block "
                        f"{layer} is {float(here[pos - lo]):.4g} at sample {sample} position "
                        f"{pos} here and {value:.4g} in that run; give a run of this model with "
                        "this transcoder set"
                    )
                out[layer, feature, rank] = {
                    "tokens_acts_list": [float(a) for a in here],
                    "train_token_ind": pos - lo,
                    "is_repeated_datapoint": False,
                    "tokens": [self.text(t) for t in ids[lo:hi]],
                }
        return out

    def feature(self, layer: int, feature: int, rows, examples: dict, unit) -> dict:
        """One feature's file (circuit-tracer's feature Model) as a dict."""
        top, bottom = self.logits(layer, feature)
        values = rows["value"].to_numpy()
        return {
            "transcoder_id": self.transcoders.ids.get(layer, str(layer)),  # (a CLT: {})
            "index": int(feature),
            "examples_quantiles": [{
                "quantile_name": "Top activations",
                "examples": [examples[layer, feature, int(r)] for r in rows["rank"]],
            }],
            "top_logits": top,
            "bottom_logits": bottom,
            "act_min": 0.0,
            "act_max": float(values.max()) if len(values) else float(unit["max"]),
            "quantile_values": [],
            "histogram": [],
            "activation_frequency": float(unit["frac_positive"]),
        }  # fmt: skip

    @torch.no_grad()
    def activations(self, layers: list[int], tokens: torch.Tensor) -> dict[int, torch.Tensor]:
        """{layer: every feature's activation (positions, d_tc) on `tokens` (1-D)}, float32 on
        the host, from one forward of the model."""
        reads = self.transcoders.reads
        modules = {
            layer: self.parts.mlps[layer] if reads == "mlp_in" else self.parts.mlp_norms[layer]
            for layer in layers
        }
        seen: dict[int, torch.Tensor] = {}
        device = next(self.model.parameters()).device
        with HookSet("probe.graph.examples") as hooks:
            for layer, module in modules.items():
                hooks.forward_pre(
                    module, lambda m, args, layer=layer: seen.__setitem__(layer, args[0].detach())
                )
            self.model(tokens[None].to(device))
        out = {}
        for layer, module in modules.items():
            x = seen[layer][0].float()
            if reads == "mlp_normalized":
                x = normalized(module, x)
            t = encoder_of(self.transcoders, layer)
            out[layer] = t.encode(x.to(t.W_enc.device, t.W_enc.dtype)).float().cpu()
        return out

    def logits(self, layer: int, feature: int) -> tuple[list[str], list[str]]:
        """The LOGITS tokens the feature's decoder row raises most, and lowers most, through the
        unembedding (its direct effect, the final norm's scale aside; a cross-layer feature's
        writes to every later layer summed)."""
        if isinstance(self.transcoders, CrossLayerTranscoder):
            row = self.transcoders.W_dec[layer][feature].detach().float().sum(0)
        else:
            row = self.transcoders[layer].W_dec[feature].detach().float()
        unembed = self.parts.unembed.detach().float()
        effect = unembed @ row.to(unembed.device)
        k = min(LOGITS, len(effect))
        top = torch.topk(effect, k).indices.tolist()
        bottom = torch.topk(-effect, k).indices.tolist()
        return [self.text(t) for t in top], [self.text(t) for t in bottom]

    def text(self, token: int) -> str:
        return self.tokenizer.decode([int(token)]) if self.tokenizer is not None else f"<{token}>"
