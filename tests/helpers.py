"""Test helpers: real Hydra composition, real runs into tmp_path, real subprocess CLI calls."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import h5py
from hydra import compose, initialize_config_dir

from probe.config import config_dir
from probe.launch.run import run

ROOT = Path(__file__).resolve().parent.parent
QUIET = ["print_summary=false", "progress=false"]


def make_cfg(*overrides: str):
    with initialize_config_dir(version_base="1.3", config_dir=config_dir()):
        return compose("config", overrides=[*QUIET, *overrides])


def run_probe(tmp_path: Path, *overrides: str):
    """Compose and run in-process; returns (RunResult, open h5py.File)."""
    result = run(make_cfg(*overrides), run_dir=tmp_path)
    return result, h5py.File(result.h5_path, "r")


def run_interrupted(run_dir: Path, at_call: int, *overrides: str) -> None:
    """A run of tests.models_for_tests.SignalsItself stopped by its own SIGINT at forward call
    `at_call` (the batches before it written), for a resume to continue."""
    import pytest

    from probe.launch.interrupt import Interrupted
    from tests.models_for_tests import SignalsItself

    SignalsItself.at_call = at_call
    try:
        with pytest.raises(Interrupted):
            run(make_cfg(*overrides), run_dir=run_dir)
    finally:
        SignalsItself.at_call = None


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


def file_arrays(f: h5py.File) -> dict:
    """Every captured or per-sample dataset of an open run file by its path (virtual ones read
    through their sources), and its statistics decoded from /stats (the slot layout, which
    depends on how many flushes wrote it, is left out), under stats/<layer>/<site>/..."""
    import numpy as np

    from probe.stats.running import SCALARS, occupied
    from probe.store import stats_file
    from probe.store.fileformat import is_scale

    arrays = {}

    def take(name, obj):
        plain = name == "sample" or not is_scale(obj)
        own_slots = name[:6] in ("stats/", "topk/")  # (decoded below: which slot is the file's)
        if isinstance(obj, h5py.Dataset) and plain and name != "progress" and not own_slots:
            arrays[name] = obj[()]

    f.visititems(take)
    for (layer, site), info in stats_file.read(f).items():
        s, at = info.stats, f"stats/{layer}/{site}"
        arrays[f"{at}/scalars"] = np.array([getattr(s, k) for k in SCALARS], dtype=np.float64)
        arrays[f"{at}/hist"] = occupied(s.hist.counts, False)
        if s.units is not None:
            arrays[f"{at}/units"] = s.units.packed()
        for kind, (values, keys) in (info.topk.kinds if info.topk is not None else {}).items():
            arrays[f"topk/{layer}/{site}/{kind}"] = np.stack([values, keys.astype(np.float64)])
    return arrays


def h5_arrays(path: Path) -> dict:
    """`file_arrays` of the file at `path`."""
    from probe.store.runfile import open_probe_file

    with open_probe_file(path, ours_only=False) as f:
        return file_arrays(f)


def assert_same_arrays(a: Path, b: Path) -> int:
    """Both files hold the same datasets, value for value (NaN equal to NaN); returns how many."""
    import numpy as np

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
