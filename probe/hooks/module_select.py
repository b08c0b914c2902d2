"""Turn probe specs (globs over module names, class names) into the modules and sites to capture."""

from __future__ import annotations

import difflib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from functools import cached_property
from typing import Any

from torch import nn

from probe.errors import ConfigError, SelectionError
from probe.layout import class_axis
from probe.models.anatomy import ALIASES, resolve
from probe.plan import ProbeSpec, Selector
from probe.site_keys import PROBE_SITES

log = logging.getLogger("probe")
BLOCKS = "@blocks"  # in a layer pattern: each block of the model's stacks (`block_names`)
# Classes of optional libraries that shipped probes name (accepted when not imported).
ELSEWHERE = {"Conv1D"}
# The classes the image probes select (probes=all_convs, the default, and grads_all_convs).
CONVOLUTIONS = {"Conv1d", "Conv2d", "Conv3d"}


@dataclass(frozen=True)
class Selection:
    """One module to hook and what to keep from it."""

    name: str
    module: nn.Module
    sites: tuple[str, ...]
    reduce: str
    dtype: str
    probe: str
    unedited: bool = False
    unit_axis: Any = "auto"
    rows: str = "samples"
    cam_grid: tuple[int, int] | None = None  # CAMs of a token layout: its grid
    cam_skip_tokens: int = 0
    sae: Any = None  # the probe's SaeSpec, then its loaded SaeSite (probe.hooks.sae_site)
    transcoders: Any = None  # a set's path, then its TranscoderSite (probe.hooks.transcoder_site)

    @property
    def module_type(self) -> str:
        return type(self.module).__name__

    @cached_property
    def class_axis(self) -> str | None:
        """Where the module's class puts its units ('first', 'last' or None: by the layout)."""
        return class_axis(tuple(c.__name__ for c in type(self.module).__mro__))


def _module_class_names() -> set[str]:
    """Names of every nn.Module class imported so far (torch.nn's, torchvision's, the user's)."""
    names, todo = set(), [nn.Module]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return names


def _class_names(module: nn.Module) -> set[str]:
    return {c.__name__ for c in type(module).__mro__}


def block_names(model: nn.Module) -> list[str]:
    """The blocks of the model's stacks: children of the outermost ModuleLists and Sequentials
    whose two or more children are all of one class with parameters (a transformer's layers,
    a ResNet stage's blocks)."""
    stacks: list[str] = []
    blocks: list[str] = []
    for name, m in model.named_modules():
        if not isinstance(m, nn.ModuleList | nn.Sequential):
            continue
        if any(name.startswith(f"{s}.") for s in stacks):
            continue
        children = list(m.named_children())
        if len(children) < 2 or len({type(c) for _, c in children}) != 1:
            continue
        if next(children[0][1].parameters(), None) is None:
            continue
        stacks.append(name)
        blocks += [f"{name}.{child}" if name else child for child, _ in children]
    return blocks


def _expand(patterns: list[str], model: nn.Module, label: str, empty: bool = False) -> list[str]:
    """Layer patterns with `@blocks` replaced by each block's name (none when the model has no
    stack and the spec allows an empty selection), and the anatomy's aliases (`@attn_out`,
    `@mlp_out`, `@heads`, `@final_norm`, `@unembed`: probe.models.anatomy) by their modules."""
    if not any(p.startswith("@") for p in patterns):
        return list(patterns)
    blocks = block_names(model)
    named = [p for p in patterns if p in ALIASES]
    if named:
        rest = [p for p in patterns if p not in ALIASES]
        found = [n for p in named for n in resolve(model, blocks, p, label)]
        return found + (_expand(rest, model, label, empty) if rest else [])
    if not blocks and empty:
        return [p for p in patterns if BLOCKS not in p]
    if not blocks:
        raise SelectionError(
            f"{label}: {BLOCKS} names the blocks of a stack (a ModuleList or Sequential of two "
            f"or more modules of one class), and {type(model).__name__} has none; name the layers "
            "with globs instead"
        )
    out: list[str] = []
    for p in patterns:
        out += [p.replace(BLOCKS, b) for b in blocks] if BLOCKS in p else [p]
    return out


def match_modules(
    model: nn.Module,
    label: str,
    where: Selector,
    *,
    allow_empty: bool = False,
    leaves_only: bool = False,
    token_advice: bool = True,
) -> list[tuple[str, nn.Module]]:
    """(name, module) pairs a Selector's layers/types/exclude select, in module order; with
    `leaves_only`, modules without children alone.

    A layer glob that matches no module name (with `match: any`, when none of them does), an
    unknown class name, or an empty selection (unless `allow_empty`) is an error naming the bad
    value. `token_advice`: an empty selection of convolutions on a token model says that the
    command line's default probes are for images and names its token probes (probes=residual);
    a caller whose probes the user wrote (probe.watch) passes False and gets the probe's own
    message.
    """
    modules = [(n, m) for n, m in model.named_modules() if n]
    names = [n for n, _ in modules]
    known_types = (
        set().union(*(_class_names(m) for _, m in modules)) | _module_class_names() | ELSEWHERE
    )
    for t in where.types:
        if t not in known_types:
            close = difflib.get_close_matches(t, sorted(known_types), n=3)
            raise ConfigError(
                f"{label}: type {t!r} is no nn.Module class known here (class names are case-sensitive)"
                f"{'; did you mean ' + ', '.join(close) if close else ''}"
            )
    match = where.match
    layers = _expand(list(where.layers), model, label, allow_empty)
    unmatched = [p for p in layers if not any(fnmatchcase(n, p) for n in names)]
    empty_ok = match == "any" and allow_empty  # (alternatives, all absent)
    if unmatched and (match == "all" or len(unmatched) == len(layers)) and not empty_ok:
        pattern = unmatched[0]
        raise SelectionError(
            f"{label}: layer pattern {pattern!r} matches no module; closest names: "
            f"{', '.join(_closest(pattern, names))}. Patterns are fnmatch globs over qualified "
            "names such as 'layer1.0.conv1' ('*' also crosses dots)"
            + ("" if match == "any" else "; with match: any, patterns are alternatives")
            + "; every name: python -m probe.sites model=... (or probe.sites(model) in Python)"
        )
    chosen = [
        (n, m)
        for n, m in modules
        if any(fnmatchcase(n, p) for p in layers)
        and (not where.types or _class_names(m) & set(where.types))
        and not any(fnmatchcase(n, p) for p in where.exclude)
        and not (leaves_only and next(m.children(), None) is not None)
    ]
    if not chosen and not allow_empty:
        token_model = any(isinstance(m, nn.Embedding) for _, m in modules)
        if token_advice and set(where.types) & CONVOLUTIONS and token_model:
            raise SelectionError(
                f"{label} selects no module of {type(model).__name__}: it takes convolutions "
                f"({', '.join(where.types)}), as the default probes (probes=all_convs) do, which "
                "are for image models; on a token model give probes=none (circuits, the patching "
                "grid and the lenses need no probe) or a token probe: probes=residual, "
                "probes=attn_mlp"
            )
        raise SelectionError(
            f"{label} selects no module of {type(model).__name__} "
            f"(layers {list(where.layers)}, types {list(where.types)}, exclude {list(where.exclude)}); "
            f"module names start: {', '.join(names[:8])}. Widen the pattern or set allow_empty: true"
        )
    return chosen


def select_modules(model: nn.Module, probes: Mapping[str, ProbeSpec]) -> list[Selection]:
    """Every (module, sites) the probes (a run plan's, or probe.plan.probe_specs') ask for, in
    the model's module order; errors name the bad value."""
    names = [n for n, _ in model.named_modules() if n]
    merged: dict[str, dict] = {}
    for probe_name, spec in probes.items():
        label = f"probe {probe_name!r}"
        found = match_modules(
            model, label, spec.where, allow_empty=spec.allow_empty, leaves_only=spec.leaves_only
        )
        for n, m in found:
            entry = merged.setdefault(
                n,
                {
                    "module": m,
                    "sites": [],
                    "probe": probe_name,
                    "reduce": spec.reduce,
                    "dtype": spec.dtype,
                    "unedited": spec.unedited,
                    "unit_axis": spec.unit_axis,
                    "rows": spec.rows,
                    "cam_grid": spec.cam_grid,
                    "cam_skip_tokens": spec.cam_skip_tokens,
                    "sae": spec.sae,
                    "transcoders": spec.transcoders,
                },
            )
            layout = ("reduce", "dtype", "unit_axis", "rows", "cam_grid", "cam_skip_tokens", "sae",
                      "transcoders")  # fmt: skip
            if tuple(entry[k] for k in layout) != tuple(getattr(spec, k) for k in layout):
                raise ConfigError(
                    f"module {n!r} is selected by probes {entry['probe']!r} and {probe_name!r} with "
                    "different reduce/dtype/unit_axis/rows/cam_grid/sae/transcoders; exclude it "
                    "from one of them"
                )
            entry["sites"] += [s for s in spec.capture if s not in entry["sites"]]
            if "param_grad" in spec.capture:
                _check_parameters(n, m, probe_name)
    order = {n: i for i, n in enumerate(names)}
    return [
        Selection(
            n,
            e["module"],
            tuple(s for s in PROBE_SITES if s in e["sites"]),
            e["reduce"],
            e["dtype"],
            e["probe"],
            e["unedited"],
            e["unit_axis"],
            e["rows"],
            tuple(e["cam_grid"]) if e["cam_grid"] else None,
            int(e["cam_skip_tokens"] or 0),
            e["sae"],
            e["transcoders"],
        )
        for n, e in sorted(merged.items(), key=lambda kv: order[kv[0]])
    ]


def _check_parameters(name: str, module: nn.Module, probe: str) -> None:
    """param_grad of a module without trainable parameters would silently store nothing."""
    params = list(module.parameters())
    if not any(p.requires_grad for p in params):
        why = (
            "has no parameters"
            if not params
            else "has only frozen parameters (requires_grad=False)"
        )
        raise ConfigError(
            f"probe {probe!r}: layer {name!r} ({type(module).__name__}) {why}, so it has no "
            f"param_grad; exclude it (probes.{probe}.exclude=[{name}], or select by types) or "
            "capture grad_output instead"
        )


def _closest(pattern: str, names: list[str], n: int = 5) -> list[str]:
    plain = pattern.replace("*", "").replace("?", "")
    close = difflib.get_close_matches(plain, names, n=n, cutoff=0.3)
    return close or names[:n]


def warn_nested(label: str, patterns: list[str], names: list[str]) -> None:
    """One line when patterns select a module and its descendants (`transformer.h.*` selects
    13 modules per GPT-2 block), before any work."""
    inner = [n for n in names if any(n.startswith(f"{o}.") for o in names if o != n)]
    if inner:
        log.warning(
            "%s %s select %d modules, %d of them inside another selected one (a block and its "
            "children); @blocks selects each block once",
            label, patterns, len(names), len(inner),
        )  # fmt: skip
