"""Benchmark: gradcam + grad x output at many layers in one pass, against Captum and
pytorch-grad-cam called per layer (and per method), side by side in one process.

    python scripts/bench_attribution.py                       # resnet18, 8 blocks, 256 images
    python scripts/bench_attribution.py --layers 1 --images 128 --rounds 3

A seeded resnet18 (10 classes) over seeded images at --size px in batches of --batch; the logit
of the predicted class explained at each block output. Variants, interleaved per round after one
warm-up each: the pipeline (probes with capture [gradcam, grad_x_output], store=full, one
forward and backward per batch for every layer); Captum's LayerGradCam and
LayerGradientXActivation, one call per layer and batch; pytorch-grad-cam's GradCAM, one call per
layer and batch (it has no grad x activation). Values are checked equal once (ours raw against
Captum's raw maps). Peak RSS of one run of each in a fresh process, at --images and at half of
it: flat in the number of images means it streams.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import bench_common as bc  # first: it puts the repository root on sys.path

BLOCKS = [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)]
TARGET = 3.0  # the issue's: at least 3x the per-layer loops with 8 layers


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=8, help="blocks explained (1-8, last first)")
    p.add_argument("--images", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--size", type=int, default=112)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-rss", action="store_true")
    p.add_argument("--out", default=None, help="also write the table as markdown to OUT")
    p.add_argument("--one", help=argparse.SUPPRESS)  # subprocess: one run, print peak RSS
    return p.parse_args(argv)


def setup(args):
    from probe.testing.oracles import make_setup

    layers = BLOCKS[::-1][: args.layers]
    return make_setup([
        "model=resnet18", "model.num_classes=10", f"dataset.image_size={args.size}",
        f"dataset.num_samples={args.images}", f"dataset.batch_size={args.batch}",
        "probes=none", f"+probes.att.layers=[{','.join(layers)}]",
        "+probes.att.capture=[gradcam,grad_x_output]", "objective=logit",
        "objective.index=predicted", "seed=0",
    ]), layers  # fmt: skip


def variants(s, layers):
    import torch
    from captum.attr import LayerGradCam, LayerGradientXActivation
    from pytorch_grad_cam import GradCAM
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    from probe.testing import oracles

    model = s.model
    modules = [model.get_submodule(n) for n in layers]

    def predicted(x):
        with torch.no_grad():
            return model(x).argmax(1)

    def captum(out):
        got = {}
        for b in s.base.batches:
            target = predicted(b.inputs)
            for name, m in zip(layers, modules, strict=True):
                cam = LayerGradCam(model, m).attribute(b.inputs, target, relu_attributions=False)
                gxa = LayerGradientXActivation(model, m).attribute(b.inputs, target)
                got.setdefault(name, []).append((cam.detach()[:, 0], gxa.detach()))
        return got

    def grad_cam(out):
        for b in s.base.batches:
            targets = [ClassifierOutputTarget(int(k)) for k in predicted(b.inputs)]
            for m in modules:
                with GradCAM(model=model, target_layers=[m]) as cam:
                    cam(input_tensor=b.inputs, targets=targets)

    return {
        "probe": oracles.probe_case(s),
        "captum_per_layer": captum,
        "grad_cam_per_layer": grad_cam,
    }


def check(h5: Path, captum: dict) -> str:
    import h5py
    import numpy as np

    worst = 0.0
    with h5py.File(h5) as f:
        for name, parts in captum.items():
            cam = np.concatenate([c.numpy() for c, _ in parts])
            gxa = np.concatenate([g.numpy() for _, g in parts])
            for site, want in (("gradcam", cam), ("grad_x_output", gxa)):
                got = f[f"layers/{name}/{site}"][:]
                if not np.allclose(got, want, rtol=1e-4, atol=1e-6):
                    raise SystemExit(f"value check FAILED: {name} {site}")
                worst = max(worst, float(np.abs(got - want).max()))
    return f"values equal to Captum's (max |diff| {worst:.1e})"


def peak_rss(args, name: str, images: int) -> float | None:
    argv = [__file__, "--one", name, "--images", str(images), "--layers", str(args.layers),
            "--size", str(args.size), "--batch", str(args.batch)]  # fmt: skip
    if args.threads:
        argv += ["--threads", str(args.threads)]
    return bc.child_json(argv).get("peak_mb")


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    s, layers = setup(args)
    fns = variants(s, layers)
    tmp = Path(tempfile.mkdtemp(prefix="probe-bench-attribution-"))
    try:
        if args.one:
            base = bc.status_mb("VmRSS")
            bc.reset_peak()
            fns[args.one](tmp)
            print(json.dumps({"peak_mb": bc.peak_rss_mb() - base}))
            return
        warm = bc.warm_up(fns, tmp, keep={"probe"})
        verdict = check(tmp / "warm-probe" / "probe.h5", warm["captum_per_layer"])
        print(verdict, flush=True)
        times = bc.rounds(fns, args.rounds, tmp, torch.get_num_threads())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = []
    for name, runs in times.items():
        faster = statistics.median(bc.ratios(times[name], times["probe"]))
        rss = [None, None] if args.no_rss else [
            peak_rss(args, name, n) for n in (args.images // 2, args.images)
        ]  # fmt: skip
        rows.append([
            name, f"{bc.median(runs):.2f}", f"{args.images / bc.median(runs):.1f}",
            f"{faster:.2f}", *("-" if r is None else f"{r:.0f}" for r in rss),
        ])  # fmt: skip
    cols = ["variant", "median_s", "images_per_s", "x_probe_time", "rss_mb_half", "rss_mb_all"]
    head = (
        f"resnet18 at {args.size} px, {args.images} images in batches of {args.batch}, "
        f"{len(layers)} layers ({', '.join(layers)}), gradcam + grad_x_output, "
        f"{torch.get_num_threads()} threads, median of {args.rounds} interleaved rounds; "
        "x_probe_time: a variant's seconds over the pipeline's in the same round; rss_mb: peak "
        f"RSS above the set-up of one run in a fresh process at {args.images // 2} and "
        f"{args.images} images"
    )
    slowest = min(float(r[3]) for r in rows if r[0] != "probe")
    goal = TARGET if len(layers) >= 8 else 1.0
    target = (
        f"target: the per-layer loops at least {goal}x the pipeline's time: {slowest:.2f}x: "
        + ("met" if slowest >= goal else "NOT met")
    )
    lines = [head, verdict, *bc.table_lines(cols, rows), target]
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("# Attribution benchmark\n\n" + "\n\n".join(lines[:2]) + "\n\n"
                                  + "\n".join(lines[2:]) + "\n")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
