"""What watching a training costs, beside its peers: the same training unwatched, watched by
probe at each `every`, by `wandb.watch(log="all", log_freq=every)` offline and by a TensorBoard
`add_histogram` loop over the tensors probe watches, as ratios to the unwatched one.

The trainings run in lockstep in one process: each variant has its own model and optimizer from
the same seed, and every step runs once per variant in turn (the order rotating from step to
step), so a change of the machine's load falls on all of them alike; a variant's time is the sum
of its steps plus its start and close. Rounds repeat that; the ratios are medians over rounds.

The trainings (`--model`, comma-separated): `resnet18` (torchvision's, 64 px, batch 64, SGD with
momentum; probe watches every convolution's output, grad_output and parameters: param,
param_grad, param_update, and every block's output and grad_output), `gpt2` (a GPT-2-shaped
model of 6 blocks of width 256, vocabulary 8192, 8 sequences of 128 tokens, AdamW; probe watches
every block's output, grad_output and parameters), `llama135m` (SmolLM2-135M's shape from
LlamaConfig with random weights: 30 blocks of width 576, vocabulary 49152, tied embeddings, 1
sequence of 128 tokens, AdamW; watched like gpt2), `cnn` (the tests' small CNN, 2 ms a step).
`--accumulate N` makes each step N micro-batches (each loss divided by N), `--clip X` clips the
gradients to norm X before each optimizer step (torch.nn.utils.clip_grad_norm_), and with it
`--hand-over` adds probe variants that hand the clip's norm to the watch (`w.clipped(norm)`),
and `--norms-before` probe variants whose gradient norms are taken as before
probe.train.grad_norms (float64, at the end of every backward and again at the step), the rest
of the watch the same.
`--rss` runs a watched training of the small CNN in a child process and prints its peak RSS after
100 and after 1000 steps. docs/bench/watch.md holds a run's output.

    python scripts/bench_watch.py [--model resnet18,gpt2] [--steps 100] [--every 100,1]
                                  [--peers wandb,tensorboard] [--rounds 1] [--threads 1]
                                  [--accumulate 1] [--clip X [--hand-over]] [--norms-before]
                                  [--rss] [--out docs/bench/watch.md]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import bench_common

SHAPES = {
    "resnet18": "torchvision resnet18, 3x64x64, batch 64, SGD (momentum 0.9)",
    "gpt2": "GPT-2-shaped, 6 blocks x 256, vocabulary 8192, 8 x 128 tokens, AdamW",
    "cnn": "the tests' small CNN, 3x8x8, batch 32, SGD (momentum 0.9)",
    "llama135m": "SmolLM2-135M-shaped Llama, 30 blocks x 576, vocabulary 49152, 1 x 128 tokens, "
    "AdamW",
}


def setup(name: str, steps: int):
    """(make model, make optimizer, batches, loss, probes) of one training."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    if name in ("gpt2", "llama135m"):
        from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

        if name == "gpt2":
            config = GPT2Config(n_layer=6, n_embd=256, n_head=4, n_positions=128, vocab_size=8192)
            model_class, rows = GPT2LMHeadModel, 8
        else:  # (HuggingFaceTB/SmolLM2-135M's config.json)
            config = LlamaConfig(
                hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                max_position_embeddings=2048, tie_word_embeddings=True, rms_norm_eps=1e-5,
            )  # fmt: skip
            model_class, rows = LlamaForCausalLM, 1

        def make():
            return model_class(config).train()

        vocab = config.vocab_size
        batches = [torch.randint(0, vocab, (rows, 128), generator=g) for _ in range(steps)]

        def loss(model, batch):
            return model(input_ids=batch, labels=batch).loss

        probes = {"blocks": {"layers": ["@blocks"], "capture": [
            "output", "grad_output", "param", "param_grad", "param_update"]}}  # fmt: skip
        return make, lambda m: torch.optim.AdamW(m.parameters(), lr=3e-4), batches, loss, probes
    if name == "cnn":
        from probe.testing.trainings import SmallCNN

        make, shape, classes, blocks = SmallCNN, (32, 3, 8, 8), 4, ["layer1", "layer2"]
    else:
        import torchvision

        def make():
            return torchvision.models.resnet18(num_classes=10)

        shape, classes, blocks = (64, 3, 64, 64), 10, ["@blocks"]
    batches = [(torch.randn(*shape, generator=g), torch.randint(0, classes, shape[:1], generator=g))
               for _ in range(steps)]  # fmt: skip

    def loss(model, batch):
        return F.cross_entropy(model(batch[0]), batch[1])

    probes = {
        "convs": {"layers": ["*"], "types": ["Conv2d"],
                  "capture": ["output", "grad_output", "param", "param_grad", "param_update"]},
        "blocks": {"layers": blocks, "capture": ["output", "grad_output"]},
    }  # fmt: skip

    def optimizer(m):
        return torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)

    return make, optimizer, batches, loss, probes


def float64_norm(grads):
    """The watch's gradient norm before probe.train.grad_norms: each gradient's float64 norm,
    squared and summed."""
    import torch

    squares = [torch.linalg.vector_norm(g, dtype=torch.float64) ** 2 for g in grads]
    return torch.stack(squares).sum().sqrt()


@contextlib.contextmanager
def norms_as_before(watch):
    """`watch`'s gradient norms taken as before probe.train.grad_norms inside: the float64 norm
    at the end of every backward and again at the step (where a clip changed the gradients)."""
    from probe.train import grad_norms

    real, norms = grad_norms.global_norm, watch.watcher.norms
    norms.at_backward, norms.learns = True, False
    grad_norms.global_norm = float64_norm
    try:
        yield
    finally:
        grad_norms.global_norm = real


class Training:
    """One variant: its model, optimizer and observer, stepped one step at a time. `kind`:
    None (unwatched), probe, wandb or tensorboard; `every` their frequency; `clip`: the norm
    the gradients are clipped to before each optimizer step (None: no clip); `way`: for probe,
    "handed" hands the clip's norm over to the watch, "before" takes the norms as before
    probe.train.grad_norms (`norms_as_before`)."""

    def __init__(self, kind, every, make, optimizer, loss, probes, out: Path, clip=None,
                 way=""):  # fmt: skip
        import torch

        torch.manual_seed(0)
        self.kind, self.every, self.loss_fn, self.probes = kind, every, loss, probes
        self.clip, self.way = clip, way
        self.model = make()
        self.opt = optimizer(self.model)
        self.out, self.seconds, self.step_no = out, 0.0, 0
        t0 = time.perf_counter()
        self._start()
        self.fixed = time.perf_counter() - t0  # the watch's start and close: once a training
        self.seconds += self.fixed

    def _start(self) -> None:
        if self.kind == "probe":
            import probe

            self.watch = probe.watch(self.model, self.probes, out=self.out, optimizer=self.opt,
                                     every=self.every).start()  # fmt: skip
        elif self.kind == "wandb":
            import wandb

            self.run = wandb.run  # (its hooks log into the process's run: one for all variants)
            self.run.watch(self.model, log="all", log_freq=self.every)
        elif self.kind == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.out))
            self.histograms = HistogramLoop(self.model, self.probes, self.writer)

    def step(self, micro: list) -> None:
        """One optimizer step over the micro-batches `micro`."""
        t0 = time.perf_counter()
        with norms_as_before(self.watch) if self.way == "before" else contextlib.nullcontext():
            self._step(micro)
        self.seconds += time.perf_counter() - t0

    def _step(self, micro: list) -> None:
        import torch

        recorded = self.step_no % self.every == 0 if self.every else False
        if self.kind == "tensorboard":
            self.histograms.recording = recorded
        self.opt.zero_grad()
        for batch in micro:
            loss = self.loss_fn(self.model, batch)
            (loss / len(micro) if len(micro) > 1 else loss).backward()
            if self.kind == "probe":
                self.watch.loss(loss)
        if self.clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
            if self.way == "handed":
                self.watch.clipped(norm)
        if self.kind == "tensorboard" and recorded:
            self.writer.add_scalar("loss", loss.item(), self.step_no)
            self.histograms.before_update(self.step_no)
        elif self.kind == "wandb" and (self.step_no + 1) % self.every == 0:
            self.run.log({"loss": loss.item()})  # commits what its hooks logged this step
        self.opt.step()
        if self.kind == "tensorboard" and recorded:
            self.histograms.after_update(self.step_no)
        self.step_no += 1

    def close(self) -> None:
        t0 = time.perf_counter()
        if self.kind == "probe":
            self.watch.close()
        elif self.kind == "wandb":
            self.run.unwatch(self.model)
        elif self.kind == "tensorboard":
            self.histograms.remove()
            self.writer.close()
        self.fixed += time.perf_counter() - t0
        self.seconds += time.perf_counter() - t0


class HistogramLoop:
    """TensorBoard's way to the same tensors: plain forward hooks and tensor hooks on the
    modules probe watches (their outputs and gradients), and the watched parameters, their
    gradients and updates around the optimizer step, each `add_histogram`ed at recorded steps."""

    def __init__(self, model, probes, writer):
        from probe.hooks.module_select import match_modules
        from probe.hooks.site_table import probe_specs

        self.writer, self.recording, self.step, self.handles = writer, False, 0, []
        self.params, self.before = {}, {}
        for name, spec in probe_specs(probes).items():
            for layer, module in match_modules(model, f"probe {name!r}", spec):
                if "output" in spec.capture:
                    grads = "grad_output" in spec.capture
                    self.handles.append(module.register_forward_hook(self._hook(layer, grads)))
                if any(str(c).startswith("param") for c in spec.capture):
                    for pname, p in module.named_parameters():
                        self.params[f"{layer}.{pname}"] = p

    def _hook(self, layer, grads):
        def hook(module, args, output):
            if not self.recording:
                return
            outs = output if isinstance(output, tuple) else (output,)
            for i, x in enumerate(o for o in outs if hasattr(o, "requires_grad")):
                self.writer.add_histogram(f"{layer}/output.{i}", x.detach(), self.step)
                if grads and x.requires_grad:
                    x.register_hook(self._grad(f"{layer}/grad_output.{i}"))

        return hook

    def _grad(self, tag):
        def hook(grad):
            self.writer.add_histogram(tag, grad, self.step)

        return hook

    def before_update(self, step) -> None:
        self.step = step
        for name, p in self.params.items():
            self.writer.add_histogram(f"{name}/param", p.detach(), step)
            if p.grad is not None:
                self.writer.add_histogram(f"{name}/param_grad", p.grad, step)
            self.before[name] = p.detach().clone()

    def after_update(self, step) -> None:
        for name, p in self.params.items():
            self.writer.add_histogram(f"{name}/param_update", p.detach() - self.before[name], step)
        self.before.clear()
        self.step = step + 1

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def lockstep(name: str, variants: list[tuple], steps: int, tmp: Path, accumulate: int = 1,
             clip=None) -> dict[str, float]:  # fmt: skip
    """One round: every variant (label, kind, every, way) trained over the same batches
    in lockstep, `accumulate` micro-batches a step; seconds by variant."""
    make, optimizer, batches, loss, probes = setup(name, steps * accumulate)
    if any(kind == "wandb" for _, kind, _, _ in variants):
        import wandb

        wandb.init(mode="offline", dir=str(tmp), project="bench-watch")
    trainings = {}
    for label, kind, every, way in variants:
        out = tmp / label.replace(" ", "_").replace("=", "").replace(",", "")
        trainings[label] = Training(kind, every, make, optimizer, loss, probes, out, clip,
                                    way)  # fmt: skip
    order = list(trainings.values())
    for i in range(steps):
        micro = batches[i * accumulate : (i + 1) * accumulate]
        for t in order[i % len(order) :] + order[: i % len(order)]:
            t.step(micro)
    for t in order:
        t.close()
    if any(kind == "wandb" for _, kind, _, _ in variants):
        wandb.finish()  # (its start and finish, once a process, are not timed)
    return {label: (t.seconds, t.seconds - t.fixed) for label, t in trainings.items()}


def rss_child(steps: list[int]) -> None:
    """A watched training of the small CNN at every=1, printing its peak RSS (VmHWM, MB) after
    each count of `steps` as JSON."""
    import torch

    import probe

    torch.set_num_threads(1)
    make, optimizer, batches, loss, probes = setup("cnn", 1)
    model = make()
    opt = optimizer(model)
    peaks = {}
    tmp = tempfile.TemporaryDirectory()
    with tmp, probe.watch(model, probes, out=Path(tmp.name) / "w", optimizer=opt, every=1) as w:
        for step in range(1, max(steps) + 1):
            opt.zero_grad()
            value = loss(model, batches[0])
            value.backward()
            w.loss(value)
            opt.step()
            if step in steps:
                peaks[str(step)] = bench_common.peak_rss_mb()
    print(json.dumps(peaks))


VIEWS = {  # operations that launch no kernel (views, aliases, Python scalars lifted)
    "aten.view.default", "aten.slice.Tensor", "aten.detach.default", "aten._unsafe_view.default",
    "aten.view.dtype", "aten.expand.default", "aten.lift_fresh.default", "aten.alias.default",
    "aten.t.default", "aten.select.int", "aten.unsqueeze.default", "aten.permute.default",
    "aten.transpose.int", "aten.split.Tensor", "aten.split_with_sizes.default",
    "aten.unbind.int", "aten.as_strided.default", "aten.squeeze.dim", "aten.unflatten.int",
}  # fmt: skip


def counts(name: str, reduction: str) -> list:
    """One recorded step of `name`'s training on the path a GPU's values take (here on the CPU:
    the torch backend, `reduction` fused or reference, the device branches of the torch
    reductions): its sites, the copies to the host the step asks for
    (probe.hooks.device.copy_to_host), the bytes they move per site, and the ATen operations
    that launch a kernel, per site (a watched step's minus an unwatched one's)."""
    from collections import Counter

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import probe
    from probe.stats import backend, torch_backend
    from probe.train import step_stats

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func) not in VIEWS:
                self.n[str(func)] += 1
            return func(*args, **(kwargs or {}))

    backend.use("torch")
    torch_backend.use_reduction(reduction)
    host, copy = torch_backend._host, step_stats.copy_to_host
    moved: list[int] = []
    torch_backend._host = lambda device: False  # (the branches a GPU takes)
    step_stats.copy_to_host = lambda t: (moved.append(t.numel() * t.element_size()), copy(t))[1]
    try:
        make, optimizer, batches, loss, probes = setup(name, 3)

        def step(model, opt, batch, w=None):
            opt.zero_grad()
            value = loss(model, batch)
            value.backward()
            if w is not None:
                w.loss(value)
            opt.step()

        torch.manual_seed(0)
        model, opt = make(), None
        opt = optimizer(model)
        step(model, opt, batches[0])
        with Ops() as plain:
            step(model, opt, batches[1])
        torch.manual_seed(0)
        model = make()
        opt = optimizer(model)
        with tempfile.TemporaryDirectory() as tmp:
            w = probe.watch(model, probes, out=Path(tmp) / "w", optimizer=opt).start()
            step(model, opt, batches[0], w)
            moved.clear()
            with Ops() as watched:
                step(model, opt, batches[1], w)
            copies = len(moved)
            w.close()
            with probe.open_run(Path(tmp) / "w") as run:
                sites = int((run.train()["step"] == 1).sum())
    finally:
        torch_backend._host, step_stats.copy_to_host = host, copy
        torch_backend.use_reduction(None)
    per_site = (sum(watched.n.values()) - sum(plain.n.values())) / sites
    return [name, reduction, sites, copies, f"{moved[0] / sites:.0f}" if moved else "-",
            f"{per_site:.1f}"]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet18,gpt2")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--every", default="100,1", help="comma-separated every values")
    parser.add_argument("--peers", default="wandb,tensorboard", help="'' for none")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches a step")
    parser.add_argument("--clip", type=float, help="clip_grad_norm_ to this before each step")
    parser.add_argument(
        "--hand-over",
        action="store_true",
        help="with --clip: probe variants handing the clip's norm over too",
    )
    parser.add_argument(
        "--norms-before",
        action="store_true",
        help="probe variants taking the gradient norms as before probe.train.grad_norms",
    )
    parser.add_argument("--rss", action="store_true", help="the peak RSS check as well")
    parser.add_argument("--counts", action="store_true",
                        help="what one recorded step moves to the host and launches, per site, "
                             "on a GPU's path (no timing)")  # fmt: skip
    parser.add_argument("--out", type=Path, help="write the tables there too (markdown)")
    parser.add_argument("--rss-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rss_child:
        rss_child([int(s) for s in args.rss_child.split(",")])
        return
    if args.counts:
        rows = [counts(name, r) for name in args.model.split(",") for r in ("fused", "reference")]
        table = bench_common.markdown(
            ["### One recorded step on a GPU's path, counted on the CPU"],
            ["training", "reduction", "sites", "copies to the host", "bytes per site",
             "kernel ops per site"], rows, [],
        )  # fmt: skip
        print(table, flush=True)
        if args.out:
            args.out.write_text(table + "\n")
        return

    import torch

    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    torch.set_num_threads(args.threads)
    from probe.stats import backend

    everies = [int(e) for e in args.every.split(",")]
    peers = [p for p in args.peers.split(",") if p]
    variants = [("unwatched", None, 0, ""), ("unwatched again", None, 0, "")]  # (noise)
    for kind in ["probe", *peers]:
        variants += [(f"{kind} every={e}", kind, e, "") for e in everies]
    if args.clip is not None and args.hand_over:
        variants += [(f"probe every={e}, clip handed over", "probe", e, "handed") for e in everies]
    if args.norms_before:
        variants += [(f"probe every={e}, norms as before", "probe", e, "before") for e in everies]
    lines = []
    for name in args.model.split(","):
        got: dict[str, list[tuple[float, float]]] = {label: [] for label, _, _, _ in variants}
        with tempfile.TemporaryDirectory() as tmp:  # imports, compiled kernels, first allocations
            lockstep(name, variants, 2, Path(tmp), args.accumulate, args.clip)
        for r in range(args.rounds):
            with tempfile.TemporaryDirectory() as tmp:
                seconds = lockstep(name, variants, args.steps, Path(tmp), args.accumulate,
                                   args.clip)  # fmt: skip
            for label, s in seconds.items():
                got[label].append(s)
            print(f"  {name} round {r + 1}/{args.rounds}: "
                  + ", ".join(f"{k} {v[0]:.1f} s" for k, v in seconds.items()), flush=True)  # fmt: skip
        rows = []
        for label, runs in got.items():
            r = [a[0] / b[0] for a, b in zip(runs, got["unwatched"], strict=True)]
            steps = sorted(a[1] / b[1] for a, b in zip(runs, got["unwatched"], strict=True))
            rows.append([label, f"{sorted(a[0] for a in runs)[len(runs) // 2]:.1f}",
                         f"{sorted(r)[len(r) // 2]:.3f}", f"{min(r):.3f}-{max(r):.3f}",
                         f"{steps[len(steps) // 2]:.3f}"])  # fmt: skip
        head = [
            f"### {name}: {SHAPES[name]}",
            "",
            f"{args.steps} steps in lockstep"
            + (f" of {args.accumulate} micro-batches" if args.accumulate > 1 else "")
            + (f", clip_grad_norm_ to {args.clip}" if args.clip is not None else "")
            + f", {args.threads} torch thread(s), statistics backend "
            f"{backend.cpu_stats().__module__.split('.')[-1].removesuffix('_backend')}, median of "
            f"{args.rounds} round(s)",
        ]
        notes = [
            "ratio: the whole training's seconds over the unwatched one's, the watch's start "
            "and close (its file made, the last flush) included; steps only: without them "
            "(what each step costs, paid again at every step of a longer training)"
        ]
        table = bench_common.markdown(
            head, ["variant", "seconds", "ratio", "ratio range", "steps only"], rows, notes
        )
        print(table, flush=True)
        lines.append(table)
    if args.rss:
        steps = [100, 1000]
        peaks = bench_common.child_json(
            ["scripts/bench_watch.py", "--rss-child", ",".join(map(str, steps))]
        )
        table = bench_common.markdown(
            ["### peak RSS of a watched training (the small CNN, every=1, 19 sites)"],
            ["after steps", "peak RSS (MB)"], [[s, f"{peaks[str(s)]:.1f}"] for s in steps], [],
        )  # fmt: skip
        print(table, flush=True)
        lines.append(table)
    if args.out:
        args.out.write_text(
            "# bench_watch\n\n`python scripts/bench_watch.py "
            + " ".join(sys.argv[1:])
            + "`\n\n"
            + "\n\n".join(lines)
            + "\n"
        )


if __name__ == "__main__":
    main()
