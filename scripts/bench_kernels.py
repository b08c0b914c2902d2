"""The compiled statistics pass alone, in ns per value, on the tensors a watched resnet18 step
reduces: this tree's kernels, and side by side in the same process another tree's.

    python scripts/bench_kernels.py [--against /path/to/other/checkout] [--reps 10]
    PROBE_STATS_BACKEND=numba python scripts/bench_kernels.py --in-training 5


The tensors: torchvision's resnet18 (10 classes) at 64 px, one batch of 64 random images, after
three SGD steps: every convolution's output and grad_output, every block's output and
grad_output, every convolution's weight and its gradient (as the watch sees them: one row). Each
is reduced the way `probe.stats.numba_backend` reduces a batch on one thread: `rows.reduce_rows`
into the int32 scratch, then `packing.finish` (the spans taken out). `--against` copies that
checkout's `probe/stats/kernels` into a temporary package and times its pass on the same
tensors, the two alternating (the order swapped every round); the results are first checked
equal (histograms, counts and extremes bit for bit, moments to 1e-12). The figure per tensor is
the least CPU time of the thread over the rounds (time.thread_time: what a loaded machine takes
away in waiting is not counted, what it takes in caches is), summed per kind of site.

`--in-training N` times the same pass where the watch runs it instead: bench_watch.py's resnet18
training (2 micro-batches a step, clip_grad_norm_ to 1.0) watched at every=1, stepped in turn
with the same training unwatched for N steps after one of warm-up; it prints, per step, the
watch's statistics calls (`probe.train.step_stats.StepStats.add`: a value to its step's
statistics through `probe.stats.backend.batch_stats`, the micro-batches merged), their values,
the CPU time of the compiled pass in them (`numba_backend.solo_batch`, the one call a value on
one thread takes) and of the calls whole (the difference: the Python around the pass), those of
the parameters apart, the CPU time of the watch's other work in a step (parameters, gradients,
updates taken, the norm at each backward's end, the step's end, each with its statistics calls),
and each training's median CPU time per step (time.process_time). `--tree CHECKOUT` runs that
checkout's probe instead (this script's harness), to time a change before and after, in turn.

`--in-training N --diagnose` asks why the pass costs more there than alone, side by side in one
process: the watched training alone, N steps after one of warm-up; in the hook each statistics
call is timed twice (the tensor as the layer just wrote it, then re-read), then a numpy float64
sum over it and an ALU-only compiled loop (no memory: the core's speed there) are timed; after
each step the same tensors (copies) are reduced alone, once each as in the hook, with the same
sum and loop beside them, so the load of that moment falls on both. Also counted: minor page
faults in the pass (resource.getrusage of the thread), calls off the training's thread,
non-contiguous or non-float32 tensors, and the compiled call's share of the call (the Python
around it); per kind of tensor (parameters; activations and gradients by the kernel's path:
segments of >= 1,024 values, of 128-1,023, narrower maps by column).

`--narrow ROUNDS` times the column path alone (`columns._by_column`, through `rows.reduce_rows`
and `packing.finish` as above) on the narrow maps of the same tensors (outputs and gradients of
layer2-4: 4-64 values a segment, a quarter of a step's values), this tree against `--against`:
each round reduces every such tensor once, from one of four sets of copies in turn (so its values
come from memory, as a layer's fresh output's partly do), the trees alternating; the results are
first checked equal bit for bit, also on copies with NaN and Inf put in late rows. It prints each
tree's median ns a value and the median of the rounds' ratios.

`--loops` times the loops the two paths are made of, each alone over pieces of those narrow maps
held in cache (8 rows of each, 10 times a round, 9 rounds, median): the column path's NaN/Inf look
(`_worst`), sums, keys and histogram increments, and the segment path's sums and keys over the
same pieces taken as one segment each.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import sys
import tempfile
import time
from pathlib import Path

import bench_common as bc  # first: it puts the repository root on sys.path
import numpy as np
import torch

KINDS = ("output", "grad_output", "param", "param_grad")
PARAMS_ADD = "parameters' statistics calls"


def watched_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """name -> the float32 tensor the watch reduces (see the module), as a numpy array."""
    import torch.nn.functional as F
    import torchvision

    torch.manual_seed(seed)
    model = torchvision.models.resnet18(num_classes=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(64, 3, 64, 64), torch.randint(0, 10, (64,))
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    found: dict[str, np.ndarray] = {}
    blocks = {f"layer{i}.{j}" for i in range(1, 5) for j in range(2)}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Conv2d) or name in blocks:
            output = module.register_forward_hook(
                lambda m, a, o, name=name: found.__setitem__(f"{name}.output", o.detach().clone())
            )
            grad = module.register_full_backward_hook(
                lambda m, gi, go, name=name: found.__setitem__(f"{name}.grad_output", go[0].clone())
            )
            handles += [output, grad]
    opt.zero_grad()
    model.requires_grad_(True)
    F.cross_entropy(model(x.requires_grad_()), y).backward()
    for h in handles:
        h.remove()
    for name, p in model.named_parameters():
        if p.dim() == 4:
            found[f"{name}.param"] = p.detach().clone()[None]
            found[f"{name}.param_grad"] = p.grad.detach().clone()[None]
    return {k: v.numpy() for k, v in found.items()}


def load_kernels(checkout: Path, into: Path):
    """That checkout's `probe/stats/kernels` as a package of another name (its own numba cache,
    in `into`); returns its (rows, packing) modules."""
    name = "kernels_against"
    target = into / name
    shutil.copytree(checkout / "probe" / "stats" / "kernels", target,
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    # (its cache stamp reads the statistics' declaration beside the package)
    shutil.copy(checkout / "probe" / "stats" / "stat_columns.py", into / "stat_columns.py")
    for path in target.glob("*.py"):
        path.write_text(path.read_text().replace("probe.stats.kernels", name))
    sys.path.insert(0, str(into))
    return importlib.import_module(f"{name}.rows"), importlib.import_module(f"{name}.packing")


def one_pass(rows, packing):
    """reduce a (rows, units, rest) float32 array as numba_backend does on one thread."""
    low, inf = np.int32(0x7FFFFFFF), np.int32(0x7F800000)

    def reduce(y: np.ndarray, counts: np.ndarray) -> np.ndarray:
        width = y.shape[1]
        outs = (np.empty((1, 4)), np.empty((1, 5), np.int64), np.empty((1, 3, width)),
                np.empty((1, 2, width), np.int64))  # fmt: skip
        keys = y.view(np.int32)
        rows.reduce_rows(y, y.view(np.uint32), keys, low, inf, counts, *(o[0] for o in outs))
        return packing.finish(*outs, low, keys, y, counts[None], True)

    return reduce


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal packed results: every count, extreme and bucket bit for bit, moments to 1e-12."""
    return a.shape == b.shape and np.allclose(a, b, rtol=1e-12, atol=0.0)


def in_training(steps: int) -> None:
    """The pass's CPU time inside a watched training (see the module)."""
    import statistics

    import bench_watch

    from probe.stats import numba_backend
    from probe.train import grad_norms, step_hooks, step_stats

    spent = {"add": 0.0, "compiled": 0.0, "calls": 0, "values": 0, PARAMS_ADD: 0.0}
    add, compiled = step_stats.StepStats.add, numba_backend.solo_batch
    phases = {  # the watch's other work in a step: (class, method) -> what it does
        (step_hooks.Watcher, "take_params"): "parameters taken (param, and copies for updates)",
        (step_hooks.Watcher, "take_grads"): "gradients taken (param_grad, grad_norm)",
        (step_hooks.Watcher, "take_updates"): "updates taken (differences, param_update)",
        (grad_norms.GradNorms, "backward_ended"): "norm at each backward's end",
        (step_hooks.Watcher, "end_step"): "step's end (settle, rows, quantiles)",
    }
    inside = {"phase": None}

    def timed_add(self, key, x, bounds, unit_axis):
        t0 = time.thread_time()
        try:
            return add(self, key, x, bounds, unit_axis)
        finally:
            seconds = time.thread_time() - t0
            spent["add"] += seconds
            spent["calls"] += 1
            spent["values"] += x.numel()
            if inside["phase"] is not None:
                spent[PARAMS_ADD] += seconds

    def phase(cls, name, label):
        fn = getattr(cls, name)

        def timed(*a, **k):
            outer = inside["phase"]
            inside["phase"] = label
            t0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                spent[label] = spent.get(label, 0.0) + time.thread_time() - t0
                inside["phase"] = outer

        setattr(cls, name, timed)

    for (cls, name), label in phases.items():
        phase(cls, name, label)

    def timed_compiled(*a):
        t0 = time.thread_time()
        try:
            return compiled(*a)
        finally:
            spent["compiled"] += time.thread_time() - t0

    step_stats.StepStats.add = timed_add
    numba_backend.solo_batch = timed_compiled
    make, optimizer, batches, loss, probes = bench_watch.setup("resnet18", 2 * steps + 2)
    tmp = tempfile.TemporaryDirectory()
    trainings = {kind: bench_watch.Training(kind, 1, make, optimizer, loss, probes,
                                            Path(tmp.name) / str(kind), clip=1.0)
                 for kind in (None, "probe")}  # fmt: skip
    for t in trainings.values():
        t.step(batches[0:2])  # (warm-up: the kernels loaded, the first allocations)
    spent.update({k: 0.0 for k in spent})
    cpu: dict = {kind: [] for kind in trainings}
    for s in range(steps):
        for kind in list(trainings)[:: 1 if s % 2 else -1]:
            t0 = time.process_time()
            trainings[kind].step(batches[2 + 2 * s : 4 + 2 * s])
            cpu[kind].append(time.process_time() - t0)
    trainings["probe"].close()
    plain, watched = statistics.median(cpu[None]), statistics.median(cpu["probe"])
    ns = spent["compiled"] / spent["values"] * 1e9
    print(f"the statistics of a watched resnet18 step ({numba_backend.__file__}): "
          f"{spent['calls'] / steps:.0f} calls, {spent['values'] / steps / 1e6:.1f}M values; "
          f"CPU s a step: the compiled pass {spent['compiled'] / steps:.3f} ({ns:.2f} ns a value), "
          f"the calls whole (StepStats.add) {spent['add'] / steps:.3f}, the Python around the "
          f"pass {(spent['add'] - spent['compiled']) / steps:.3f}; the training's CPU s a step "
          f"(median of {steps}): unwatched {plain:.3f}, watched {watched:.3f} "
          f"({watched / plain:.3f}x, {watched - plain:+.3f} s)")  # fmt: skip
    params = spent[PARAMS_ADD]
    print(f"  of the calls: activations' {(spent['add'] - params) / steps:.3f}, "
          f"parameters' {params / steps:.3f}")  # fmt: skip
    for label in phases.values():
        print(f"  {label}: {spent.get(label, 0.0) / steps:.3f} (with its statistics calls)")


def _spin():
    """A compiled ALU-only loop (a xorshift chain, no memory traffic): its CPU time is the
    core's speed where it runs, whatever the caches hold."""
    import numba

    @numba.njit(nogil=True)
    def spin(n):
        x = np.uint64(88172645463325252)
        for _ in range(n):
            x ^= x << np.uint64(13)
            x ^= x >> np.uint64(7)
            x ^= x << np.uint64(17)
        return x

    spin(10)
    return lambda: spin(20_000)


def _kind(x: torch.Tensor) -> str:
    """The tensor's kind for the diagnosis: a parameter (one row), else the kernel's path."""
    if x.shape[0] == 1:
        return "parameters"
    size = int(np.prod(x.shape[2:]))
    which = "outputs" if torch.is_grad_enabled() else "gradients"
    path = "segments >= 1024" if size >= 1024 else "segments >= 128" if size >= 128 else "columns"
    return f"{which}, {path}"


def diagnose(steps: int) -> None:
    """The pass in the hook against the same tensors alone (see the module)."""
    import resource
    import threading

    import bench_watch

    from probe.stats import backend, numba_backend

    def cpu(fn, *a) -> float:
        t0 = time.thread_time()
        fn(*a)
        return time.thread_time() - t0

    def total(a: np.ndarray) -> None:
        np.add.reduce(a.reshape(-1), dtype=np.float64)

    spin = _spin()
    reduce, solo = backend.batch_stats, numba_backend.solo_batch
    main, rusage = threading.get_ident(), resource.RUSAGE_THREAD
    spent: dict[str, dict[str, float]] = {}
    odd = {"off the training's thread": 0, "not contiguous": 0, "not float32": 0}
    kept: list = []

    def add(kind: str, **seconds: float) -> None:
        for k in {kind, "all"}:
            for name, v in seconds.items():
                spent.setdefault(k, {}).setdefault(name, 0.0)
                spent[k][name] += v

    def compiled(*a):
        t0 = time.thread_time()
        try:
            return solo(*a)
        finally:
            add("all", compiled=time.thread_time() - t0)

    def hooked(x, bounds=None, hist=None, unit_axis=1):
        a = x.detach()
        odd["off the training's thread"] += threading.get_ident() != main
        odd["not contiguous"] += not a.is_contiguous()
        odd["not float32"] += a.dtype != torch.float32
        kind = _kind(a)
        faults = resource.getrusage(rusage).ru_minflt
        t0 = time.thread_time()
        result = reduce(x, bounds, hist, unit_axis)
        first = time.thread_time() - t0
        faults = resource.getrusage(rusage).ru_minflt - faults
        numba_backend.solo_batch = solo  # (the compiled call's share: the first call's alone)
        again = cpu(reduce, x, bounds, hist, unit_axis)
        numba_backend.solo_batch = compiled
        add(kind, values=a.numel(), first=first, again=again, faults=faults,
            sum_hook=cpu(total, a.numpy()), spin_hook=cpu(spin))  # fmt: skip
        kept.append((kind, a.clone(), bounds, unit_axis))
        return result

    make, optimizer, batches, loss, probes = bench_watch.setup("resnet18", 2 * steps + 2)
    tmp = tempfile.TemporaryDirectory()
    training = bench_watch.Training("probe", 1, make, optimizer, loss, probes,
                                    Path(tmp.name) / "probe", clip=1.0)  # fmt: skip
    training.step(batches[0:2])  # (warm-up)
    backend.batch_stats, numba_backend.solo_batch = hooked, compiled
    try:
        for s in range(steps):
            kept.clear()
            training.step(batches[2 + 2 * s : 4 + 2 * s])
            backend.batch_stats, numba_backend.solo_batch = reduce, solo
            for kind, a, bounds, axis in kept:  # the same tensors alone, once each
                add(kind, alone=cpu(reduce, a, bounds, None, axis), sum_alone=cpu(total, a.numpy()),
                    spin_alone=cpu(spin))  # fmt: skip
            backend.batch_stats, numba_backend.solo_batch = hooked, compiled
    finally:
        backend.batch_stats, numba_backend.solo_batch = reduce, solo
        training.close()
    every = spent["all"]
    n = every["values"]
    print(f"resnet18 watched at every=1, {steps} steps: {every['values'] / steps / 1e6:.1f}M values "
          f"a step in {len(kept)} calls; minor page faults in the pass {every['faults'] / steps:.0f} "
          "a step; " + ", ".join(f"{k}: {v}" for k, v in odd.items()))  # fmt: skip
    print(f"ns a value: in the hook {every['first'] / n * 1e9:.2f} (re-read {every['again'] / n * 1e9:.2f}), "
          f"alone {every['alone'] / n * 1e9:.2f}; the compiled call {every['compiled'] / n * 1e9:.2f} "
          f"of the hook's first ({every['compiled'] / every['first']:.0%}); numpy sum in the hook "
          f"{every['sum_hook'] / n * 1e9:.2f}, alone {every['sum_alone'] / n * 1e9:.2f}")  # fmt: skip
    print(f"ratios: hook / alone {every['first'] / every['alone']:.3f}, first read / re-read "
          f"{every['first'] / every['again']:.3f}, numpy sum hook / alone "
          f"{every['sum_hook'] / every['sum_alone']:.3f}, ALU loop hook / alone "
          f"{every['spin_hook'] / every['spin_alone']:.3f}")  # fmt: skip
    for kind, d in sorted(spent.items()):
        if kind != "all":
            print(f"  {kind:28s} {d['values'] / steps / 1e6:5.1f}M a step: ns a value in the hook "
                  f"{d['first'] / d['values'] * 1e9:.2f}, re-read {d['again'] / d['values'] * 1e9:.2f}, "
                  f"alone {d['alone'] / d['values'] * 1e9:.2f}")  # fmt: skip


def _narrow(tensors: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The (rows, units, size) views of the tensors the column path takes (size < rows.NARROW)."""
    from probe.stats.kernels.rows import NARROW

    views = [x.reshape(x.shape[0], x.shape[1], -1) for x in tensors.values() if x.shape[0] > 1]
    return [y for y in views if y.shape[2] < NARROW]


def narrow(against: Path, rounds: int) -> None:
    """The column path, this tree against another's (see the module)."""
    from probe.stats.kernels import packing, rows

    tmp = tempfile.TemporaryDirectory()
    ours, theirs = one_pass(rows, packing), one_pass(*load_kernels(against, Path(tmp.name)))
    maps = _narrow(watched_tensors())
    rng = np.random.default_rng(0)
    checked = list(maps)
    for y in maps:
        for late in ([5], [9, 30], [63]):
            z = y.copy()
            for r in late:
                z[r, rng.integers(z.shape[1]), rng.integers(z.shape[2])] = (np.nan, np.inf)[r % 2]
            checked.append(z)
    for y in checked:
        a, b = ours(y, np.zeros(1 << 16, np.int32)), theirs(y, np.zeros(1 << 16, np.int32))
        if a.shape != b.shape or not np.array_equal(a.view(np.int64), b.view(np.int64)):
            raise SystemExit(f"{y.shape}: the two passes differ")
    copies = [[y.copy() for y in maps] for _ in range(4)]
    n = sum(y.size for y in maps)
    counts = np.zeros(1 << 16, np.int32)
    spent: dict[str, list[float]] = {"this tree": [], "against": []}
    for r in range(rounds):
        for label in list(spent)[:: 1 if r % 2 else -1]:
            fn = ours if label == "this tree" else theirs
            total = 0.0
            for y in copies[r % len(copies)]:
                counts[:] = 0
                t0 = time.thread_time()
                fn(y, counts)
                total += time.thread_time() - t0
            spent[label].append(total)
    a, b = np.array(spent["this tree"]), np.array(spent["against"])
    print(f"the column path on {len(maps)} narrow maps ({n / 1e6:.1f}M values), {rounds} rounds, "
          f"{len(checked)} tensors checked equal: this tree {np.median(a) / n * 1e9:.2f} ns a value, "
          f"against {np.median(b) / n * 1e9:.2f}; this tree / against {np.median(a / b):.3f} "
          f"(median of the rounds' ratios; lower in {int((a < b).sum())} of {rounds})")  # fmt: skip


def loops() -> None:
    """The paths' loops alone over cached pieces of the narrow maps (see the module)."""
    import numba

    from probe.stats.kernels import columns, histogram, segments

    @numba.njit
    def drive(y, which, counts, low, times):
        rows, width, size = y.shape
        span = min(width * size, columns.COLUMN_BLOCK)
        sums, squares, shift = np.zeros(span), np.zeros(span), np.zeros(span)
        keyed = np.zeros((3, span), np.int32)
        positive, lows, highs = keyed[0], keyed[1], keyed[2]
        out = 0.0
        for _ in range(times):
            for c0 in range(0, width * size, span):
                for r in range(rows):
                    a = y[r].reshape(-1)[c0 : c0 + span]
                    k = a.view(np.int32)
                    if which == 0:
                        out += columns._worst(k, low)
                    elif which == 1:
                        out += columns._column_sums(a, shift[: a.size], sums, squares)[0]
                    elif which == 2:
                        out += columns._column_keys(k, low, positive, lows, highs)[0]
                    elif which == 3:
                        histogram._histogram(a.view(np.uint32), counts)
                    elif which == 4:
                        out += segments._sums(a, 0.0)[0]
                    else:
                        out += segments._keys(k, low)[3]
        return out

    names = ["column: NaN/Inf look", "column: sums", "column: keys", "histogram increments",
             "segment: sums", "segment: keys"]  # fmt: skip
    pieces = [np.ascontiguousarray(y[:8]) for y in _narrow(watched_tensors())]
    n = sum(y.size for y in pieces) * 10
    low, counts = np.int32(0x7FFFFFFF), np.zeros(1 << 16, np.int32)
    for which in range(len(names)):
        drive(pieces[0], which, counts, low, 1)
    spent: dict[int, list[float]] = {w: [] for w in range(len(names))}
    for r in range(9):
        for which in list(spent)[:: 1 if r % 2 else -1]:
            t0 = time.thread_time()
            for y in pieces:
                drive(y, which, counts, low, 10)
            spent[which].append(time.thread_time() - t0)
    for which, name in enumerate(names):
        print(f"{name:22s} {np.median(spent[which]) / n * 1e9:.2f} ns a value")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", type=Path, help="another checkout whose kernels to time beside")
    p.add_argument("--reps", type=int, default=10, help="rounds per tensor (the least is kept)")
    p.add_argument("--out", type=Path, help="also write the table there (markdown)")
    p.add_argument("--in-training", type=int, metavar="STEPS",
                   help="time the pass inside a watched training instead (see the module)")  # fmt: skip
    p.add_argument("--diagnose", action="store_true",
                   help="with --in-training: the pass in the hook against alone (see the module)")  # fmt: skip
    p.add_argument("--narrow", type=int, metavar="ROUNDS",
                   help="with --against: the column path alone, both trees (see the module)")  # fmt: skip
    p.add_argument("--loops", action="store_true", help="the paths' loops alone (see the module)")
    p.add_argument("--tree", type=Path,
                   help="with --in-training: run that checkout's probe (before and after)")  # fmt: skip
    args = p.parse_args()
    if args.tree:
        sys.path.insert(0, str(args.tree.resolve()))
    torch.set_num_threads(1)
    if args.narrow:
        if not args.against:
            raise SystemExit("--narrow compares two trees: give --against CHECKOUT")
        narrow(args.against.resolve(), args.narrow)
        return
    if args.loops:
        loops()
        return
    if args.in_training and args.diagnose:
        diagnose(args.in_training)
        return
    if args.in_training:
        in_training(args.in_training)
        return
    from probe.stats.kernels import packing, rows

    passes = {"this tree": one_pass(rows, packing)}
    tmp = tempfile.TemporaryDirectory()
    if args.against:
        passes["against"] = one_pass(*load_kernels(args.against.resolve(), Path(tmp.name)))
    tensors = watched_tensors()
    best = {label: {} for label in passes}
    for name, x in tensors.items():
        y = x.reshape(x.shape[0], x.shape[1], -1)
        counts = np.zeros(1 << 16, np.int32)
        results = [fn(y, counts) for fn in passes.values()]  # (compiles, and checks)
        if not all(same(results[0], r) for r in results[1:]):
            raise SystemExit(f"{name}: the two passes differ")
        for label in passes:
            best[label][name] = float("inf")
        for r in range(args.reps):
            for label in list(passes)[:: 1 if r % 2 else -1]:
                t0 = time.thread_time()
                passes[label](y, counts)
                best[label][name] = min(best[label][name], time.thread_time() - t0)
    labels = list(passes)
    rows_out = []
    for kind in (*KINDS, "all"):
        names = [n for n in tensors if kind == "all" or n.endswith("." + kind)]
        n = sum(tensors[k].size for k in names)
        ns = [sum(best[label][k] for k in names) / n * 1e9 for label in labels]
        ratio = [f"{ns[0] / ns[1]:.3f}"] if len(ns) > 1 else []
        rows_out.append([kind, f"{n / 1e6:.1f}M", *(f"{v:.2f}" for v in ns), *ratio])
    cols = ["sites", "values", *(f"ns/value, {label}" for label in labels)]
    cols += ["this tree / against"] if len(labels) > 1 else []
    head = [
        "### The statistics pass on a watched resnet18 step's tensors",
        "",
        f"{len(tensors)} tensors, one thread, least CPU time of {args.reps} rounds per tensor"
        + (", the two trees alternating" if len(labels) > 1 else ""),
    ]
    table = bc.markdown(head, cols, rows_out, [])
    print(table, flush=True)
    if args.out:
        args.out.write_text(table)


if __name__ == "__main__":
    main()
