"""Values computed without the pipeline, that the pipeline's files are compared with.

`make_setup` holds one model and one list of materialised batches; `probe_case` runs the pipeline
over them and the oracles below read the same model and batches: `reference_values` is what plain
forward hooks see (and, for gradient sites, what tensor hooks on those outputs receive),
`stored_values_match` compares a file with it, `numpy_stats` is a batch's statistics in float64
numpy, and the hand-written captures (hooks writing h5py, clones saved with torch.save,
torchvision's feature extractor) store the same values by other means.

tests/stats/test_bench_values.py checks them, and the benchmarks (scripts/bench*.py) use them: the values
a benchmark reports as equal are the ones the tests check.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import torch
from omegaconf import DictConfig
from torch.nn import functional as F

from probe.data.batches import Batch
from probe.hooks.hookset import HookSet
from probe.hooks.module_select import select_modules
from probe.hooks.objective import build_objective
from probe.launch.run import Prepared, build_run, run
from probe.models.placement import is_placed
from probe.plan import RunPlan, parse
from probe.site_keys import BACKWARD_SITES, VALUE_GRAD_SITES, family_of
from probe.testing.compose import make_cfg


class Materialised:
    """The pipeline's batches held in memory, so data generation is outside every timing."""

    def __init__(self, batches):
        self.items = list(batches)
        self.has_targets = batches.has_targets
        self.num_samples = batches.num_samples
        self.batch_size = batches.batch_size
        self.dataset = batches.dataset  # the run's size plan forwards its first samples

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[Batch]:
        return iter(self.items)

    def skip(self, batches: int) -> None:
        """(probe.data.batches.RunBatches's: the oracles' runs never resume)"""
        raise NotImplementedError("the oracles' batches are never resumed")


@dataclass
class Setup:
    """One model and one list of batches shared by the pipeline and the oracles."""

    cfg: DictConfig
    base: Prepared
    overrides: tuple[str, ...] = ()

    @property
    def model(self) -> torch.nn.Module:
        return self.base.model

    @property
    def batches(self) -> Materialised:
        """The batches make_setup holds in memory."""
        batches = self.base.batches
        assert isinstance(batches, Materialised)  # (make_setup's)
        return batches

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.base.selections]

    def modules(self) -> list[tuple[str, torch.nn.Module]]:
        return [(s.name, s.module) for s in self.base.selections]

    def variant(self, *overrides: str, dtype: str | None = None) -> tuple[RunPlan, Prepared]:
        """The pipeline's config with overrides, re-using this setup's model and batches."""
        replaced = {o.split("=")[0] for o in overrides}
        kept = [o for o in self.overrides if o.split("=")[0] not in replaced]
        cfg = make_cfg(*kept, *overrides)
        if dtype is not None:
            for spec in cfg.probes.values():
                spec.dtype = dtype
        plan = parse(cfg)
        sels = select_modules(self.model, plan.probes)
        needs_grad = any(s in BACKWARD_SITES for sel in sels for s in sel.sites)
        objective = build_objective(plan.objective, True) if needs_grad else None
        setup = dataclasses.replace(
            self.base.setup, plan=plan, selections=sels, objective=objective, edits=[]
        )
        return plan, Prepared(setup)


def make_setup(overrides: list[str]) -> Setup:
    cfg = make_cfg(*overrides)
    base = build_run(cfg)
    if not is_placed(base.model):  # (a device map's model stays where it was put)
        base.model.to(base.device)
    base.model.eval()
    base.setup.batches = Materialised(base.setup.batches)
    return Setup(cfg, base, tuple(overrides))


def probe_case(setup: Setup, *overrides: str, dtype: str | None = None) -> Callable:
    """The pipeline over the setup's model and batches: `case(out_dir) -> probe.h5`; the config
    is composed here, so a timed call runs the pipeline alone."""
    plan, prepared = setup.variant(*overrides, dtype=dtype)

    def case(out: Path) -> Path:
        return run(plan, run_dir=out, prepared=prepared).h5_path

    return case


class hooked(HookSet):
    """Plain forward hooks calling `fn(name, output)` on the setup's modules, removed on exit;
    hooks added to it inside the block (a tensor hook on an output) go on exit too."""

    def __init__(self, setup: Setup, fn: Callable[[str, torch.Tensor], None]):
        super().__init__("oracle")
        self.setup, self.fn = setup, fn

    def __enter__(self):
        super().__enter__()
        for n, m in self.setup.modules():
            self.forward(m, lambda mod, args, out, n=n: self.fn(n, out), name=n)
        return self


# -- reference values and the equality check --------------------------------------------------
def reference_values(setup: Setup, grads: bool = False) -> dict[tuple[str, str], np.ndarray]:
    """What plain forward hooks see (clone in the hook) for every selected module over all batches;
    with `grads`, also what a tensor hook on each output receives from the summed cross-entropy."""
    acc: dict[tuple[str, str], list[np.ndarray]] = {}

    def keep(key, t):
        acc.setdefault(key, []).append(t.detach().clone().numpy())

    def hook(n, o):
        keep((n, "output"), o)
        if grads:
            hooks.tensor(o, lambda g, n=n: keep((n, "grad_output"), g), name=n)

    model = setup.model
    with hooked(setup, hook) as hooks:
        for b in setup.base.batches:
            if grads:
                x = b.inputs.detach().requires_grad_(True)
                loss = F.cross_entropy(model(x), b.targets, reduction="sum")
                torch.autograd.grad(loss, x)
            else:
                with torch.inference_mode():
                    model(b.inputs)
    return {k: np.concatenate(v) for k, v in acc.items()}


def stored_values_match(
    h5_path: Path,
    reference: dict[tuple[str, str], np.ndarray],
    sites: tuple[str, ...] = ("output",),
    dtype: str | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> tuple[bool, str]:
    """Whether every (layer, site) of `reference` with a site in `sites` is stored in `h5_path`
    with equal values (after casting the reference to `dtype`); returns (ok, a short reason)."""
    with h5py.File(h5_path, "r") as f:
        for (layer, site), ref in reference.items():
            if site not in sites:
                continue
            name = f"layers/{layer}/{site}"
            if name not in f:
                return False, f"{name} missing"
            got = f[name][:]
            want = ref.astype(dtype) if dtype else ref
            if got.shape != want.shape or got.dtype != want.dtype:
                return False, f"{name}: {got.dtype}{got.shape} != {want.dtype}{want.shape}"
            scale = (
                max(float(np.abs(want).max()), 1e-30)
                if family_of(site) in VALUE_GRAD_SITES
                else 1.0
            )
            if not np.allclose(got, want, rtol=rtol, atol=atol * scale):
                worst = float(np.abs(got.astype(np.float64) - want).max())
                return False, f"{name}: max |diff| {worst:.3g}"
    return True, "equal"


def numpy_stats(a: np.ndarray) -> dict:
    """A batch's statistics (rows are samples) in float64 numpy, named as BatchStats' fields."""
    a = a.astype(np.float64).reshape(len(a), -1)
    finite = np.isfinite(a)
    f = a[finite]
    return {
        "n": f.size,
        "mean": f.mean(),
        "m2": ((f - f.mean()) ** 2).sum(),
        "min": f.min(),
        "max": f.max(),
        "abs_sum": np.abs(f).sum(),
        "zeros": int((f == 0).sum()),
        "l2_sum": np.sqrt((np.where(finite, a, 0) ** 2).sum(axis=1)).sum(),
        "nan_count": int(np.isnan(a).sum()),
        "inf_count": int(np.isinf(a).sum()),
    }


# -- hand-written captures: the same values by other means (the benchmark's baselines) ---------
def naive_clone_torch_save(setup: Setup) -> Callable:
    """Forward hooks clone into lists; one torch.save at the end (everything stays in RAM)."""

    def case(out: Path) -> Path:
        kept: dict[str, list[torch.Tensor]] = {n: [] for n in setup.names}
        with hooked(setup, lambda n, o: kept[n].append(o.detach().clone())), torch.inference_mode():
            for b in setup.base.batches:
                setup.model(b.inputs)
        path = out / "naive.pt"
        torch.save({n: torch.cat(v) for n, v in kept.items()}, path)
        return path

    return case


class H5Sink:
    """Synchronous writes into preallocated, contiguous HDF5 datasets (the simplest fast layout)."""

    def __init__(self, path: Path, total: int):
        self.file, self.total = h5py.File(path, "w"), total

    def write(self, name: str, start: int, t: torch.Tensor) -> None:
        a = t.detach().cpu().numpy()
        key = f"layers/{name}/output"
        ds = self.file.get(key) or self.file.create_dataset(
            key, shape=(self.total, *a.shape[1:]), dtype=a.dtype
        )
        ds[start : start + len(a)] = a

    def close(self) -> None:
        self.file.close()


def hooks_h5py_sync(setup: Setup) -> Callable:
    """Forward hooks writing each output to h5py inside the hook, on the forward's thread."""

    def case(out: Path) -> Path:
        path = out / "hooks.h5"
        sink, start = H5Sink(path, setup.batches.num_samples), [0]
        with hooked(setup, lambda n, o: sink.write(n, start[0], o)), torch.inference_mode():
            for b in setup.base.batches:
                start[0] = b.start
                setup.model(b.inputs)
        sink.close()
        return path

    return case


def extracted_to_h5(setup: Setup, extract: Callable, filename: str) -> Callable:
    """A per-batch `extract(inputs) -> {name: tensor}`, written synchronously to h5py."""

    def case(out: Path) -> Path:
        path = out / filename
        sink = H5Sink(path, setup.batches.num_samples)
        for b in setup.base.batches:
            for n, t in extract(b.inputs).items():
                sink.write(n, b.start, t)
        sink.close()
        return path

    return case


def fx_extractor_h5py(setup: Setup) -> Callable:
    """torchvision's create_feature_extractor (FX graph, built once; nodes after the last requested
    one are pruned, so it skips the model's head) + synchronous h5py."""
    from torchvision.models.feature_extraction import create_feature_extractor

    fx = create_feature_extractor(setup.model, return_nodes={n: n for n in setup.names})

    def extract(x):
        with torch.inference_mode():
            return fx(x)

    return extracted_to_h5(setup, extract, "fx.h5")
