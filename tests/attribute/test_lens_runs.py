"""Lens and DLA runs as every run is used: a sweep whose tables summarize gathers, the Python
API on the caller's batches, a stopped run resumed, and the figures drawn from the file."""

from __future__ import annotations

import os
import signal

import numpy as np
import pandas as pd
import pytest

import probe
from probe.launch.interrupt import Interrupted
from tests.attribute.test_attribution_tables import cli_summarize
from tests.helpers import cli, run_probe


def pairs_args(lm, *extra):
    model, path, _ = lm
    return ["model=hf", f"model.name={model}", "model.task=causal_lm", "dataset=pairs",
            f"dataset.path={path}", "dataset.batch_size=2", "probes=none", *extra]  # fmt: skip


def test_a_sweep_gathers_lens_and_dla_tables(tmp_path, lm):
    out = cli("-m", *pairs_args(lm), "lens=logit,dla", f"hydra.sweep.dir={tmp_path}")
    assert out.returncode == 0, out.stderr[-2000:]
    assert cli_summarize(tmp_path).returncode == 0
    for name, job, lens in (("lens", "0", "logit"), ("dla", "1", "dla")):
        gathered = pd.read_csv(tmp_path / f"{name}.csv", dtype={"run": str})
        own = pd.read_csv(tmp_path / job / f"{name}.csv")
        assert set(gathered.run) == {job} and (gathered["lens"] == lens).all()
        pd.testing.assert_frame_equal(gathered[own.columns].reset_index(drop=True), own)


def test_the_python_api_runs_a_lens_on_the_callers_batches(tmp_path, lm):
    from transformers import AutoModelForCausalLM

    _, path, pairs = lm
    run_probe(tmp_path / "cli", *pairs_args(lm, "lens=logit"))
    model = AutoModelForCausalLM.from_pretrained(lm[0]).eval()
    batches = [{"input_ids": ids} for ids in pairs["clean_ids"].split(2)]
    api = probe.run(model, batches, {}, out=tmp_path / "api", lens="logit")
    with api, probe.open_run(tmp_path / "cli") as cli_run:
        for name in ("kl", "entropy", "next_ce", "top1_prob"):
            np.testing.assert_allclose(
                api.file[f"lens/{name}"][:], cli_run.file[f"lens/{name}"][:], rtol=1e-6
            )
    assert pd.read_csv(tmp_path / "api" / "lens.csv")["kl"].iloc[-1] == pytest.approx(0, abs=1e-6)


def test_a_stopped_lens_run_resumes_to_the_uninterrupted_file(tmp_path, lm):
    from transformers import AutoModelForCausalLM

    from tests.helpers import assert_same_arrays

    _, _, pairs = lm
    batches = [{"input_ids": ids} for ids in pairs["clean_ids"].split(2)]
    model = AutoModelForCausalLM.from_pretrained(lm[0]).eval()
    reference = probe.run(model, batches, {}, out=tmp_path / "reference", lens="logit")
    calls = [0]

    def stop(module, args, output):
        calls[0] += 1
        if calls[0] == 2:
            os.kill(os.getpid(), signal.SIGINT)

    handle = model.register_forward_hook(stop)
    try:
        with pytest.raises(Interrupted):
            probe.run(model, batches, {}, out=tmp_path / "run", lens="logit")
    finally:
        handle.remove()
    resumed = probe.run(model, batches, {}, out=tmp_path / "run", lens="logit", resume=True)
    assert assert_same_arrays(reference.h5_path, resumed.h5_path) >= 8
    pd.testing.assert_frame_equal(
        pd.read_csv(tmp_path / "run" / "lens.csv"), pd.read_csv(tmp_path / "reference" / "lens.csv")
    )


def test_the_lens_and_dla_figures_draw_the_stored_values(tmp_path, lm):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from probe.report.figures import figures

    run_probe(tmp_path / "lens", *pairs_args(lm, "lens=logit"))
    run_probe(tmp_path / "dla", *pairs_args(lm, "lens=dla"))
    _, drawn = figures(tmp_path / "lens")
    with probe.open_run(tmp_path / "lens") as run:
        image = drawn["lens_positions.png"].axes[0].get_images()[0]
        np.testing.assert_allclose(image.get_array(), run.file["lens/top1_prob_positions"][0])
    _, drawn = figures(tmp_path / "dla")
    table = pd.read_csv(tmp_path / "dla" / "dla.csv")
    heads = table[table.component == "attn_head"]
    want = heads.pivot_table(index="layer", columns="head", values="mean").to_numpy()
    got = drawn["dla.png"].axes[0].get_images()[0].get_array()
    np.testing.assert_allclose(got, want)
    plt.close("all")
