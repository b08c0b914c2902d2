"""Test helpers: real Hydra composition, real runs into tmp_path, real subprocess CLI calls."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import h5py

from probe.launch.run import run
from probe.testing.compose import QUIET, make_cfg

ROOT = Path(__file__).resolve().parent.parent


def run_probe(tmp_path: Path, *overrides: str):
    """Compose and run in-process; returns (RunResult, open h5py.File)."""
    result = run(make_cfg(*overrides), run_dir=tmp_path)
    return result, h5py.File(result.h5_path, "r")


def run_interrupted(run_dir: Path, at_call: int, *overrides: str) -> None:
    """A run of probe.testing.models.SignalsItself stopped by its own SIGINT at forward call
    `at_call` (the batches before it written), for a resume to continue."""
    import pytest

    from probe.launch.interrupt import Interrupted
    from probe.testing.models import SignalsItself

    SignalsItself.at_call = at_call
    try:
        with pytest.raises(Interrupted):
            run(make_cfg(*overrides), run_dir=run_dir)
    finally:
        SignalsItself.at_call = None


def counted(record, module_types: dict[str, str] | None = None):
    """`record` with each capture's statistics of the batch among its partials, as the
    statistics part takes them (probe.launch.parts.statistics), for a sink made by hand."""
    from probe.stats.backend import TorchStats
    from probe.stats.running import bounds_for

    reduce, types = TorchStats(), module_types or {}
    partials = record.outputs.folds.setdefault("statistics", {})
    for key, t in [*record.values.items(), *record.per_batch.items()]:
        axis = record.axes.get(key, 1)
        partials[key] = reduce(t, bounds_for(types.get(key[0], ""), key[1]), axis)
    return record


def sink_of(path: Path, store=None, statistics: bool = True, **file):
    """A Sink of `path` made by hand (the run's is probe.launch.run's), with the statistics'
    fold attached unless `statistics` is False; `file`: probe.store.sink.RunFile's fields."""
    from probe.plan import StoreSpec
    from probe.store.folds import StatsFold
    from probe.store.sink import RunFile, Sink

    sink = Sink(RunFile(Path(path), **file), store or StoreSpec())
    if statistics:
        sink.attach(StatsFold("run"))
    return sink


def cli(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 300):
    """`python -m probe ARGS` in a subprocess (`-m` first: Hydra's parser wants flags before overrides)."""
    flags = [a for a in args if a in ("-m", "--multirun")]
    args = (*flags, *QUIET, *(a for a in args if a not in flags))
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    full_env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [sys.executable, "-m", "probe", *args],
        cwd=cwd or ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_same_arrays(a: Path, b: Path) -> int:
    """Both files hold the same datasets, value for value (NaN equal to NaN); returns how many."""
    import numpy as np

    from probe.testing.arrays import h5_arrays

    left, right = h5_arrays(a), h5_arrays(b)
    assert sorted(left) == sorted(right)
    for name in left:
        assert left[name].dtype == right[name].dtype, name
        if name.endswith("/scalars"):  # float sums merged in another order: 1e-12
            np.testing.assert_allclose(left[name], right[name], rtol=1e-12, err_msg=name)
            continue
        np.testing.assert_array_equal(left[name], right[name], err_msg=name)
    return len(left)


def cloned_outputs(model, names: list[str], batches, autocast=None) -> dict:
    """{name: output over all batches} of a plain forward per batch of inputs (optionally under
    CPU autocast to `autocast`), seen by throwaway hooks that clone, so an in-place op after a
    module cannot change what was seen."""
    import torch

    seen: dict[str, list] = {n: [] for n in names}

    def keeper(name):
        return lambda module, args, output: seen[name].append(output.detach().float().clone())

    handles = [model.get_submodule(n).register_forward_hook(keeper(n)) for n in names]
    try:
        with torch.no_grad():
            for inputs in batches:
                with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                    model(inputs)
    finally:
        for h in handles:
            h.remove()
    return {n: torch.cat(v).numpy() for n, v in seen.items()}


def image_folder(root: Path, size: int = 4) -> Path:
    """Three classes of tiny PNGs of different sizes (from `size` pixels wide), one in a nested
    folder: an ImageFolder root."""
    from PIL import Image

    files = {"zebra": ["b.png", "a.png"], "ant": ["x.png"], "cat": ["one.png", "deep/two.png"]}
    for k, (cls, names) in enumerate(files.items()):
        for j, name in enumerate(names):
            path = root / cls / name
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (size + k + j, size + 1), (10 * k, 20 * j, 7)).save(path)
    return root


def hf(lm):
    """The causal LM saved in the `lm` fixture's folder, in eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(lm[0]).eval()


def padded(rows, pad, width):
    """The expectation, built by hand: right-padded rows and a 1/0 mask."""
    import torch

    ids = [r + [pad] * (width - len(r)) for r in rows]
    mask = [[1] * len(r) + [0] * (width - len(r)) for r in rows]
    return torch.tensor(ids), torch.tensor(mask)
