"""`probe.sites(model, example=None, probes=None)`: a table of the modules a probe can name.

Layer globs are written against names one cannot see without printing the model; this table lists
every module with its class and parameters, and with an example input what each produced on its
first call and how often it ran (call k>0 is stored as `output@k`). With `probes` it says which
probe selects each module, by probe.hooks.module_select's own `select_modules`, so what it shows is what a run
hooks. `python -m probe.sites OVERRIDES` prints it for the model and data a run would use.

`probe.hooks.site_table` is this module, made callable, so `probe.sites(model)` works even once the module
is imported (an import sets the package's `sites` attribute to the module).
"""

from __future__ import annotations

import sys
from collections import Counter

import pandas as pd
import torch
from torch import nn

from probe.config import config_dir
from probe.errors import ModelError, ProbeError, SelectionError
from probe.hooks.forward import call, to_device
from probe.hooks.hookset import HookSet
from probe.hooks.module_select import select_modules
from probe.hooks.names import dataset_name, flatten
from probe.models.build import model_input
from probe.plan import probe_specs


def sites(model: nn.Module, example=None, probes=None) -> pd.DataFrame:
    """One row per module of `model.named_modules()` (the root is ''): `layer`, `type`, `params`
    (its own), `params_total` (with its children's), `leaf`. An `example` (a tensor, a tuple of
    positional arguments or a dict of keyword arguments) runs one forward under inference_mode
    (the model in the mode it is in) and adds `calls`, `input_shape` and `output_shape` (first
    call; a structured value as 'output.0: (2, 4); output.1: (2,)', the names a run stores).
    `probes` adds `probes`, the probes selecting each module; the table's `attrs['unmatched']`
    holds, per probe that selects nothing, the message a run would stop with."""
    modules = list(model.named_modules())
    table = pd.DataFrame(
        {
            "layer": [n for n, _ in modules],
            "type": [type(m).__name__ for _, m in modules],
            "params": [sum(p.numel() for p in m.parameters(recurse=False)) for _, m in modules],
            "params_total": [sum(p.numel() for p in m.parameters()) for _, m in modules],
            "leaf": [next(m.children(), None) is None for _, m in modules],
        }
    )
    if example is not None:
        calls, inputs, outputs = _trace(model, modules, example)
        table["calls"] = [calls[id(m)] for _, m in modules]
        table["input_shape"] = [inputs.get(id(m), "") for _, m in modules]
        table["output_shape"] = [outputs.get(id(m), "") for _, m in modules]
    table.attrs["unmatched"] = {}
    if probes is not None:
        chosen: dict[str, list[str]] = {}
        for name, spec in probe_specs(probes).items():
            try:
                selected = select_modules(model, {name: spec})
            except SelectionError as e:  # matches nothing: a run would stop; the table still helps
                table.attrs["unmatched"][name] = str(e)
                continue
            for sel in selected:
                chosen.setdefault(sel.name, []).append(name)
        table["probes"] = [",".join(chosen.get(n, [])) for n, _ in modules]
    return table


def _shapes(site: str, value) -> str:
    """'(2, 4, 8)' for one tensor, 'output.0: (2, 4); output.1: (2,)' for a structured value."""
    found = [(path, tuple(t.shape)) for path, t in flatten(value)]
    if len(found) == 1 and found[0][0] == "":
        return str(found[0][1])
    return "; ".join(f"{dataset_name(site, path, 0)}: {shape}" for path, shape in found)


def _trace(model: nn.Module, modules, example) -> tuple[Counter, dict, dict]:
    """Calls and first-call input/output shapes of every module in one forward of `example`,
    seen by temporary hooks (removed on any exit)."""
    calls: Counter = Counter()
    inputs: dict[int, str] = {}
    outputs: dict[int, str] = {}

    def before(module, args):
        calls[id(module)] += 1
        if id(module) not in inputs:  # positional tensors, named as hooks.py names them
            tensors = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
            if len(args) == 1 and tensors:
                inputs[id(module)] = str(tuple(args[0].shape))
            else:
                inputs[id(module)] = "; ".join(f"input.{i}: {tuple(a.shape)}" for i, a in tensors)

    def after(module, args, output):
        outputs.setdefault(id(module), _shapes("output", output))

    training = model.training  # eval for the trace: a batch norm must not update its buffers
    try:
        with HookSet("probe.sites") as hooks:
            for name, m in modules:
                hooks.forward_pre(m, before, name=name)
                hooks.forward(m, after, name=name)
            with torch.inference_mode():
                _forward(model.eval(), example)
    finally:
        model.train(training)
    return calls, inputs, outputs


def _forward(model: nn.Module, example):
    """model(example), model(*example) or model(**example) with the inputs on the model's device;
    a token batch (a dict with `input_ids`) goes through probe.hooks.forward.call, as in a run."""
    device = next((t.device for t in [*model.parameters(), *model.buffers()]), "cpu")
    if isinstance(example, dict) and "input_ids" in example:
        return call(model, to_device(model, example, device))
    try:
        if isinstance(example, dict):
            return model(**{k: _moved(model, v, device) for k, v in example.items()})
        if isinstance(example, list | tuple):
            return model(*(_moved(model, v, device) for v in example))
        return model(_moved(model, example, device))
    except ProbeError:
        raise
    except Exception as e:
        raise ModelError(
            f"the model's forward on the example raised {type(e).__name__}: {e}"
        ) from e


def _moved(model: nn.Module, value, device):
    return model_input(model, value, device) if isinstance(value, torch.Tensor) else value


def main(argv: list[str] | None = None, notes=None) -> int:
    """`python -m probe.sites [OVERRIDES]`: the table for the model, first batch and probes the
    same overrides give `python -m probe` (no run directory is made); `notes(model, inputs)`
    gives lines printed after it (the entry point's: the component graph's counts)."""
    argv = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(argv):
        print(
            "usage: python -m probe.sites [KEY=VALUE ...]  (the overrides of python -m probe, "
            "e.g. model=resnet18 probes=all_convs dataset.image_size=32)"
        )
        return 0
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from probe.data.batches import build_batches
    from probe.models.build import build_model
    from probe.plan import parse

    try:
        with initialize_config_dir(version_base="1.3", config_dir=config_dir()):
            plan = parse(compose("config", overrides=argv))
        seed = plan.options.seed
        torch.manual_seed(seed)
        model = build_model(plan.model, seed)
        data = _example_data(plan.data, model)
        batch = next(iter(build_batches(data, plan.model, seed, model)))
        table = sites(model, batch.inputs, plan.probes)
        lines = notes(model, batch.inputs) if notes is not None else []
    except (ProbeError, OmegaConfBaseException, HydraException) as e:
        message = str(e).split("Config search path:")[0].strip() or type(e).__name__
        print(f"probe.sites: error: {message}", file=sys.stderr)
        return 2
    with pd.option_context("display.width", 250, "display.max_colwidth", 120):
        print(table.to_string(index=False))
    for line in lines:
        print(line)
    for name, message in table.attrs["unmatched"].items():
        print(f"probe.sites: note: probe {name!r} selects nothing: {message}", file=sys.stderr)
    return 0


def _example_data(data, model: nn.Module):
    """The dataset whose first batch is the example: the plan's, except that a token model (one
    with a vocabulary) given image data (dataset=synthetic, the default) gets random token ids
    of its vocabulary (dataset=random_tokens), as `python -m probe.sites model=gpt2` means."""
    import dataclasses

    from probe.config import TOKEN_DATASETS
    from probe.models.hub import vocab_size

    vocabulary = vocab_size(model)
    if data.name in (*TOKEN_DATASETS, "pairs") or vocabulary is None:
        return data
    print(
        f"probe.sites: note: {type(model).__name__} takes token ids; the example is a batch of "
        f"dataset=random_tokens ({data.batch_size} x {data.seq_len} ids below {vocabulary}), "
        f"not dataset={data.name}",
        file=sys.stderr,
    )
    return dataclasses.replace(data, name="random_tokens")


if __name__ == "__main__":
    sys.exit(main())
