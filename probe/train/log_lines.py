"""Lines of a watched training's probe.log that would name many modules or steps, kept short.

- `fold(names)`: module names whose only difference is an index, folded into ranges, in natural
  order (0, 1, 2, ..., 10, not 0, 1, 10): `model.layers.0.self_attn` ... `model.layers.29.self_attn`
  is `model.layers.0-29.self_attn`; names differing at several indices fold at each
  (`model.layers.0-29.mlp.experts.0-7`), indices with gaps in braces (`blocks.{0-3,5}.attn`).
- `renamed_lines(renamed)`: what each asked site was recorded under (`output -> output.0` for a
  module returning a tuple), a line per (asked site, names), its modules folded and cut to about
  LINE_NAMES characters a line.
- `steps_text(steps)`: steps as ranges (`0-5`), a regular schedule by its stride.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

LINE_NAMES = 160  # about this many characters of module names on one log line
NUMBER = re.compile(r"(\d+)")


def natural(name: str) -> tuple:
    """A sort key reading the digits in a name as numbers: `layers.2` before `layers.10`."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in NUMBER.split(name) if p)


def index_ranges(numbers: Iterable[int]) -> str:
    """`7`, `0-29`, or with gaps `{0-3,5,7-9}`: sorted, consecutive numbers as a range."""
    ordered = sorted(set(numbers))
    runs: list[list[int]] = []
    for n in ordered:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    said = ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)
    return said if len(runs) == 1 else f"{{{said}}}"


def fold(names: Iterable[str]) -> list[str]:
    """The names with their numeric parts folded into ranges (see the module), in natural order.
    Each position of a dotted name is folded in turn from the last, over names equal in every
    other part, so a folded name stands for exactly the names it came from."""
    rows = [name.split(".") for name in dict.fromkeys(names)]
    longest = max((len(r) for r in rows), default=0)
    for at in reversed(range(longest)):
        kept: list[list[str]] = []
        groups: dict[tuple[tuple[str, ...], tuple[str, ...]], list[int]] = {}
        for r in rows:
            if at < len(r) and r[at].isdigit():
                groups.setdefault((tuple(r[:at]), tuple(r[at + 1 :])), []).append(int(r[at]))
            else:
                kept.append(r)
        rows = kept + [
            [*head, index_ranges(found), *tail] for (head, tail), found in groups.items()
        ]
    return sorted((".".join(r) for r in rows), key=natural)


def _lines_of(names: list[str]) -> list[list[str]]:
    """The names in runs of about LINE_NAMES characters."""
    out: list[list[str]] = [[]]
    width = 0
    for name in names:
        if out[-1] and width + len(name) > LINE_NAMES:
            out.append([])
            width = 0
        out[-1].append(name)
        width += len(name) + 2
    return out


def renamed_lines(renamed: Mapping[tuple[str, str], Sequence[str]]) -> list[str]:
    """`model.layers.0-29.self_attn: output -> output.0`: the modules whose asked site (the key's
    second item) became the same names, folded; a line per such group (more where its modules
    fill more than LINE_NAMES characters), in the natural order of their first module."""
    groups: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for (layer, asked), names in renamed.items():
        groups.setdefault((asked, tuple(names)), []).append(layer)
    lines = []
    ordered = sorted(groups.items(), key=lambda g: natural(min(g[1], key=natural)))
    for (asked, names), layers in ordered:
        for part in _lines_of(fold(layers)):
            lines.append(f"{', '.join(part)}: {asked} -> {', '.join(names)}")
    return lines


def steps_text(steps: Sequence[int]) -> str:
    """`0-5`, `0, 10, ..., 110 (every 10)`, or up to 8 steps then how many: steps as read."""
    steps = sorted(int(s) for s in steps)
    if len(steps) < 3:
        return ", ".join(map(str, steps))
    strides = {b - a for a, b in zip(steps, steps[1:], strict=False)}
    if strides == {1}:
        return f"{steps[0]}-{steps[-1]}"
    if len(strides) == 1:
        return f"{steps[0]}, {steps[1]}, ..., {steps[-1]} (every {strides.pop()})"
    if len(steps) <= 8:
        return ", ".join(map(str, steps))
    return ", ".join(map(str, steps[:8])) + f", ... ({len(steps)} in all)"
