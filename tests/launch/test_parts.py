"""The run parts' seam: a part registered from here runs in a real run with no edit elsewhere;
its per-sample and per-batch outputs land in probe.h5 equal to a plain forward's, and its file
is written at the finish."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch
from torch import nn

import probe
from probe.hooks.step_context import StepContext
from probe.launch.parts import PARTS, register, unregister
from probe.launch.run_part import Finished, RunPart, RunSetup


class OutputNorms(RunPart):
    """Each sample's output norm (a row per sample), each batch's largest |output| (a row per
    batch), and how many batches it saw (a file at the finish)."""

    name = "output_norms"

    def __init__(self, selected: int) -> None:
        self.selected, self.batches = selected, 0

    @classmethod
    def prepare(cls, setup: RunSetup) -> OutputNorms:
        return cls(len(setup.selections))

    def after_forward(self, ctx: StepContext) -> None:
        out = ctx.output.detach()
        ctx.outputs.samples["output_norms/sample"] = out.norm(dim=1)
        ctx.outputs.batches["output_norms/batch"] = out.abs().amax().reshape(1, 1).cpu().numpy()
        self.batches += 1

    def finish(self, done: Finished) -> None:
        (done.run_dir / "output_norms.txt").write_text(f"{self.batches} {self.selected}\n")


@pytest.fixture
def registered():
    register(OutputNorms)
    try:
        yield
    finally:
        unregister(OutputNorms)


def test_a_registered_part_writes_what_a_plain_forward_gives(tmp_path, registered):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
    batches = [torch.randn(n, 4) for n in (3, 3, 2)]
    probes = {"all": {"layers": ["0", "2"], "capture": ["output"]}}
    probe.run(model, batches, probes, out=tmp_path, progress=False).close()
    with torch.no_grad():
        outs = [model(x) for x in batches]
    want_rows = torch.cat([o.norm(dim=1) for o in outs]).numpy()
    want_batches = np.array([[o.abs().max().item()] for o in outs], dtype=np.float32)
    with h5py.File(tmp_path / "probe.h5") as f:
        np.testing.assert_array_equal(f["output_norms/sample"][:], want_rows)
        np.testing.assert_array_equal(f["output_norms/batch"][:], want_batches)
        assert f["output_norms/batch"].attrs["per_batch"]
        # the run's own datasets beside it, as without the part
        np.testing.assert_array_equal(f["model/output"][:], torch.cat(outs).numpy())
    assert (tmp_path / "output_norms.txt").read_text() == "3 2\n"


def test_an_unregistered_part_is_gone_from_the_next_run(tmp_path):
    assert OutputNorms not in PARTS
    model = nn.Sequential(nn.Linear(4, 3)).eval()
    probe.run(model, [torch.randn(2, 4)], {"all": {"layers": ["0"]}}, out=tmp_path,
              progress=False).close()  # fmt: skip
    with h5py.File(tmp_path / "probe.h5") as f:
        assert "output_norms" not in f
    assert not (tmp_path / "output_norms.txt").exists()
