"""Why probe.watch refuses torch.compile'd models, and what watching eagerly costs instead: the
same training eager and compiled, unwatched, with hooks on the watch's modules, and watched,
side by side in interleaved rounds of one process, as ratios to the eager step.

The training: the tests' small CNN (width 16) on seeded random images, SGD with momentum.
The hooks: a forward pre-hook and a forward hook on each of conv1, relu, layer1 (a block),
layer2.conv and fc, counting their calls, left out of the graphs (`torch.compiler.disable`, as
the watch's must be: its statistics are not traceable). For each compiled variant (inductor's
caches off): the first call's time (the compile), the graphs and graph breaks dynamo made,
the hook calls in a compiled step against an eager one (fewer: hooks the compiled code
skipped). Watched eagerly: the same modules' output, grad_output and parameters (param,
param_grad, param_update).

    python scripts/bench_watch_compile.py [--size 16] [--batch 64] [--steps 20] [--threads 2]
                                          [--rounds 3] [--backend inductor]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=16)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F
    from torch._dynamo.utils import counters

    import probe
    from probe.hooks.hookset import HookSet
    from probe.testing.trainings import SmallCNN

    torch.set_num_threads(args.threads)
    torch._inductor.config.fx_graph_cache = False  # (a compile from scratch each time)
    torch._functorch.config.enable_autograd_cache = False
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(args.batch, 3, args.size, args.size, generator=g),
             torch.randint(0, 4, (args.batch,), generator=g)) for _ in range(args.steps)]  # fmt: skip
    watched = ["conv1", "relu", "layer1", "layer2.conv", "fc"]
    probes = {"net": {"layers": watched, "capture": [
        "output", "grad_output", "param", "param_grad", "param_update"]}}  # fmt: skip

    class Hooked(SmallCNN):
        """The same network, its own forward's code: dynamo caches compiled code by the code
        object and (inlining the modules) guards neither the instance nor its hooks, so a
        second SmallCNN would run the first one's compiled code, hooks or not."""

        def forward(self, x):
            return super().forward(x)

    def make(cls=SmallCNN):
        torch.manual_seed(0)
        model = cls(width=16)
        return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def steps(run, opt) -> list[float]:
        times = []
        for x, y in data:
            start = time.perf_counter()
            opt.zero_grad()
            loss = F.cross_entropy(run(x), y)
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - start)
        return times

    calls = [0]

    def hooked(model) -> HookSet:
        hooks = HookSet("bench: hooks left out of the graphs")

        def count(*args):
            calls[0] += 1

        hook = torch.compiler.disable(count)
        for name in watched:
            hooks.forward_pre(model.get_submodule(name), hook, name=name)
            hooks.forward(model.get_submodule(name), hook, name=name)
        return hooks

    # each training set up (the compiled ones compiled by their first step), then timed in
    # interleaved rounds: the step's median over all rounds
    setups = {}
    model, opt = make()
    steps(model, opt)  # (warm: the first steps of a process are slower)
    hooks = hooked(model)
    calls[0] = 0
    steps(model, opt)
    eager_calls = calls[0] / args.steps
    hooks.remove()
    setups["eager, unwatched"] = (model, opt, None, None, "", "")
    torch.compile(lambda x: x * 2, backend=args.backend)(torch.ones(2))  # (the compiler's start)
    for with_hooks in (False, True):
        counters.clear()
        model, opt = make(Hooked if with_hooks else SmallCNN)
        if with_hooks:
            hooked(model)
        compiled = torch.compile(model, backend=args.backend)
        calls[0] = 0
        first = steps(compiled, opt)[0]
        graphs = f"{counters['stats']['unique_graphs']}/{sum(counters['graph_break'].values())}"
        ran = f"{calls[0] / args.steps:g} of {eager_calls:g}" if with_hooks else ""
        label = "compiled, hooks on the watched modules" if with_hooks else "compiled, unwatched"
        setups[label] = (compiled, opt, None, first, graphs, ran)
    for every in (10, 1):
        model, opt = make()
        setups[f"eager, watched every={every}"] = (model, opt, every, None, "", "")
    times = {label: [] for label in setups}
    with tempfile.TemporaryDirectory() as out:
        for _ in range(args.rounds):
            for label, (run, opt, every, *_) in setups.items():
                if every is None:
                    times[label] += steps(run, opt)[1:]
                    continue
                with probe.watch(run, probes, out=out, optimizer=opt, every=every, overwrite=True):
                    times[label] += steps(run, opt)[1:]
    eager = statistics.median(times["eager, unwatched"])
    rows = [(label, first, statistics.median(times[label]), graphs, ran)
            for label, (_, _, _, first, graphs, ran) in setups.items()]  # fmt: skip

    print(f"small CNN width 16, {args.size} px, batch {args.batch}, {args.steps} steps, "
          f"{args.threads} threads, backend {args.backend}")  # fmt: skip
    print(f"{'training':42} {'first call s':>12} {'step ms':>8} {'ratio':>6} "
          f"{'graphs/breaks':>13} {'hook calls a step':>18}")  # fmt: skip
    for label, first, step, graphs, ran in rows:
        first = f"{first:.1f}" if first is not None else ""
        print(
            f"{label:42} {first:>12} {step * 1e3:8.2f} {step / eager:6.2f} {graphs:>13} {ran:>18}"
        )


if __name__ == "__main__":
    main()
