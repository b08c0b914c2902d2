"""HookSet against torch's own hook dicts: every kind registers and goes, all or none, on any exit,
level by level; and no module of probe/ registers a hook anywhere else."""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.modules import module as module_globals

from probe.hooks.hookset import HookSet
from probe.testing.models import assert_no_hooks, registrations

ROOT = Path(__file__).resolve().parents[2]


def small():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def counter(fired: Counter, kind: str):
    def hook(*args, **kwargs):
        fired[kind] += 1

    return hook


def hang_every_kind(hooks: HookSet, model, optimizer, h, node, fired: Counter) -> None:
    """One hook of every kind: on model[0], every module, the tensor h, model[0].weight,
    the autograd node `node` and the optimizer."""
    first = model[0]
    hooks.forward(first, counter(fired, "forward"), name="0")
    hooks.forward(first, counter(fired, "forward_kwargs"), name="0", with_kwargs=True,
                  always_call=True, prepend=True)  # fmt: skip
    hooks.forward_pre(first, counter(fired, "forward_pre"), name="0")
    hooks.forward_pre(first, counter(fired, "forward_pre_kwargs"), name="0", with_kwargs=True)
    hooks.full_backward(first, counter(fired, "full_backward"), name="0")
    hooks.full_backward_pre(first, counter(fired, "full_backward_pre"), name="0")
    hooks.forward(None, counter(fired, "global_forward"))
    hooks.forward_pre(None, counter(fired, "global_forward_pre"))
    hooks.full_backward(None, counter(fired, "global_full_backward"))
    hooks.full_backward_pre(None, counter(fired, "global_full_backward_pre"))
    hooks.tensor(h, counter(fired, "tensor"), name="h")
    hooks.post_accumulate_grad(first.weight, counter(fired, "post_accumulate_grad"))
    hooks.node(node, counter(fired, "node"))
    hooks.node(node, counter(fired, "node_pre"), pre=True)
    hooks.optimizer_step_pre(optimizer, counter(fired, "optimizer_step_pre"))
    hooks.optimizer_step_post(optimizer, counter(fired, "optimizer_step_post"))


KINDS = {"forward", "forward_kwargs", "forward_pre", "forward_pre_kwargs", "full_backward",
         "full_backward_pre", "global_forward", "global_forward_pre", "global_full_backward",
         "global_full_backward_pre", "tensor", "post_accumulate_grad", "node", "node_pre",
         "optimizer_step_pre", "optimizer_step_post"}  # fmt: skip


def step(model, optimizer, x):
    """A forward, a backward through its intermediate h and an optimizer step; (h, loss)."""
    h = model[0](x)
    loss = model[2](model[1](h)).square().sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return h, loss


def test_every_kind_fires_inside_and_is_gone_from_torchs_dicts_after():
    model, x = small(), torch.randn(5, 3, requires_grad=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    fired = Counter()
    with HookSet("every kind") as hooks:
        h = model[0](x)
        loss = model[2](model[1](h)).square().sum()
        hang_every_kind(hooks, model, optimizer, h, loss.grad_fn, fired)
        first = model[0]
        held = (first._forward_hooks, first._forward_pre_hooks, first._backward_hooks,
                first._backward_pre_hooks, first._forward_hooks_with_kwargs,
                first._forward_hooks_always_called, first._forward_pre_hooks_with_kwargs,
                module_globals._global_forward_hooks, module_globals._global_forward_pre_hooks,
                module_globals._global_backward_hooks, module_globals._global_backward_pre_hooks,
                h._backward_hooks, first.weight._post_accumulate_grad_hooks,
                optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks)  # fmt: skip
        assert all(held) and len(hooks) == len(KINDS)
        assert [len(d) for d in held[:2]] == [2, 2]
        loss.backward()  # tensor, node and node_pre fire here
        optimizer.step()
        step(model, optimizer, x)  # every module and optimizer kind
        assert set(fired) == KINDS
    assert not any(held) and len(hooks) == 0
    assert_no_hooks(model)
    # the node and tensor of a graph kept from inside: their hooks no longer fire
    fired.clear()
    with HookSet("node") as hooks:
        h = model[0](x)
        loss = model[2](model[1](h)).sum()
        hooks.node(loss.grad_fn, counter(fired, "node"))
        hooks.node(loss.grad_fn, counter(fired, "node_pre"), pre=True)
        hooks.tensor(h, counter(fired, "tensor"))
    loss.backward()
    step(model, optimizer, x)
    assert not fired and not h._backward_hooks


def test_a_global_hook_refuses_options_torch_lacks_for_it():
    hooks = HookSet()
    with pytest.raises(TypeError, match="global forward_pre hook .* takes no prepend, with_kwargs"):
        hooks.forward_pre(None, print, prepend=True, with_kwargs=True)
    with pytest.raises(TypeError, match="takes no prepend"):
        hooks.full_backward(None, print, prepend=True)
    assert len(hooks) == 0 and not module_globals._global_forward_pre_hooks


@pytest.mark.parametrize("k", [1, 3])
def test_a_failed_registration_removes_its_level_and_leaves_the_outer_one(k):
    model, x = small(), torch.randn(2, 3)
    fired = Counter()
    hooks = HookSet("levels")
    with hooks:
        hooks.forward(model[2], counter(fired, "outer"))
        refused = pytest.raises(RuntimeError, match=f"registration {k}")
        with registrations(refuse=k), refused, hooks:
            for i in range(4):  # the k-th of these is refused
                hooks.forward_pre(model[i % 3], counter(fired, "inner"))
        assert hooks.level == 1 and hooks.targets() == ["Linear"]
        assert not model[0]._forward_pre_hooks and not model[1]._forward_pre_hooks
        model(x)
        assert fired == {"outer": 1}
    assert_no_hooks(model)
    # outside any `with`: a failure takes every hook of the set
    hooks.forward(model[0], counter(fired, "loose"))
    with registrations(refuse=2), pytest.raises(RuntimeError, match="registration 2"):
        hooks.forward(model[1], counter(fired, "loose"))
        hooks.forward(model[2], counter(fired, "loose"))
    assert len(hooks) == 0
    assert_no_hooks(model)


def test_a_failed_registration_keeps_its_error_when_a_removal_also_fails():
    model = small()
    hooks = HookSet("two failures")
    with hooks:
        handle = hooks.forward(model[0], print)
        handle.remove = lambda: (_ for _ in ()).throw(OSError("removal failed"))
        with registrations(refuse=1), pytest.raises(RuntimeError, match="refused") as raised:
            hooks.forward(model[1], print)
        assert "removal failed" in "".join(raised.value.__notes__)
    assert hooks.level == 0


def hooked_forwards(hooks: HookSet, model, x):
    with hooks:
        hooks.forward(model[0], lambda m, a, o: None)
        hooks.forward_pre(model[2], lambda m, a: None)
        while True:
            yield model(x)


@pytest.mark.parametrize("exit", ["exception", "KeyboardInterrupt", "generator close"])
def test_every_way_out_removes_the_hooks(exit):
    model, x = small(), torch.randn(2, 3)
    hooks = HookSet("ways out")
    if exit == "generator close":
        forwards = hooked_forwards(hooks, model, x)
        next(forwards)
        assert model[0]._forward_hooks and model[2]._forward_pre_hooks
        forwards.close()
    else:
        error = ValueError if exit == "exception" else KeyboardInterrupt
        with pytest.raises(error), hooks:
            hooks.forward(model[0], lambda m, a, o: None)
            hooks.forward_pre(model[2], lambda m, a: None)
            model(x)
            raise error("inside the block")
    assert len(hooks) == 0 and hooks.level == 0
    assert_no_hooks(model)


def test_an_inner_level_goes_with_its_block_and_the_outer_one_keeps_firing():
    model, x = small(), torch.randn(2, 3)
    seen = []
    hooks = HookSet("nested")
    with hooks:
        hooks.forward(model[0], lambda m, a, o: seen.append("outer"))
        with hooks:
            hooks.forward(model[0], lambda m, a, o: seen.append("inner"))
            hooks.forward_pre(model[2], lambda m, a: seen.append("inner pre"))
            assert hooks.level == 2 and len(hooks) == 3
            model(x)
        assert seen == ["outer", "inner", "inner pre"]
        assert hooks.level == 1 and len(model[0]._forward_hooks) == 1
        assert not model[2]._forward_pre_hooks
        model(x)
        assert seen[3:] == ["outer"]
    assert_no_hooks(model)
    model(x)
    assert len(seen) == 4


def test_tensor_hooks_of_finished_graphs_are_forgotten():
    """A set held across many forwards holds the hooks of live graphs only."""
    model, x = small(), torch.randn(2, 3)
    with HookSet("per forward") as hooks:
        hooks.forward(model[0], lambda m, a, o: None)
        for _ in range(5):
            h = model[0](x)
            hooks.tensor(h, lambda g: None)
            model[2](model[1](h)).sum().backward()
        assert hooks.kinds() == {"forward": 1, "tensor": 1}
    assert_no_hooks(model, h)


def test_repr_names_the_label_kinds_targets_and_level():
    model = small()
    hooks = HookSet("capture")
    assert repr(hooks) == "<HookSet 'capture': no hooks; level 0>"
    with hooks:
        for i in range(6):
            hooks.forward(model[i % 3], print, name=f"layer{i}")
        hooks.forward_pre(model[0], print, name="layer0")
        assert repr(hooks) == (
            "<HookSet 'capture': 7 hooks (6 forward, 1 forward_pre) on layer0, layer1, layer2, "
            "layer3, ... 2 more; level 1>"
        )
        assert hooks.targets("forward_pre") == ["layer0"] and bool(hooks)
    assert repr(hooks) == "<HookSet 'capture': no hooks; level 0>"


# -- no hook registered outside the owner --------------------------------------------------------
REGISTERS = re.compile(r"^(register_\w*hook|register_prehook)$")
OWNER = ROOT / "probe" / "hooks" / "hookset.py"


def registrations_in(source: str) -> list[int]:
    """Lines that register a hook: a call of `register_*hook`/`register_hook`/`register_prehook`
    (a method or a name), such a name imported, or spelled as a string in a call
    (`getattr(m, "register_forward_hook")`). Comments and docstrings are not code."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            spelled = [a.value for a in node.args if isinstance(a, ast.Constant)]
            names = [name, *(s for s in spelled if isinstance(s, str))]
            if any(REGISTERS.match(n) for n in names):
                found.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and any(REGISTERS.match(a.name) for a in node.names):
            found.append(node.lineno)
    return sorted(found)


def test_the_scan_finds_registrations_and_not_their_mentions():
    source = '''
"""Docs may say module.register_forward_hook(fn)."""
from torch.nn.modules.module import register_module_forward_hook
# m.register_forward_pre_hook(fn) in a comment
def f(m, t, node):
    """t.register_hook(fn) in a docstring"""
    m.register_forward_hook(fn)
    t.register_hook(fn)
    node.register_prehook(fn)
    register_module_forward_hook(fn)
    getattr(m, "register_full_backward_hook")(fn)
    m.registered_hooks()
'''
    assert registrations_in(source) == [3, 7, 8, 9, 10, 11]


def test_no_module_of_probe_registers_a_hook_but_the_hook_owner():
    found = {}
    for path in sorted((ROOT / "probe").rglob("*.py")):
        lines = registrations_in(path.read_text())
        if lines and path != OWNER:
            found[str(path.relative_to(ROOT))] = lines
    assert not found, f"hooks registered outside probe/hooks/hookset.py (use a HookSet): {found}"
    assert registrations_in(OWNER.read_text())  # (the scan sees the owner's own)
