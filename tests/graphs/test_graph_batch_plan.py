"""The prompt copies a graph's backward passes carry when graph.batch_size is not given: the
memory plan's formula (probe.graphs.batch_plan) checked by hand arithmetic, the graph it gives
equal to the graph of one copy per backward, an explicit batch size winning; and a graph over a
model dispatched by accelerate (a device_map's hooks) equal to the plain model's."""

from __future__ import annotations

import pytest
import torch
import transformers

from probe.graphs import batch_plan
from probe.graphs.attribution import GraphOptions, attribute
from probe.graphs.batch_plan import DeviceShare, plan_batch
from probe.testing.random_transcoders import random_transcoders
from probe.testing.tiny_lms import TASK_CLASSES, make_tiny

CPU = torch.device("cpu")
GIB = 1 << 30
PROMPT = torch.tensor([3, 7, 12, 9, 20, 5, 14, 8, 2])


def test_the_planned_batch_is_the_formula_by_hand_for_two_prompt_lengths():
    # SmolLM2-135M's shape: 30 blocks, width 576, 9 heads, float32, sdpa; 20 GiB free on the CPU
    share = [DeviceShare(CPU, blocks=30, embeddings=True, free=20 * GIB)]
    # 2,048 tokens: a copy holds 4 tensors of 2048 x 576 floats per block and 8 outside them;
    # once: each block's q, k, v of one copy (3 x 2048 x 576 floats), and one block's pattern
    # while it is made again (the eager function's 3 matrices of 9 x 2048 x 2048 floats)
    per_copy = (4 * 30 + 8) * 2048 * 576 * 4  # 603,979,776 bytes
    once = 30 * 3 * 2048 * 576 * 4 + 3 * 9 * 2048 * 2048 * 4  # 877,658,112 bytes
    assert (10 * GIB - once) / per_copy == pytest.approx(16.325, abs=1e-3)
    plan = plan_batch(share, 2048, 576, 9, 4, eager=False)
    assert plan.batch == 16 and plan.per_copy == per_copy and plan.once == once
    # 256 tokens with 4 GiB free: (2 GiB - once) / per copy = 27.6
    small = [DeviceShare(CPU, blocks=30, embeddings=True, free=4 * GIB)]
    per_copy = (4 * 30 + 8) * 256 * 576 * 4
    once = 30 * 3 * 256 * 576 * 4 + 3 * 9 * 256 * 256 * 4
    assert (
        plan_batch(small, 256, 576, 9, 4, eager=False).batch == (2 * GIB - once) // per_copy == 27
    )
    # eager attention: each copy also makes one block's 3 score matrices
    per_copy += 3 * 9 * 256 * 256 * 4
    assert plan_batch(small, 256, 576, 9, 4, eager=True).batch == (2 * GIB - once) // per_copy == 25


def test_the_plan_is_capped_floored_and_takes_the_tightest_device():
    roomy = [DeviceShare(CPU, blocks=30, embeddings=True, free=20 * GIB)]
    assert plan_batch(roomy, 256, 576, 9, 4, eager=False).batch == batch_plan.MAX_BATCH
    assert plan_batch(roomy, 256, 576, 9, 4, eager=False, rows=12).batch == 12
    tight = [DeviceShare(CPU, blocks=30, embeddings=True, free=GIB)]
    plan = plan_batch(tight, 4096, 576, 9, 4, eager=False)
    assert plan.batch == 1 and "less than one copy fits" in plan.reason
    # two devices of 15 blocks each: the one holding the embeddings too, with less free, decides
    cuda = [torch.device("cuda", 0), torch.device("cuda", 1)]
    split = [DeviceShare(cuda[0], 15, True, 3 * GIB), DeviceShare(cuda[1], 15, False, 8 * GIB)]
    per_copy = (4 * 15 + 8) * 1024 * 576 * 4
    once = 15 * 3 * 1024 * 576 * 4 + 3 * 9 * 1024 * 1024 * 4
    plan = plan_batch(split, 1024, 576, 9, 4, eager=False)
    assert plan.batch == int((1.5 * GIB - once) // per_copy) == 8 and "cuda:0" in plan.reason
    unknown = [DeviceShare(torch.device("mps"), 30, True, None)]
    assert plan_batch(unknown, 256, 576, 9, 4, eager=False).batch == batch_plan.FALLBACK_BATCH


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = make_tiny("llama", tmp_path_factory.mktemp("llama"))
    return folder, getattr(transformers, TASK_CLASSES["llama"]).from_pretrained(folder).eval()


def dense(graph) -> torch.Tensor:
    return graph.adjacency.to_dense()


def test_the_planned_batch_gives_the_graph_of_one_copy_per_backward(llama, monkeypatch):
    _, model = llama
    ts = random_transcoders(model.config.hidden_size, model.config.num_hidden_layers, seed=4)
    config = model.config
    width, layers, n_pos = config.hidden_size, config.num_hidden_layers, len(PROMPT)
    per_copy = (4 * layers + 8) * n_pos * width * 4
    once = layers * 3 * n_pos * width * 4 + 3 * config.num_attention_heads * n_pos * n_pos * 4
    # free memory such that (half of it - once) holds 5.5 copies: the plan takes 5
    monkeypatch.setattr(batch_plan, "free_bytes", lambda device: int(2 * (once + 5.5 * per_copy)))
    options = {"floor": 0.0, "max_feature_nodes": 12, "update_interval": 1}
    planned = attribute(model, PROMPT, ts, GraphOptions(**options))
    one = attribute(model, PROMPT, ts, GraphOptions(batch_size=1, **options))
    assert planned.batch == 5 and one.batch == 1
    assert planned.n_features == one.n_features == 12  # (several backward passes of 5 rows)
    assert torch.equal(planned.features, one.features)  # (the same 12, ranked by influence)
    torch.testing.assert_close(dense(planned), dense(one), rtol=1e-5, atol=1e-6)
    given = attribute(model, PROMPT, ts, GraphOptions(batch_size=3, **options))  # given: it wins
    assert given.batch == 3
    torch.testing.assert_close(dense(given), dense(one), rtol=1e-5, atol=1e-6)


def test_a_model_dispatched_by_accelerate_gives_the_graph_of_the_plain_model(llama, tmp_path):
    accelerate = pytest.importorskip("accelerate")
    folder, model = llama
    ts = random_transcoders(model.config.hidden_size, model.config.num_hidden_layers, seed=4)
    options = GraphOptions(batch_size=16, floor=0.0, max_feature_nodes=20)
    plain = attribute(model, PROMPT, ts, options)
    # every block behind accelerate's AlignDevicesHook (a device_map's hooks), the second block's
    # weights offloaded to disk and brought in only for its forward
    sharded = getattr(transformers, TASK_CLASSES["llama"]).from_pretrained(folder).eval()
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}  # fmt: skip
    sharded = accelerate.dispatch_model(
        sharded, device_map, offload_dir=str(tmp_path / "offload"), force_hooks=True
    )
    assert hasattr(sharded.model.layers[0], "_hf_hook")
    graph = attribute(sharded, PROMPT, ts, options)
    torch.testing.assert_close(dense(graph), dense(plain), rtol=1e-5, atol=1e-6)
    assert torch.equal(graph.features, plain.features)
