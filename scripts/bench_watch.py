"""What watching a training costs: the same training unwatched and watched at several `every`,
side by side in interleaved rounds of one process, as ratios to the unwatched one.

The training: torchvision's resnet18 (or `--model cnn`: the tests' small CNN) on seeded random
images, SGD with momentum; the watch: every convolution's output, grad_output and parameters
(param, param_grad, param_update) and every block's output and grad_output.

    python scripts/bench_watch.py [--model resnet18] [--size 32] [--batch 32] [--steps 20]
                                  [--every 100,10,1] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import bench_common


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["resnet18", "cnn"], default="resnet18")
    parser.add_argument("--size", type=int, default=32, help="image size (resnet18)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", default="100,10,1", help="comma-separated every values")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F

    import probe

    torch.set_num_threads(args.threads)
    if args.model == "cnn":
        from probe.testing.trainings import SmallCNN

        def make():
            return SmallCNN()

        shape, classes = (3, 8, 8), 4
        blocks = ["layer1", "layer2"]
    else:
        import torchvision

        def make():
            return torchvision.models.resnet18(num_classes=10)

        shape, classes = (3, args.size, args.size), 10
        blocks = ["@blocks"]
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(args.batch, *shape, generator=g),
             torch.randint(0, classes, (args.batch,), generator=g)) for _ in range(args.steps)]  # fmt: skip
    probes = {
        "convs": {"layers": ["*"], "types": ["Conv2d"],
                  "capture": ["output", "grad_output", "param", "param_grad", "param_update"]},
        "blocks": {"layers": blocks, "capture": ["output", "grad_output"]},
    }  # fmt: skip

    def training(every):
        def run(out: Path):
            torch.manual_seed(0)
            model = make()
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            w = None
            if every is not None:
                w = probe.watch(model, probes, out=out, optimizer=opt, every=every).start()
            try:
                for x, y in data:
                    opt.zero_grad()
                    F.cross_entropy(model(x), y).backward()
                    opt.step()
            finally:
                if w is not None:
                    w.close()

        return run

    everies = [int(e) if e.isdigit() else e for e in args.every.split(",")]
    variants = {"unwatched": training(None)}
    variants.update({f"every={e}": training(e) for e in everies})
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        bench_common.warm_up(variants, tmp)
        got = bench_common.rounds(variants, args.rounds, tmp, threads=args.threads)
    floor = got["unwatched"]
    rows = []
    for name, runs in got.items():
        r = bench_common.ratios(runs, floor)
        rows.append([name, f"{bench_common.median(runs):.2f}",
                     f"{sorted(r)[len(r) // 2]:.2f}", f"{min(r):.2f}-{max(r):.2f}"])  # fmt: skip
    head = [
        f"{args.model} ({'x'.join(map(str, shape))}, batch {args.batch}), SGD, {args.steps} "
        f"steps, {args.threads} threads, median of {args.rounds} interleaved rounds"
    ]
    print(bench_common.markdown(head, ["variant", "seconds", "ratio", "ratio range"], rows, []))


if __name__ == "__main__":
    main()
