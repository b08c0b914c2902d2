"""The graph of a transformer's components: who writes the residual stream, who reads it.

Nodes, named as hannamw/EAP-IG names them: `input` (the residual stream as the first block
receives it: the token and position embeddings), `a{layer}.h{head}` (an attention head's write:
its slice of the output projection's input times its slice of the projection, bias apart),
`m{layer}` (an MLP's output) and `logits`. Every node but `logits` is a sender.

Receivers are the places a node reads the residual stream, each before its norm: an attention
head's query, key and value inputs separately (`a2.h3<q>`, `<k>`, `<v>`), an MLP's input (`m2`)
and the logits (the final norm's input). An edge joins every sender to every receiver that reads
it (`a0.h1->a2.h3<q>`, `m0->logits`): a receiver reads every sender of the layers before its own;
an MLP also reads its own layer's heads, except in a parallel block (GPT-NeoX), where attention
and MLP read the same residual.

Grouped-query attention: a key/value head is one computation that serves a group of query heads
(`heads // kv_heads` of them), so its key and value inputs are one receiver each,
`a{layer}.h{j}<k>` and `a{layer}.h{j}<v>` with j the key/value head (serving query heads
j*g ... j*g+g-1). Patching such a receiver changes the key or value every head of the group sees:
what the model computes, nothing ungrouped. (For attribution patching its score equals the sum of
the per-query-head scores of the same model with its key/value heads copied per query head.)

Edges are numbered receiver by receiver (in receiver order), each receiver's senders in sender
order; the receivers of one layer's attention, of one MLP and the logits form groups whose edges
are contiguous, laid out (receivers x senders). Everything is plain numpy arrays and names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from probe.errors import ConfigError

KINDS = ("q", "k", "v")
_EDGE = re.compile(r"^(?P<sender>[^-]+)->(?P<receiver>.+)$")


@dataclass(frozen=True)
class ReceiverGroup:
    """Receivers that read the same senders: one layer's attention inputs (`attn`), one MLP
    (`mlp`) or the logits. Its edges are `edges` (contiguous), laid out (receivers, senders):
    edge `edges.start + i * senders + s` joins sender s to receiver `receivers.start + i`."""

    kind: str  # attn | mlp | logits
    layer: int  # the logits: the number of layers
    receivers: range
    senders: int  # it reads senders 0 .. senders-1
    edges: range


@dataclass(frozen=True)
class ComponentGraph:
    """Nodes, receivers and edges of a model with `layers` blocks of `heads` attention heads
    (`kv_heads` key/value heads) and one MLP each; `parallel`: attention and MLP read the same
    residual."""

    layers: int
    heads: int
    kv_heads: int
    parallel: bool = False
    groups: tuple[ReceiverGroup, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.layers < 1 or self.heads < 1 or self.kv_heads < 1:
            raise ConfigError(
                f"a component graph needs at least one layer and head; got layers={self.layers}, "
                f"heads={self.heads}, kv_heads={self.kv_heads}"
            )
        if self.heads % self.kv_heads:
            raise ConfigError(
                f"{self.heads} query heads cannot share {self.kv_heads} key/value heads evenly; "
                "set model.anatomy.kv_heads to the model's number of key/value heads"
            )
        object.__setattr__(self, "groups", tuple(self._groups()))

    # -- sizes and indices ---------------------------------------------------------------------
    @property
    def per_layer(self) -> int:
        """Receivers of one layer: q per head, k and v per key/value head, the MLP."""
        return self.heads + 2 * self.kv_heads + 1

    @property
    def n_senders(self) -> int:
        return 1 + self.layers * (self.heads + 1)

    @property
    def n_receivers(self) -> int:
        return self.layers * self.per_layer + 1

    @property
    def n_nodes(self) -> int:
        return self.n_senders + 1

    @property
    def n_edges(self) -> int:
        return self.groups[-1].edges.stop

    def head(self, layer: int, head: int) -> int:
        """The sender index of head `head` of `layer`."""
        return 1 + layer * (self.heads + 1) + head

    def mlp(self, layer: int) -> int:
        """The sender index of the MLP of `layer`."""
        return 1 + layer * (self.heads + 1) + self.heads

    def reads(self, layer: int, kind: str) -> int:
        """How many senders (the first ones) a receiver of `layer` reads: `attn` every sender of
        the layers before; `mlp` also its own layer's heads unless the block is parallel."""
        before = 1 + layer * (self.heads + 1)
        return before + (self.heads if kind == "mlp" and not self.parallel else 0)

    def _groups(self):
        start, receiver = 0, 0
        attn = self.heads + 2 * self.kv_heads
        for layer in range(self.layers):
            for kind, count in (("attn", attn), ("mlp", 1)):
                senders = self.reads(layer, kind)
                stop = start + count * senders
                yield ReceiverGroup(
                    kind, layer, range(receiver, receiver + count), senders, range(start, stop)
                )
                start, receiver = stop, receiver + count
        senders = self.n_senders
        yield ReceiverGroup(
            "logits", self.layers, range(receiver, receiver + 1), senders,
            range(start, start + senders),
        )  # fmt: skip

    # -- names -----------------------------------------------------------------------------
    @cached_property
    def senders(self) -> list[str]:
        names = ["input"]
        for layer in range(self.layers):
            names += [f"a{layer}.h{h}" for h in range(self.heads)] + [f"m{layer}"]
        return names

    @property
    def nodes(self) -> list[str]:
        return [*self.senders, "logits"]

    @cached_property
    def receivers(self) -> list[str]:
        names = []
        for layer in range(self.layers):
            names += [f"a{layer}.h{h}<q>" for h in range(self.heads)]
            for kind in ("k", "v"):
                names += [f"a{layer}.h{j}<{kind}>" for j in range(self.kv_heads)]
            names.append(f"m{layer}")
        return [*names, "logits"]

    @cached_property
    def edge_sender(self) -> np.ndarray:
        """(E,) the sender index of each edge."""
        return np.concatenate(
            [np.tile(np.arange(g.senders), len(g.receivers)) for g in self.groups]
        ).astype(np.int64)

    @cached_property
    def edge_receiver(self) -> np.ndarray:
        """(E,) the receiver index of each edge."""
        return np.concatenate(
            [
                np.repeat(np.arange(g.receivers.start, g.receivers.stop), g.senders)
                for g in self.groups
            ]
        ).astype(np.int64)

    @cached_property
    def edges(self) -> list[str]:
        """Edge names, `sender->receiver`, in edge order."""
        s, r = self.senders, self.receivers
        return [
            f"{s[i]}->{r[j]}" for i, j in zip(self.edge_sender, self.edge_receiver, strict=True)
        ]

    @cached_property
    def _sender_index(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.senders)}

    @cached_property
    def _receiver_index(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.receivers)}

    def sender_index(self, name: str) -> int:
        try:
            return self._sender_index[name]
        except KeyError:
            raise ConfigError(
                f"{name!r} is not a sender of this graph: senders are input, a{{layer}}.h{{head}} "
                f"(layers 0-{self.layers - 1}, heads 0-{self.heads - 1}) and m{{layer}}"
            ) from None

    def receiver_index(self, name: str) -> int:
        try:
            return self._receiver_index[name]
        except KeyError:
            raise ConfigError(
                f"{name!r} is not a receiver of this graph: receivers are a{{layer}}.h{{head}}<q>, "
                f"a{{layer}}.h{{kv_head}}<k> and <v> (key/value heads 0-{self.kv_heads - 1}), "
                f"m{{layer}} and logits (layers 0-{self.layers - 1})"
            ) from None

    def edge_index(self, name: str) -> int:
        """The index of edge `sender->receiver`; a ConfigError names what is wrong with it."""
        match = _EDGE.match(name.replace(" ", ""))
        if match is None:
            raise ConfigError(
                f"{name!r} is not an edge name; write SENDER->RECEIVER, e.g. a0.h1->a2.h3<q>"
            )
        s = self.sender_index(match["sender"])
        r = self.receiver_index(match["receiver"])
        group = self.group_of(r)
        if s >= group.senders:
            raise ConfigError(
                f"{name!r} is not an edge: {match['receiver']} does not read {match['sender']} "
                "(a receiver reads the senders of earlier layers, an MLP its own layer's heads "
                "too unless the block is parallel)"
            )
        return group.edges.start + (r - group.receivers.start) * group.senders + s

    def group_of(self, receiver: int) -> ReceiverGroup:
        """The group a receiver index belongs to."""
        layer, offset = divmod(receiver, self.per_layer)
        if layer >= self.layers:
            return self.groups[-1]
        return self.groups[2 * layer + (offset == self.per_layer - 1)]

    def query_heads(self, receiver: int) -> list[int]:
        """The query heads a receiver feeds: its own head for <q>, the group of a key/value head
        for <k> and <v>; none for an MLP or the logits."""
        group = self.group_of(receiver)
        if group.kind != "attn":
            return []
        offset = receiver - group.receivers.start
        if offset < self.heads:
            return [offset]
        j = (offset - self.heads) % self.kv_heads
        g = self.heads // self.kv_heads
        return list(range(j * g, (j + 1) * g))

    @cached_property
    def feeds(self) -> np.ndarray:
        """(receivers, senders + 1) bool: the node each receiver is an input of (the last
        column: the logits); a key/value receiver feeds every query head of its group."""
        out = np.zeros((self.n_receivers, self.n_senders + 1), dtype=bool)
        out[-1, -1] = True
        for g in self.groups[:-1]:
            for r in g.receivers:
                if g.kind == "mlp":
                    out[r, self.mlp(g.layer)] = True
                else:
                    out[r, [self.head(g.layer, h) for h in self.query_heads(r)]] = True
        return out

    def receiver_edges(self, receiver: int) -> range:
        """The edges into a receiver (contiguous: its senders in order)."""
        g = self.group_of(receiver)
        start = g.edges.start + (receiver - g.receivers.start) * g.senders
        return range(start, start + g.senders)

    def counts(self) -> dict[str, int]:
        """Nodes, senders, receivers and edges."""
        return {
            "nodes": self.n_nodes,
            "senders": self.n_senders,
            "receivers": self.n_receivers,
            "edges": self.n_edges,
        }

    # -- dense views -------------------------------------------------------------------------
    def matrix(self, values: np.ndarray) -> np.ndarray:
        """(senders, receivers) of per-edge `values`, NaN where no edge joins them."""
        out = np.full((self.n_senders, self.n_receivers), np.nan)
        out[self.edge_sender, self.edge_receiver] = values
        return out

    def edge_mask(self) -> np.ndarray:
        """(senders, receivers) bool: where an edge joins them."""
        out = np.zeros((self.n_senders, self.n_receivers), dtype=bool)
        out[self.edge_sender, self.edge_receiver] = True
        return out
