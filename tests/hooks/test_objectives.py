"""The objectives attribution explains, checked through the gradient they put on the logits:
d(objective)/d(logits) is a one-hot for a logit, one-hot minus softmax for a log-probability, and
+-1 over the answer and wrong tokens at the read position for a logit difference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers import run_probe

LOGITS = [
    "model=resnet18", "model.num_classes=10", "dataset.image_size=32", "dataset.num_samples=5",
    "dataset.batch_size=2", "probes=all_linear", "probes.linear.capture=[output,grad_output]",
]  # fmt: skip


@pytest.mark.parametrize("index", ["target", "predicted", "4"])
def test_a_logits_gradient_is_a_one_hot_of_its_index(tmp_path, index):
    _, f = run_probe(tmp_path, *LOGITS, "objective=logit", f"objective.index={index}")
    logits, grad = f["layers/fc/output"][:], f["layers/fc/grad_output"][:]
    want = {"target": f["samples/target"][:], "predicted": logits.argmax(1)}.get(
        index, np.full(len(logits), 4)
    )
    np.testing.assert_array_equal(grad, np.eye(10, dtype=np.float32)[want])


def test_a_log_probabilitys_gradient_is_one_hot_minus_softmax(tmp_path):
    _, f = run_probe(tmp_path, *LOGITS, "objective=logprob", "objective.index=target")
    logits = torch.from_numpy(f["layers/fc/output"][:])
    want = torch.eye(10)[f["samples/target"][:]] - logits.softmax(1)
    np.testing.assert_allclose(f["layers/fc/grad_output"][:], want.numpy(), atol=1e-6)


def test_objective_logit_diff_equals_the_metric(tmp_path, lm, cli_in_process):
    """Answer minus wrong logit at the last position of each pair's own input: its gradient on
    lm_head's output is +1 at the answer and -1 at the wrong token there, 0 elsewhere."""
    model, path, pairs = lm
    args = ["model=hf", f"model.name={model}", "model.task=causal_lm", "dataset=pairs",
            f"dataset.path={path}", "dataset.batch_size=2", "+probes.head.layers=[lm_head]",
            "+probes.head.capture=[grad_output]", "probes=none", "objective=logit_diff"]  # fmt: skip
    _, f = run_probe(tmp_path, *args)
    grad = f["layers/lm_head/grad_output"][:]
    want = np.zeros_like(grad)
    rows = np.arange(len(grad))
    want[rows, -1, pairs["answer"].numpy()] += 1
    want[rows, -1, pairs["wrong"].numpy()] -= 1
    np.testing.assert_array_equal(grad, want)
    out = cli_in_process(*args[:3], "dataset=random_tokens", "dataset.num_samples=2", *args[6:],
                         f"hydra.run.dir={tmp_path / 'no-answers'}")  # fmt: skip
    assert out.returncode == 2 and "objective=logit_diff reads each sample's answer" in out.stderr
