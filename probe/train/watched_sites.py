"""What a watched training records: probe specs resolved on the model into modules, their value
and gradient sites, and the parameters each names.

A probe's `capture` lists, per selected module:

- `output`, `input`: the values of the user's forward;
- `grad_output`, `grad_input`: their gradients in the user's backward;
- `param`, `param_grad`, `param_update`: every parameter of the module (its own and its
  children's, named as `module.named_parameters()` names them: `weight`, `attn.c_attn.bias`),
  its gradient as the optimizer sees it, and the change the optimizer step made;
  `param.<glob>` (`param.weight`, `param_grad.*.bias`) only those whose name matches
  (fnmatchcase). Gradients and updates are of trainable parameters only.

Modules are selected as a run selects them (`probe.hooks.module_select.match_modules`: globs, types,
`@blocks` aliases, exclude), from the probe specs `probe.plan.probe_specs` parses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

from torch import nn

from probe.errors import ConfigError
from probe.hooks.module_select import match_modules
from probe.layout import class_axis
from probe.plan import probe_specs, spec_config
from probe.site_keys import PARAM_SITES, VALUE_SITES, WATCH_SITES, SiteKey, parse_or_none


@dataclass
class WatchedModule:
    """One selected module: its value and gradient sites, and per parameter site the (name,
    parameter) pairs it records."""

    name: str
    module: nn.Module
    probe: str
    unit_axis: Any = "auto"
    sites: set[str] = field(default_factory=set)
    params: dict[str, dict[str, nn.Parameter]] = field(default_factory=dict)

    @property
    def module_type(self) -> str:
        return class_name(self.module)

    @property
    def class_axis(self) -> str | None:
        return class_axis(tuple(c.__name__ for c in type(self.module).__mro__))

    def wants(self, *sites: str) -> bool:
        return any(s in self.sites for s in sites)


def class_name(module: nn.Module) -> str:
    """The module's class name, as in the unwrapped model: FSDP2's `fully_shard` (and
    `replicate`) give a module the class FSDP<name> of FSDPModule and its own class."""
    cls = type(module)
    bases = cls.__bases__
    if len(bases) == 2 and bases[0].__name__ in ("FSDPModule", "ReplicateModule"):
        cls = bases[1]
    return cls.__name__


def watched_site(entry) -> SiteKey | None:
    """A capture entry as the site it watches: a watch site's family alone, or a parameter
    family with a glob over parameter names as its path (`param_grad.*.bias`); None for any
    other entry."""
    key = parse_or_none(str(entry))
    if key is None or key.family not in WATCH_SITES:
        return None
    if key.family not in PARAM_SITES and key != SiteKey(key.family):
        return None
    return key


def check_capture(probe: str, capture) -> None:
    if not capture:
        raise ConfigError(
            f"probe {probe!r}: capture is empty; list sites from {', '.join(WATCH_SITES)} "
            "(param sites take a glob: param.weight, param_grad.*)"
        )
    for entry in capture:
        key = watched_site(entry)
        if key is None:
            raise ConfigError(
                f"probe {probe!r}: capture site {entry!r} is not one a watched training records; "
                f"choose from {', '.join(WATCH_SITES)} (param, param_grad and param_update take a "
                "glob over the module's parameter names: param.weight, param_grad.*)"
            )
        if key.path == ".":
            raise ConfigError(f"probe {probe!r}: {entry!r} names no parameter; give {key.family}.*")


def resolve(model: nn.Module, probes) -> list[WatchedModule]:
    """The watched modules in the model's module order; a probe that selects no module (unless
    `allow_empty`), a parameter glob that matches no parameter of its modules, or probes that
    select nothing at all are ConfigErrors naming them."""
    specs = probe_specs(probes, run_sites=False)
    if not specs:
        raise ConfigError(
            "probe.watch got no probes; give a mapping {name: {layers: [...], capture: [...]}} "
            "or a shipped probe file's name (all_convs, blocks, ...)"
        )
    merged: dict[str, WatchedModule] = {}
    for probe, spec in specs.items():
        check_capture(probe, spec.capture)
        matched = match_modules(
            model, f"probe {probe!r}", spec.where, allow_empty=spec.allow_empty,
            leaves_only=spec.leaves_only, token_advice=False,
        )  # fmt: skip
        globs: dict[str, bool] = {}
        for name, module in matched:
            w = merged.setdefault(name, WatchedModule(name, module, probe, spec.unit_axis))
            for entry in spec.capture:
                key = SiteKey.parse(str(entry))  # (checked above)
                if key.family not in PARAM_SITES:
                    w.sites.add(key.family)
                    continue
                chosen = params_of(module, key.family, key.parameter or "*")
                globs[entry] = globs.get(entry, False) or bool(chosen)
                w.params.setdefault(key.family, {}).update(chosen)
        for entry, found in globs.items():
            if not found:
                kind = SiteKey.parse(str(entry)).family
                raise ConfigError(
                    f"probe {probe!r}: {entry!r} matches no "
                    f"{'trainable ' if kind != 'param' else ''}parameter of its "
                    f"{len(matched)} modules (e.g. {matched[0][0]!r}: "
                    f"{', '.join(n for n, _ in matched[0][1].named_parameters()) or 'none'}); "
                    "widen the glob or select other modules"
                )
    if not merged:
        raise ConfigError(
            f"the probes {', '.join(map(repr, specs))} select no module of "
            f"{type(model).__name__}; widen their layers or types"
        )
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    return sorted(merged.values(), key=lambda w: order[w.name])


def params_of(module: nn.Module, kind: str, pattern: str) -> dict[str, nn.Parameter]:
    """The module's parameters whose names match `pattern`; for gradients and updates, only
    those that train (requires_grad)."""
    return {
        name: p
        for name, p in module.named_parameters()
        if fnmatchcase(name, pattern) and (kind == "param" or p.requires_grad)
    }


def value_probes(probes) -> dict[str, dict]:
    """The probes restricted to the value sites (output, input), as a run takes them: what the
    probe batch captures. Probes without a value site are left out."""
    out = {}
    for name, spec in probe_specs(probes, run_sites=False).items():
        capture = [s for s in spec.capture if s in VALUE_SITES]
        if capture:
            out[name] = {**spec_config(spec), "capture": capture}
    return out
