"""stats.during: statistics folded in the run (the default), computed from the stored rows when
the file closes, or not at all (readers compute them from the rows). Each is compared with the
default run of the same config."""

from __future__ import annotations

import h5py
import numpy as np
import pandas as pd
import pytest

import probe
from probe.launch.run import run
from probe.testing.arrays import h5_arrays
from probe.testing.compose import make_cfg
from tests.helpers import assert_same_arrays, run_interrupted
from tests.store.test_interrupts import SLOW


def images(small_resnet) -> list[str]:
    return [*small_resnet, "probes=all_convs", "probes.convs.layers=[conv1,layer2.*]"]


def tokens(tiny_gpt2) -> list[str]:
    model, tok = tiny_gpt2
    return [
        "model=hf", f"model.name={model}", "model.task=causal_lm", "dataset=random_tokens",
        "dataset.num_samples=5",
        "dataset.batch_size=2", "dataset.seq_len=6", "probes=residual",
        "probes.residual.capture=[output,grad_output]", "objective=lm_loss",
    ]  # fmt: skip


def summaries_equal(a: pd.DataFrame, b: pd.DataFrame) -> None:
    pd.testing.assert_frame_equal(a, b, check_exact=False, rtol=1e-12, atol=0)


@pytest.mark.parametrize("kind", ["images", "tokens"])
def test_close_gives_the_statistics_and_summary_of_run(tmp_path, kind, small_resnet, tiny_gpt2):
    args = images(small_resnet) if kind == "images" else tokens(tiny_gpt2)
    during = run(make_cfg(*args), run_dir=tmp_path / "run")
    closed = run(make_cfg(*args, "stats.during=close"), run_dir=tmp_path / "close")
    assert assert_same_arrays(during.h5_path, closed.h5_path) >= 6  # /stats included
    summaries_equal(*(pd.read_csv(r.run_dir / "summary.csv") for r in (closed, during)))


def test_none_leaves_rows_every_reader_opens(tmp_path, small_resnet):
    """No /stats and no summary.csv; the rows equal the default run's, open_run, summarize and
    plain h5py read them, and the statistics they compute from the rows equal the run's."""
    args = images(small_resnet)
    during = run(make_cfg(*args), run_dir=tmp_path / "run")
    bare = run(make_cfg(*args, "stats.during=none"), run_dir=tmp_path / "none")
    assert not (bare.run_dir / "summary.csv").exists()
    with h5py.File(bare.h5_path) as f:
        assert "stats" not in f and f.attrs["complete"]
    left, right = h5_arrays(during.h5_path), h5_arrays(bare.h5_path)
    layers = [n for n in left if n.startswith("layers/")]
    assert layers and sorted(n for n in right if n.startswith("layers/")) == layers
    for name in layers:
        np.testing.assert_array_equal(left[name], right[name])
    with probe.open_run(bare.run_dir) as r:
        summaries_equal(r.summary, pd.read_csv(during.run_dir / "summary.csv"))
        stats = r.stats("conv1")
        want = left["layers/conv1/output"].astype(np.float64)
        assert (stats.n, stats.min, stats.max) == (want.size, want.min(), want.max())
        np.testing.assert_allclose(stats.mean, want.mean(), rtol=1e-12)
    summaries_equal(
        *(pd.read_csv(d / "summary.csv") for d in (_summarize(bare.run_dir), during.run_dir))
    )


def _summarize(run_dir):
    import subprocess
    import sys

    from tests.helpers import ROOT

    done = subprocess.run(
        [sys.executable, "-m", "probe.summarize", str(run_dir)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return run_dir


def test_a_stopped_close_run_resumes_to_the_uninterrupted_statistics(tmp_path):
    """A SIGINT in the 3rd forward stops the run; the stopped file's statistics are those of its
    rows, and the resumed file equals the uninterrupted one, /stats included."""
    args = [*SLOW[:-2], "dataset.num_samples=10", "dataset.batch_size=3", "stats.during=close"]
    args[1] = "model._target_=probe.testing.models.SignalsItself"
    reference = run(make_cfg(*args), run_dir=tmp_path / "reference")
    run_interrupted(tmp_path / "run", 2, *args)
    with probe.open_run(tmp_path / "run") as r:
        conv = next(k for k in r.keys if k[1] == "output")
        rows = np.asarray(r.array(*conv)).astype(np.float64)
        assert len(rows) == 9 and r.stats(*conv).n == rows.size
    result = run(make_cfg(*args, "resume=true"), run_dir=tmp_path / "run")
    assert assert_same_arrays(reference.h5_path, result.h5_path) >= 6


def test_deferred_statistics_need_stored_rows(tmp_path, small_resnet, cli_in_process):
    out = cli_in_process(
        *small_resnet, "store=stats", "stats.during=close", f"hydra.run.dir={tmp_path}"
    )
    assert out.returncode == 2
    assert "stats.during=close needs store.mode=full" in out.stderr
