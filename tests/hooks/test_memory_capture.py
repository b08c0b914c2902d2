"""probe.capture: in-memory captures against plain hooks that clone and an independent autograd."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import probe
from probe.errors import ConfigError, ProbeError
from probe.testing.models import TinyLM, assert_no_hooks, registrations


def cloned(model, names, x):
    """{name: [output of each call]} seen by throwaway hooks that clone."""
    seen = {n: [] for n in names}
    handles = [
        model.get_submodule(n).register_forward_hook(
            lambda m, a, out, n=n: seen[n].append(out.detach().clone())
        )
        for n in names
    ]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return seen


def test_outputs_equal_cloning_hooks(resnet):
    x = torch.randn(2, 3, 32, 32)
    names = ["bn1", "layer1.0.relu", "layer1.0.conv1", "fc"]
    expected = cloned(resnet, names, x)
    with probe.capture(resnet, {"p": {"layers": names}}) as cap, torch.no_grad():
        resnet(x)
    assert set(cap.keys()) == {(n, "output") for n in names} | {("layer1.0.relu", "output@1")}
    for n in names:
        torch.testing.assert_close(cap[(n, "output")], expected[n][0], rtol=0, atol=0)
    # bn1 is followed by an in-place ReLU: the copy was taken before it
    assert (cap.get("bn1") < 0).any()
    torch.testing.assert_close(cap.get("layer1.0.relu", "output@1"), expected["layer1.0.relu"][1])
    assert_no_hooks(resnet)


def test_several_forwards_are_rows(resnet):
    x1, x2 = torch.randn(2, 3, 32, 32), torch.randn(3, 3, 32, 32)
    probes = {"p": {"layers": ["fc", "layer2.0.conv1"]}}
    with probe.capture(resnet, probes) as cap, torch.inference_mode():
        resnet(x1)
        resnet(x2)
    assert cap.forwards == 2 and [len(p) for p in cap.parts("fc")] == [2, 3]
    with torch.no_grad():
        plain = torch.cat([resnet(x1), resnet(x2)])
    torch.testing.assert_close(cap["fc"], plain)
    assert cap[("layer2.0.conv1", "output")].shape == (5, 128, 4, 4)


def test_reduce_and_dtype_as_in_a_run(resnet):
    x = torch.randn(2, 3, 32, 32)
    expected = cloned(resnet, ["layer1.0.conv1"], x)["layer1.0.conv1"][0]
    spec = {"layers": ["layer1.0.conv1"], "reduce": "spatial_mean", "dtype": "float16"}
    with probe.capture(resnet, {"p": spec}) as cap, torch.no_grad():
        resnet(x)
    got = cap.get("layer1.0.conv1")
    assert got.dtype == torch.float16 and got.shape == (2, 64)
    torch.testing.assert_close(got, expected.mean((2, 3)).half())


def test_token_mean_ignores_padding():
    torch.manual_seed(0)
    model = TinyLM(vocab=50, width=8).eval()
    ids = torch.randint(0, 50, (2, 5))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    spec = {"layers": ["embed"], "reduce": "token_mean"}
    with probe.capture(model, {"p": spec}) as cap, torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    h = model.embed(ids).detach()
    expected = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    torch.testing.assert_close(cap.get("embed"), expected)


def test_grad_output_equals_independent_autograd(resnet):
    x, target = torch.randn(2, 3, 32, 32), torch.tensor([3, 7])
    probes = {"g": {"layers": ["bn1", "layer1.0.conv1", "fc"], "capture": ["grad_output"]}}
    probes["w"] = {"layers": ["fc"], "capture": ["param_grad"]}
    with probe.capture(resnet, probes) as cap:
        loss = nn.functional.cross_entropy(resnet(x), target, reduction="sum")
        with pytest.raises(ProbeError, match="backward"):
            cap[("bn1", "grad_output")]  # recorded, not resolved yet
        cap.backward(loss)
    # independently: a copy without in-place ReLUs, its outputs kept with retain_grad
    twin = copy.deepcopy(resnet)
    for m in twin.modules():
        if isinstance(m, nn.ReLU):
            m.inplace = False
    kept = {}

    def keeper(name):
        def hook(module, args, output):
            output.retain_grad()
            kept[name] = output

        return hook

    for n in ("bn1", "layer1.0.conv1", "fc"):
        twin.get_submodule(n).register_forward_hook(keeper(n))
    nn.functional.cross_entropy(twin(x), target, reduction="sum").backward()
    for n in ("bn1", "layer1.0.conv1", "fc"):
        torch.testing.assert_close(cap[(n, "grad_output")], kept[n].grad)
    torch.testing.assert_close(cap[("fc", "param_grad.weight")][0], twin.fc.weight.grad)
    assert cap[("fc", "param_grad.bias")].shape == (1, 10)  # one row per forward
    assert resnet.fc.weight.grad is None  # autograd.grad leaves .grad alone
    assert_no_hooks(resnet)


def test_unresolved_gradients_are_an_error(resnet):
    x = torch.randn(2, 3, 32, 32)
    grads = {"g": {"layers": ["fc"], "capture": ["grad_output"]}}
    with pytest.raises(ProbeError, match=r"cap\.backward\(loss\)"), probe.capture(resnet, grads):
        resnet(x).sum().backward()  # a plain backward does not resolve them
    assert_no_hooks(resnet)
    with pytest.raises(ProbeError, match="never resolved"), probe.capture(resnet, grads) as cap:
        resnet(x)
        with pytest.raises(ProbeError, match="after each forward"):
            cap.backward(resnet(x).sum())
    assert_no_hooks(resnet)


def test_hooks_removed_after_an_exception(resnet):
    probes = {"p": {"layers": ["layer*"], "capture": ["input", "output"]}}
    with pytest.raises(RuntimeError, match="inside the block"), probe.capture(resnet, probes):
        resnet(torch.randn(2, 3, 32, 32))
        raise RuntimeError("inside the block")
    assert_no_hooks(resnet)
    probes = {"p": {"layers": ["*"], "capture": ["grad_input"]}}
    with pytest.raises(RuntimeError), probe.capture(resnet, probes):  # the forward fails half-way
        resnet(torch.randn(2, 5, 32, 32))
    assert_no_hooks(resnet)


@pytest.mark.parametrize("which", ["first", "last"])
def test_a_refused_registration_leaves_no_hook_and_the_next_capture_is_unchanged(resnet, which):
    """The capture's first hook refused, or probe.capture's own on the model (the last one)."""
    probes = {"p": {"layers": ["layer1.0.conv1", "fc"], "capture": ["input", "output"]}}
    x = torch.randn(2, 3, 32, 32)
    with registrations() as calls, probe.capture(resnet, probes):
        pass
    k = 1 if which == "first" else len(calls)
    refused = pytest.raises(RuntimeError, match=f"registration {k} refused")
    with registrations(refuse=k), refused, probe.capture(resnet, probes):
        pytest.fail("entered with a registration refused")
    assert_no_hooks(resnet)
    fresh = copy.deepcopy(resnet)
    with probe.capture(resnet, probes) as cap, torch.no_grad():
        resnet(x)
    with probe.capture(fresh, probes) as want, torch.no_grad():
        fresh(x)
    assert cap.keys() == want.keys() and len(cap) == 4
    for key in want:
        torch.testing.assert_close(cap[key], want[key], rtol=0, atol=0)


def test_unknown_key_names_it(resnet):
    with pytest.raises(ConfigError, match="layerz"):
        probe.capture(resnet, {"p": {"layerz": ["fc"]}})
    with pytest.raises(ConfigError, match="matches no module"):
        probe.capture(resnet, {"p": {"layers": ["no_such_layer"]}})
    with pytest.raises(KeyError, match="captured"):
        with probe.capture(resnet, "all_convs") as cap, torch.no_grad():
            resnet(torch.randn(2, 3, 32, 32))
        cap.get("fc")
