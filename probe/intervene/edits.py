"""Declarative edits of module inputs, outputs and gradients (ablations, noise, gradient surgery).

An edit never changes the user's tensors in place: every op returns a new tensor. Edits of one
site apply in config order; a probe on an edited site records the value after the edit (and, with
`unedited: true`, the value before it as `unedited_<site>`).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from probe.config import import_target
from probe.errors import ConfigError, DataError
from probe.hooks.module_select import match_modules
from probe.intervene.feature_edit import (
    FEATURE_SITE,
    FeatureRead,
    FeatureWrite,
    check_feature,
    feature_modules,
    load_set,
)
from probe.intervene.patch_steer import Patch, Region, Steer, load_vector, mean_diff
from probe.layout import class_axis
from probe.plan import EditSpec
from probe.site_keys import SiteKey
from probe.store import swmr
from probe.store.fileformat import layer_path, read_progress


@dataclass
class Edit:
    """One edit bound to one module. `apply(x, start, key)` returns the edited copy of `x`."""

    name: str
    module_name: str
    module: nn.Module
    site: str
    op: str
    fn: Callable[[torch.Tensor, int, str, list[int] | None], torch.Tensor]
    channels: list[int] | None = None
    describe: dict = field(default_factory=dict)

    def apply(self, x: torch.Tensor, start: int, key: str, tokens=None) -> torch.Tensor:
        """`start` is the dataset index of the batch's first sample, `key` the dataset-style name,
        `tokens` a token batch's layout (patches and steering vectors at token positions)."""
        if isinstance(self.fn, Patch | Steer | FeatureWrite):
            return self.fn(x, start, key, None, tokens)
        if self.channels is None:
            return self.fn(x, start, key, None)
        n = x.shape[1] if x.ndim > 1 else 0
        bad = [c for c in self.channels if not -n <= c < n]
        if bad:
            raise ConfigError(
                f"intervene {self.name!r}: channels {bad} are out of range for {self.module_name!r} "
                f"{key} with {n} channels (shape {tuple(x.shape)}); give indices below {n}"
            )
        out = x.clone()
        out[:, self.channels] = self.fn(x[:, self.channels], start, key, self.channels)
        return out


def build_edits(
    model: nn.Module, specs: Mapping[str, EditSpec], seed: int, transcoders: str | None = None
) -> list[Edit]:
    """Every named edit (a run plan's, probe.checks took their values) bound to the modules it
    selects; errors before any work. `transcoders`: the set a feature edit without its own
    `transcoders` key uses (the run's graph.transcoders)."""
    edits = []
    sets: dict = {}
    for name, spec in specs.items():
        if spec.site == FEATURE_SITE:
            edits += feature_edits(model, name, spec, spec.transcoders or transcoders, sets)
            continue
        for module_name, module in match_modules(model, f"intervene {name!r}", spec.where):
            fn = _op(name, spec, module_name, seed, region(model, module, module_name, spec))
            channels = list(spec.channels) if spec.channels is not None else None
            if spec.op is None:  # (probe.plan's parse refuses an edit without its op)
                raise RuntimeError(f"intervene {name!r} has no op")
            edits.append(
                Edit(
                    name,
                    module_name,
                    module,
                    spec.site,
                    spec.op,
                    fn,
                    channels,
                    _describe(name, spec, module_name),
                )
            )
    return edits


def feature_edits(model: nn.Module, name: str, spec, path: str | None, sets: dict) -> list[Edit]:
    """site=feature: the identity edit that keeps the transcoder's input and the edit of the
    MLP's output (probe.intervene.feature_edit)."""
    label = f"intervene {name!r}"
    if not path:
        raise ConfigError(
            f"{label}: site=feature needs a transcoder set: +intervene.{name}.transcoders=PATH "
            "(its YAML or folder) or graph.transcoders=PATH"
        )
    tset = load_set(str(path), label, sets)
    check_feature(label, tset, int(spec.layer), int(spec.feature))
    (read_name, read_module), (mlp_name, mlp) = feature_modules(
        model, int(spec.layer), tset.reads, label
    )
    read = FeatureRead(read_module if tset.reads == "mlp_normalized" else None)
    positions = list(spec.positions) if spec.positions is not None else None
    where = Region(f"{label} at {mlp_name!r}", None, positions)
    write = FeatureWrite(label, tset.transcoders[int(spec.layer)], int(spec.feature), spec.op,
                         spec.value, spec.factor, where, read)  # fmt: skip
    describe = {"edit": name, "layer": mlp_name, "site": FEATURE_SITE, "op": spec.op,
                "transcoder_layer": int(spec.layer), "feature": int(spec.feature),
                "transcoders": str(path)}  # fmt: skip
    describe.update({"factor": spec.factor} if spec.op == "scale" else {})
    describe.update({"value": spec.value} if spec.op == "clamp" else {})
    if positions is not None:
        describe["positions"] = positions
    return [
        Edit(name, read_name, read_module, "input", "feature_read", read, None, {}),
        Edit(name, mlp_name, mlp, "output", spec.op, write, None, describe),
    ]


def _describe(name: str, spec, module_name: str) -> dict:
    keys = {
        "zero": [],
        "scale": ["factor"],
        "add": ["value", "vector", "plus", "minus", "factor"] if spec.vector else ["value"],
        "clamp": ["min", "max"],
        "noise": ["std", "seed"],
        "mean": ["source"],
        "custom": ["_target_"],
        "patch": ["source", "direction"],
    }[spec.op]
    d = {"edit": name, "layer": module_name, "site": spec.site, "op": spec.op}
    d.update({k: getattr(spec, k) for k in keys})
    for key in ("channels", "positions", "units", "heads"):
        if getattr(spec, key) is not None:
            d[key] = list(getattr(spec, key))
    return d


def region(model: nn.Module, module: nn.Module, module_name: str, spec) -> Region:
    """Where a patch or steering vector acts on one module (positions, units, heads)."""
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    heads = heads or getattr(module, "num_heads", None)
    return Region(
        f"intervene at {module_name!r}",
        class_axis(tuple(c.__name__ for c in type(module).__mro__)),
        list(spec.positions) if spec.positions is not None else None,
        list(spec.units) if spec.units is not None else None,
        list(spec.heads) if spec.heads is not None else None,
        heads,
    )


def _patch_or_steer(name: str, spec, module_name: str, where: Region):
    """op=patch, or op=add with a vector."""
    where.label = f"intervene {name!r} at {module_name!r}"
    if spec.op == "patch":
        return Patch(where.label, module_name, spec.site, where, str(spec.source))
    if spec.vector == "mean_diff":
        vector = mean_diff(spec.plus, spec.minus, module_name, where.label)
    else:
        vector = load_vector(spec.vector, where.label)
    return Steer(where.label, spec.site, where, float(spec.factor), vector)


def _op(name: str, spec, module_name: str, seed: int, where: Region):
    op = spec.op
    if op == "patch" or (op == "add" and spec.vector):
        return _patch_or_steer(name, spec, module_name, where)
    if op == "zero":
        return lambda x, start, key, ch: replacing(x, lambda: torch.zeros_like(x))
    if op == "scale":
        factor = float(spec.factor)
        return lambda x, start, key, ch: x * factor
    if op == "add":
        value = float(spec.value)
        return lambda x, start, key, ch: x + value
    if op == "clamp":
        return lambda x, start, key, ch: x.clamp(spec.min, spec.max)
    if op == "noise":
        return _noise(
            float(spec.std), seed if spec.seed is None else int(spec.seed), name, module_name
        )
    if op == "mean":
        return MeanSource(name, module_name, spec.source)
    target = spec._target_
    fn = import_target(f"intervene.{name}._target_", target, example="my_edits.halve")
    return lambda x, start, key, ch: fn(x)


def _noise(std: float, seed: int, name: str, module_name: str):
    """Gaussian noise drawn per sample from a generator seeded by (seed, edit, layer, site, sample index),
    so it does not depend on the batch size or the order of other edits."""

    def add_noise(x: torch.Tensor, start: int, key: str, ch) -> torch.Tensor:
        salt = zlib.crc32(f"{name}/{module_name}/{key}/{ch}".encode())
        noise = torch.stack(
            [
                torch.randn(
                    x.shape[1:],
                    generator=torch.Generator().manual_seed(
                        (seed * 1_000_003 + salt) ^ (start + i)
                    ),
                )
                for i in range(x.shape[0])
            ]
        )
        return x + std * noise.to(device=x.device, dtype=x.dtype)

    return add_noise


class _Replaced(torch.autograd.Function):
    """`make()` in place of x, on x's autograd edge: the sites after an ablation keep their
    gradients and x gets zeros, as after `x * 0` (which a NaN or Inf in x would make NaN). The
    value is made inside `forward`, so it is the Function's own output, which a later in-place
    op (ReLU(inplace=True), `out += identity`) may modify; a tensor passed in would be a view."""

    @staticmethod
    def forward(ctx, x, make):
        return make()

    @staticmethod
    def backward(ctx, grad):
        return torch.zeros_like(grad), None


def replacing(x: torch.Tensor, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`make()`, a value that does not depend on x, in x's place in autograd when x has a graph."""
    return _Replaced.apply(x, make) if x.requires_grad else make()


class MeanSource:
    """op=mean: replaces each value by its mean over the dataset's samples, position by position
    (from a first pass or a file)."""

    def __init__(self, name: str, module_name: str, source: str):
        self.name, self.module_name, self.source = name, module_name, source
        self.means: dict[str, torch.Tensor] = {}

    @property
    def needs_first_pass(self) -> bool:
        return self.source == "first_pass"

    def __call__(self, x: torch.Tensor, start: int, key: str, ch) -> torch.Tensor:
        mean = self.means.get(key)
        if mean is None:
            mean = self.means[key] = self._from_file(key)
        if ch is not None:
            mean = mean[ch]
        return replacing(x, lambda: mean.to(device=x.device, dtype=x.dtype).expand_as(x).clone())

    def _from_file(self, key: str) -> torch.Tensor:
        if self.needs_first_pass:
            raise ConfigError(
                f"intervene {self.name!r}: no first-pass mean for {self.module_name!r} {key}"
            )
        path = Path(self.source)
        name = layer_path(self.module_name, key)
        try:
            with swmr.open_read(path) as f:
                ds = f.get(name)
                if ds is None:
                    raise DataError(
                        f"intervene {self.name!r}: source={str(path)!r} has no dataset {name!r}; run a probe "
                        f"capturing {replace(SiteKey.parse(key), call=0)} of {self.module_name!r} first (reduce: none)"
                    )
                rows = read_progress(f).valid_rows(ds, key)
                total = torch.zeros(ds.shape[1:], dtype=torch.float64)
                step = max(1, ds.chunks[0] if ds.chunks else 64)
                for lo in range(0, rows, step):
                    total += torch.from_numpy(ds[lo : min(rows, lo + step)]).double().sum(0)
        except OSError as e:
            raise DataError(
                f"intervene {self.name!r}: source={str(path)!r} cannot be read ({e})"
            ) from None
        return (total / max(rows, 1)).float()

    def set_first_pass(self, sums: dict[str, torch.Tensor], count: int) -> None:
        self.means = {k: (v / count).float() for k, v in sums.items()}


def first_pass_means(model: nn.Module, batches, edits: list[Edit], device) -> None:
    """op=mean with source=first_pass: one clean pass over the dataset summing each edited site."""
    from probe.hooks.capture import Capture
    from probe.hooks.forward import call, to_device, token_batch
    from probe.hooks.module_select import Selection

    sources = [e.fn for e in edits if isinstance(e.fn, MeanSource) and e.fn.needs_first_pass]
    if not sources:
        return
    sites: dict[str, tuple[nn.Module, set[str]]] = {}  # by module name: the module, its sites
    for e in edits:
        if isinstance(e.fn, MeanSource) and e.fn.needs_first_pass:
            sites.setdefault(e.module_name, (e.module, set()))[1].add(e.site)
    selections = [
        Selection(n, m, tuple(sorted(s)), "none", "float32", "mean") for n, (m, s) in sites.items()
    ]
    sums: dict[tuple[str, str], torch.Tensor] = {}
    count = 0
    with Capture(selections) as capture, torch.inference_mode():
        for batch in batches:
            tokens = token_batch(batch.inputs)
            captured = capture.begin(batch.size, batch.start, tokens and tokens.to(device))
            call(model, to_device(model, batch.inputs, device))
            capture.end()
            for key, v in captured.values.items():
                s = v.double().sum(0)
                sums[key] = sums[key] + s if key in sums else s
            count += batch.size
    for e in edits:
        if isinstance(e.fn, MeanSource) and e.fn.needs_first_pass:
            e.fn.set_first_pass({k[1]: v for k, v in sums.items() if k[0] == e.module_name}, count)
