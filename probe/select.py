"""Turn probe specs (globs over module names, class names) into the modules and sites to capture."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from fnmatch import fnmatchcase

from torch import nn

from probe.config import DTYPES, REDUCTIONS, SITES
from probe.errors import ConfigError, SelectionError


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

    @property
    def module_type(self) -> str:
        return type(self.module).__name__


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


def match_modules(model: nn.Module, label: str, spec) -> list[tuple[str, nn.Module]]:
    """(name, module) pairs a spec's layers/types/exclude select, in module order.

    A layer glob that matches no module name, an unknown class name, or an empty selection (unless
    `allow_empty`) is an error naming the bad value.
    """
    modules = [(n, m) for n, m in model.named_modules() if n]
    names = [n for n, _ in modules]
    known_types = set().union(*(_class_names(m) for _, m in modules)) | _module_class_names()
    for t in spec.types:
        if t not in known_types:
            close = difflib.get_close_matches(t, sorted(known_types), n=3)
            raise ConfigError(
                f"{label}: type {t!r} is no nn.Module class known here (class names are case-sensitive)"
                f"{'; did you mean ' + ', '.join(close) if close else ''}"
            )
    for pattern in spec.layers:
        if not any(fnmatchcase(n, pattern) for n in names):
            raise SelectionError(
                f"{label}: layer pattern {pattern!r} matches no module; closest names: "
                f"{', '.join(_closest(pattern, names))}. Patterns are fnmatch globs over qualified "
                "names such as 'layer1.0.conv1' ('*' also crosses dots)"
            )
    leaves_only = getattr(spec, "leaves_only", False)
    chosen = [
        (n, m)
        for n, m in modules
        if any(fnmatchcase(n, p) for p in spec.layers)
        and (not spec.types or _class_names(m) & set(spec.types))
        and not any(fnmatchcase(n, p) for p in spec.exclude)
        and not (leaves_only and next(m.children(), None) is not None)
    ]
    if not chosen and not getattr(spec, "allow_empty", False):
        raise SelectionError(
            f"{label} selects no module of {type(model).__name__} "
            f"(layers {list(spec.layers)}, types {list(spec.types)}, exclude {list(spec.exclude)}); "
            f"module names start: {', '.join(names[:8])}. Widen the pattern or set allow_empty: true"
        )
    return chosen


def select_modules(model: nn.Module, probes: dict) -> list[Selection]:
    """Every (module, sites) the probes ask for, in the model's module order; errors name the bad value."""
    names = [n for n, _ in model.named_modules() if n]
    merged: dict[str, dict] = {}
    for probe_name, spec in probes.items():
        _check_spec(probe_name, spec)
        for n, m in match_modules(model, f"probe {probe_name!r}", spec):
            entry = merged.setdefault(
                n,
                {
                    "module": m,
                    "sites": [],
                    "probe": probe_name,
                    "reduce": spec.reduce,
                    "dtype": spec.dtype,
                    "unedited": spec.unedited,
                },
            )
            if (entry["reduce"], entry["dtype"]) != (spec.reduce, spec.dtype):
                raise ConfigError(
                    f"module {n!r} is selected by probes {entry['probe']!r} and {probe_name!r} with "
                    "different reduce/dtype; exclude it from one of them"
                )
            entry["sites"] += [s for s in spec.capture if s not in entry["sites"]]
    order = {n: i for i, n in enumerate(names)}
    return [
        Selection(
            n,
            e["module"],
            tuple(s for s in SITES if s in e["sites"]),
            e["reduce"],
            e["dtype"],
            e["probe"],
            e["unedited"],
        )
        for n, e in sorted(merged.items(), key=lambda kv: order[kv[0]])
    ]


def _check_spec(name: str, spec) -> None:
    for site in spec.capture:
        if site not in SITES:
            raise ConfigError(
                f"probe {name!r}: capture site {site!r} is unknown; choose from {', '.join(SITES)}"
            )
    if not spec.capture:
        raise ConfigError(f"probe {name!r}: capture is empty; list sites from {', '.join(SITES)}")
    if spec.reduce not in REDUCTIONS:
        raise ConfigError(
            f"probe {name!r}: reduce={spec.reduce!r} is unknown; choose from {', '.join(REDUCTIONS)}"
        )
    if spec.dtype not in DTYPES:
        raise ConfigError(
            f"probe {name!r}: dtype={spec.dtype!r} is unknown; choose from {', '.join(DTYPES)}"
        )


def _closest(pattern: str, names: list[str], n: int = 5) -> list[str]:
    plain = pattern.replace("*", "").replace("?", "")
    close = difflib.get_close_matches(plain, names, n=n, cutoff=0.3)
    return close or names[:n]
