"""One prompt's attribution graph: its nodes, its sparse adjacency, and what pruning found.

Nodes come in circuit-tracer's order: the attributed feature nodes (sorted by layer, position,
feature), the error nodes (layer-major: `layer * n_pos + pos`), the input tokens' embeddings (one
per position), the logit nodes (most probable first). The adjacency is sparse, [target, source]:
the weight of edge s -> t is the direct effect of s on t in the local replacement model (on a
feature, its encoder's pre-activation; on a logit, the logit minus the mean logit). Per row, the
smallest edges were dropped only while their |weight| sum stayed under `floor` times the row's
|weight| sum (0: every edge of the attributed graph).

In the node table a token node's layer is -1 and a logit node's is n_layers; `activation` is a
feature's activation and a logit's probability (NaN for errors and tokens); `token` is the token
at the node's position, or the logit's token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

NODE_COLUMNS = (
    "node",
    "kind",
    "layer",
    "pos",
    "feature",
    "token",
    "activation",
    "influence",
    "kept",
)
EDGE_COLUMNS = ("target", "source", "weight", "kept")
# the QK attribution's table (probe.graphs.qk_attribution): a row per cell or marginal of a pair
QK_COLUMNS = ("layer", "head", "query_pos", "key_pos", "query_node", "key_node", "query_part",
              "key_part", "contribution", "score", "pattern")  # fmt: skip
KINDS = ("feature", "error", "token", "logit")


@dataclass
class GraphData:
    """An attributed graph's data; `influence`, `node_kept`, `edge_kept` and the two scores are
    filled by pruning (probe.graphs.pruning). What is done with it (pruning, files, the viewer's
    JSON) takes it from the modules that do it, never from here: probe.graphs.attribution_graph's
    AttributionGraph gathers them as methods."""

    tokens: torch.Tensor  # (n_pos,) int64, the prompt's token ids
    token_strings: list[str]
    n_layers: int
    features: torch.Tensor  # (n_features, 3) int64: layer, pos, feature
    activations: torch.Tensor  # (n_features,) float32
    logit_tokens: torch.Tensor  # (n_logits,) int64
    logit_probs: torch.Tensor  # (n_logits,) float32
    logit_strings: list[str]
    adjacency: torch.Tensor  # sparse COO (n_nodes, n_nodes) float32, [target, source], coalesced
    floor: float = 0.0  # a row's dropped smallest |weights| sum under floor x its |weight| sum
    prompt: str | None = None
    scan: list[str] | str | None = None  # the transcoders' ids (circuit-tracer's scan)
    active_features: int = 0  # active features before max_feature_nodes chose among them
    batch: int = 0  # prompt copies per backward pass it was attributed with (0: not known)
    influence: torch.Tensor | None = None  # (n_nodes,) float64: each node's influence on the logits
    cumulative: torch.Tensor | None = (
        None  # (n_nodes,) float64: circuit-tracer's cumulative influence
    )
    node_kept: torch.Tensor | None = None  # (n_nodes,) bool
    edge_kept: torch.Tensor | None = None  # (nnz,) bool, aligned with adjacency's indices
    scores: dict[str, float] = field(default_factory=dict)  # replacement, completeness
    # the QK attribution's table (probe.graphs.qk_attribution.QK_COLUMNS), where one was made
    qk: pd.DataFrame | None = None

    @property
    def n_pos(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def n_features(self) -> int:
        return int(self.features.shape[0])

    @property
    def n_errors(self) -> int:
        return self.n_layers * self.n_pos

    @property
    def n_logits(self) -> int:
        return int(self.logit_tokens.shape[0])

    @property
    def n_nodes(self) -> int:
        return self.n_features + self.n_errors + self.n_pos + self.n_logits

    @property
    def offsets(self) -> dict[str, int]:
        """The first node id of each kind."""
        error = self.n_features
        token = error + self.n_errors
        logit = token + self.n_pos
        return {"feature": 0, "error": error, "token": token, "logit": logit}

    def feature_numbers(self) -> dict[tuple[int, int, int], int]:
        """{(layer, pos, feature): node number} of the feature nodes."""
        return {(int(a), int(b), int(c)): i for i, (a, b, c) in enumerate(self.features.tolist())}

    def nodes(self) -> pd.DataFrame:
        """The node table (NODE_COLUMNS), one row per node in node order."""
        n_f, n_pos, n_l = self.n_features, self.n_pos, self.n_logits
        feats = self.features.cpu().numpy().reshape(-1, 3)
        err_layer = np.repeat(np.arange(self.n_layers), n_pos)
        err_pos = np.tile(np.arange(n_pos), self.n_layers)
        kind = ["feature"] * n_f + ["error"] * self.n_errors + ["token"] * n_pos + ["logit"] * n_l
        layer = np.concatenate(
            [feats[:, 0], err_layer, np.full(n_pos, -1), np.full(n_l, self.n_layers)]
        )
        pos = np.concatenate([feats[:, 1], err_pos, np.arange(n_pos), np.full(n_l, n_pos - 1)])
        feature = np.concatenate([feats[:, 2], np.full(self.n_errors + n_pos + n_l, -1)])
        strings = list(self.token_strings)
        token = [strings[p] for p in pos[: n_f + self.n_errors + n_pos]] + list(self.logit_strings)
        nan = np.full(self.n_errors + n_pos, np.nan)
        activation = np.concatenate(
            [self.activations.double().cpu().numpy(), nan, self.logit_probs.double().cpu().numpy()]
        )
        n = self.n_nodes
        influence = (
            self.influence.double().cpu().numpy()
            if self.influence is not None
            else np.full(n, np.nan)
        )
        kept = self.node_kept.cpu().numpy() if self.node_kept is not None else np.ones(n, bool)
        return pd.DataFrame({
            "node": np.arange(n), "kind": kind, "layer": layer.astype(np.int64),
            "pos": pos.astype(np.int64), "feature": feature.astype(np.int64), "token": token,
            "activation": activation, "influence": influence, "kept": kept,
        })  # fmt: skip

    def edges(self, kept_only: bool = True) -> pd.DataFrame:
        """The edge table (EDGE_COLUMNS): the pruned graph's edges, or every stored edge."""
        a = self.adjacency.coalesce()
        target, source = a.indices().cpu().numpy()
        weight = a.values().double().cpu().numpy()
        kept = (
            self.edge_kept.cpu().numpy()
            if self.edge_kept is not None
            else np.ones(len(weight), bool)
        )
        table = pd.DataFrame({"target": target, "source": source, "weight": weight, "kept": kept})
        return table[table["kept"]].reset_index(drop=True) if kept_only else table
