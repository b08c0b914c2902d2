"""Where each watched module of a training sits, read from its name and type alone (a run
directory holds no model): its kind and its depth, for the training figures
(probe.report.train_plots).

- Kind: `attention`, `MLP`, `block outputs` (the block itself) or `other`. A module inside a
  block (its name holds the block's index: `model.layers.11.self_attn.q_proj`) is attention or
  MLP by the first name below the block (the suffixes probe.models.anatomy knows per family:
  `self_attn`, `attn`, `attention`, `mlp`, BERT's `intermediate` and `output.dense`, and a few
  common ones), else by its type (`...Attention`, `...MLP`); the block itself (the name ends at
  the index, or its type ends in Block/Layer) is a block. Anything else is `other`.
- Depth: the block index its name holds; within a block attention, then the other modules, then
  the MLP, then the block's own output. Modules outside the blocks come before them or after
  them as the model lists them (`order`: the watched modules in the order the file records them,
  watch.yaml's `modules`), one step apart: the embeddings at -1, the final norm and lm_head at
  the number of blocks and one more. Each module sits inside its unit of depth (block 11's
  three modules at 11 1/6, 11 1/2 and 11 5/6; the colour bar marks block 11 at 11.5). A module watched for its parameters only sits at its own
  depth, wherever its rows fall in the file. Where blocks sit in several lists
  (resnet's layer1.0 ... layer4.1) they count on from one list to the next.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from probe.models.anatomy import FAMILIES

BLOCK, ATTENTION, MLP, OTHER = "block outputs", "attention", "MLP", "other"
KINDS = (BLOCK, ATTENTION, MLP, OTHER)  # the output panels' order
WITHIN = {ATTENTION: 0, OTHER: 1, MLP: 2, BLOCK: 3}  # the order inside one block
ATTENTION_NAMES = {
    *(str(f["attn"]).split(".")[0] for f in FAMILIES.values() if isinstance(f, dict)),
    "self_attention", "selfattention", "cross_attn", "crossattention", "attn_layer",
}  # fmt: skip
MLP_NAMES = {
    *(str(f["mlp_out"]) for f in FAMILIES.values() if isinstance(f, dict)),
    "mlp", "ffn", "feed_forward", "feedforward", "intermediate",
}  # fmt: skip
BLOCK_TYPE = re.compile(r"(Block|Layer)$")
INDEX = re.compile(r"^\d+$")


@dataclass(frozen=True)
class Place:
    """A module's kind, its block (the name up to its index: `model.layers.11`; None outside the
    blocks) and its depth (block index + place within the block; negative before the blocks,
    from the number of blocks on after them)."""

    name: str
    kind: str
    block: str | None
    depth: float


def split_block(name: str) -> tuple[str, int, str] | None:
    """(the list holding the block, its index, the rest below it) of a module inside a block:
    `model.layers.11.self_attn` -> ("model.layers", 11, "self_attn"); None outside blocks."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if i and INDEX.match(part):
            return ".".join(parts[:i]), int(part), ".".join(parts[i + 1 :])
    return None


def kind_of(name: str, module_type: str = "") -> str:
    """The module's kind (see the module's docstring)."""
    inside = split_block(name)
    rest = inside[2] if inside else name.rsplit(".", 1)[-1]
    first = rest.split(".")[0].lower()
    if inside and not rest:
        return BLOCK
    if first in ATTENTION_NAMES:
        return ATTENTION
    if first in MLP_NAMES or any(rest == m or rest.startswith(m + ".") for m in MLP_NAMES):
        return MLP
    if "Attention" in module_type:
        return ATTENTION
    if "MLP" in module_type or "FeedForward" in module_type:
        return MLP
    if BLOCK_TYPE.search(module_type) and not (inside and rest):
        return BLOCK
    return OTHER


def places(order: list[str], types: dict[str, str] | None = None) -> dict[str, Place]:
    """{module: Place} of the modules in `order` (the model's order of them: a block's modules
    together, the embeddings before the blocks, the head after), by name (see the module)."""
    types = types or {}
    at = {name: i for i, name in enumerate(order)}
    lists: dict[str, int] = {}  # each list of blocks: the largest index seen
    for name in order:
        inside = split_block(name)
        if inside:
            lists[inside[0]] = max(lists.get(inside[0], -1), inside[1])
    offset, start = {}, 0
    for holder, last in lists.items():
        offset[holder], start = start, start + last + 1
    blocks = start  # the blocks the names reveal (0 .. blocks - 1)
    kinds = {name: kind_of(name, types.get(name, "")) for name in order}
    out: dict[str, Place] = {}
    members: dict[tuple[str, int], list[str]] = {}
    for name in order:
        inside = split_block(name)
        if inside:
            members.setdefault(inside[:2], []).append(name)
    for (holder, index), names in members.items():
        names = sorted(names, key=lambda n: (WITHIN[kinds[n]], at[n]))
        for i, name in enumerate(names):
            depth = offset[holder] + index + (i + 0.5) / len(names)
            out[name] = Place(name, kinds[name], f"{holder}.{index}", depth)
    outside = [n for n in order if n not in out]
    first_block = next((i for i, n in enumerate(order) if n in out), len(order))
    before = [n for n in outside if at[n] < first_block]
    after = [n for n in outside if n not in before]
    for i, name in enumerate(before):
        out[name] = Place(name, kinds[name], None, i - len(before) + 0.5)
    for i, name in enumerate(after):
        out[name] = Place(name, kinds[name], None, blocks + i + 0.5)
    return out


def block_ticks(found: dict[str, Place]) -> tuple[list[float], list[str], str]:
    """Ticks, their labels and the axis label of a depth colour bar over `found`: the blocks
    by index (about 8 ticks, each at its block's middle), the modules outside them by name."""
    blocks: dict[int, tuple[str, int]] = {}
    for p in found.values():
        inside = split_block(p.name) if p.block is not None else None
        if inside:
            blocks.setdefault(int(p.depth), inside[:2])
    ticks: list[float] = []
    labels: list[str] = []
    holders = list(dict.fromkeys(h for h, _ in blocks.values()))
    one_list = len(holders) == 1
    if blocks:
        depths = sorted(blocks)
        every = max(1, round(len(depths) / 8))
        shown = depths[::every]
        if depths[-1] - shown[-1] > every / 2:  # the last block, where it has room
            shown.append(depths[-1])
        for d in shown:
            holder, index = blocks[d]
            ticks.append(d + 0.5)
            labels.append(str(index) if one_list else f"{holder}.{index}")
    for p in found.values():
        if p.block is None:
            ticks.append(p.depth)
            labels.append(p.name)
    what = f"{holders[0]}.N" if one_list else "its block"
    return ticks, labels, f"depth: block index ({what})" if blocks else "depth"
