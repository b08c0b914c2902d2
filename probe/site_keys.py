"""Sites and their names: the one list of site families, and `SiteKey`, a dataset's site name as
(family, path, call, derived) with its parse and its string form.

A dataset under `/layers/<layer>/` (and its `/stats`, `/topk`, `/coverage` twins, a row of
summary.csv or train.csv) is named `<family><path>[@<call>][.<derived>]`:

- family: what the value is (`output`, `grad_input`, `param_grad`, `gradcam`, `sae.latents`,
  `unedited_output`, ...; `FAMILIES`);
- path: where in the module's value the tensor sits, as probe.hooks.names.flatten writes it: ''
  for a tensor, `.0` for a tuple's first item, `.logits` for a field, `.0.aux` below it; for the
  parameter families the parameter's name (`.weight`, `.attn.c_attn.bias`);
- call: k for the module's (k+1)-th call in one forward, written `@k` when k > 0;
- derived: for an attribution site, what was derived from its map (`sum`, each sample's total;
  `units`, each sample's |attribution| per unit; `gap`, integrated gradients' completeness gap).

Kept free of Hydra and torch: readers that never compose a config take their names here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from functools import lru_cache

# -- the site families -----------------------------------------------------------------------
VALUE_SITES = ("output", "input")  # a module's values in the forward
VALUE_GRAD_SITES = ("grad_output", "grad_input")  # the gradients of those values
# a watched training's parameter sites: each parameter, its gradient, the optimizer step's change
PARAM_SITES = ("param", "param_grad", "param_update")
# the gradients a probing run captures from the objective's backward: of values and of parameters
VALUE_AND_PARAM_GRAD_SITES = (*VALUE_GRAD_SITES, "param_grad")
CAM_SITES = ("gradcam", "hirescam", "gradcam_pp", "layercam", "xgradcam")
ATTRIBUTION_SITES = ("grad_x_output", "grad_x_input", *CAM_SITES, "ig_output")
# what a probing run's probe captures (probes.<name>.capture)
PROBE_SITES = (*VALUE_SITES, *VALUE_GRAD_SITES, "param_grad", *ATTRIBUTION_SITES)
# the sites that need the objective's backward
BACKWARD_SITES = (*VALUE_AND_PARAM_GRAD_SITES, *ATTRIBUTION_SITES)
# what a watched training's probe captures
WATCH_SITES = (*VALUE_SITES, *VALUE_GRAD_SITES, *PARAM_SITES)
EDIT_SITES = ("input", "output", "grad_output", "grad_input")  # where an intervention acts
GRAD_EDIT_SITES = VALUE_GRAD_SITES  # the edits that act in the backward
# the value before an edit, kept by a probe with `unedited: true`
UNEDITED_SITES = tuple(f"unedited_{s}" for s in EDIT_SITES)
SAE_SITES = ("sae.latents", "sae.error")  # an SAE's latents and error on a layer's output
TRANSCODER_SITES = ("transcoder.features",)  # a transcoder's features of the module's input
FAMILIES = tuple(
    dict.fromkeys((*PROBE_SITES, *PARAM_SITES, *UNEDITED_SITES, *SAE_SITES, *TRANSCODER_SITES))
)  # every family a dataset name starts with
DERIVED = ("sum", "units", "gap")  # what an attribution site's datasets derive from its map

# longest first, so that `sae.latents` wins over any shorter family it starts with
_BY_LENGTH = sorted(FAMILIES, key=len, reverse=True)
_AFTER = ("", ".", "@")  # what follows a family in a name
_CALL = re.compile(r"(.*)@([1-9][0-9]*)", re.DOTALL)


@dataclass(frozen=True)
class SiteKey:
    """One dataset's site: `SiteKey("output", ".0", 1)` is `output.0@1`; `SiteKey("param_grad",
    ".weight")` is `param_grad.weight`; `SiteKey("gradcam", "", 0, "sum")` is `gradcam.sum`."""

    family: str
    path: str = ""
    call: int = 0
    derived: str = ""

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(
                f"site family {self.family!r} is unknown; one of {', '.join(FAMILIES)}"
            )
        if self.path and not self.path.startswith("."):
            raise ValueError(f"site path {self.path!r} does not start with '.'")
        if self.call < 0 or (self.call and self.family in PARAM_SITES):
            raise ValueError(f"call {self.call} of site family {self.family!r}")
        if self.derived and (self.derived not in DERIVED or self.family not in ATTRIBUTION_SITES):
            raise ValueError(f"{self.derived!r} is not derived from site family {self.family!r}")

    @staticmethod
    def parse(name: str) -> SiteKey:
        """The key a dataset's site name holds; ValueError for a name that is no site's."""
        return _parse(name)

    def __str__(self) -> str:
        call = f"@{self.call}" if self.call else ""
        derived = f".{self.derived}" if self.derived else ""
        return f"{self.family}{self.path}{call}{derived}"

    def unedited(self) -> SiteKey:
        """The same value before an edit (`unedited_output.0` of `output.0`)."""
        return replace(self, family=f"unedited_{self.family}")

    @property
    def parameter(self) -> str:
        """A parameter site's parameter name (`weight` of `param_grad.weight`)."""
        return self.path[1:]


@lru_cache(maxsize=65536)  # a run names the same few sites every batch
def _parse(name: str) -> SiteKey:
    family = next(
        (f for f in _BY_LENGTH if name.startswith(f) and name[len(f) : len(f) + 1] in _AFTER),
        None,
    )
    if family is None:
        raise ValueError(f"site name {name!r} starts with no site family ({', '.join(FAMILIES)})")
    rest = name[len(family) :]
    if family in PARAM_SITES:  # a parameter's name is all the rest, dots and all
        return SiteKey(family, rest)
    derived = ""
    if family in ATTRIBUTION_SITES:
        derived = next((d for d in DERIVED if rest.endswith(f".{d}")), "")
        rest = rest[: len(rest) - len(derived) - 1] if derived else rest
    call = _CALL.fullmatch(rest)
    if call is not None:
        return SiteKey(family, call.group(1), int(call.group(2)), derived)
    return SiteKey(family, rest, 0, derived)


def parse_or_none(name: str) -> SiteKey | None:
    """SiteKey.parse(name), or None for a name that is no site's (a dataset a file added)."""
    try:
        return SiteKey.parse(name)
    except ValueError:
        return None


def family_of(name: str) -> str | None:
    """The family of a site name, or None for a name that is no site's."""
    key = parse_or_none(name)
    return None if key is None else key.family
