"""The CUDA path in one call: every CUDA test of the suite, then the GPU cases of the benchmarks,
one table of ratios, peak device memory and pass/fail.

    python scripts/device_check.py                       # on a machine with a GPU (a few minutes)
    python scripts/device_check.py --out docs/bench/device_check.md
    python scripts/device_check.py --device cpu --quick --skip-tests   # the script itself, on a CPU

Groups, each timed in interleaved rounds after one warm-up run per variant (whose files serve the
value checks and whose peak device memory is reported):
- `tests`: `pytest -m cuda` (statistics on the device against numpy, the GPU run against the CPU
  run, models split over the GPU and the CPU against whole ones).
- `image`: resnet18 every convolution; store full and stats with `stats.backend=auto` (reduced on
  the GPU by the fused reduction) against the host path (numba: every capture reduced on the CPU)
  and `stats_reference` (reduced on the GPU by the torch backend's reference path, the one before
  the fused reduction); ratios to a plain forward; stored values against plain hooks, device
  statistics against host statistics and against the reference path's.
- `tokens`: the GPT-2-shaped model of bench_tokens.py, its 6 block outputs one row per token, full,
  stats and stats_reference, against `output_hidden_states` + h5py; the same model with `model.dtype=bfloat16`
  (values against a bfloat16 forward) and split by a device map (half the blocks kept in CPU
  memory, moved in per call by accelerate; values against the whole model).
- `grid`: the patching grid of bench_patching.py (6 blocks x 32 positions, 64 pairs) with
  `intervene.grid.stack` 1 and 8 against a hand loop of plain hooks; cells are checked equal.
- `graph`: an attribution graph (a 4-block width-256 Llama with random TopK transcoders and skip
  matrices, a 64-token prompt, every edge kept) on the device against the same graph on the
  CPU: the same features and logit nodes, every adjacency entry within 1e-4 of the largest.
Exit status 1 when a check or the tests fail.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import bench_common as bc  # first: it puts the repository root on sys.path
import bench_patching
import h5py
import numpy as np
import torch

import probe
from probe.testing import oracles

COLS = ["group", "case", "median_s", "ratio", "to", "peak_gpu_mib", "check", "result"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default), or cpu to try the script")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="small sizes (a dry run of the script)")
    p.add_argument("--skip-tests", action="store_true", help="leave out pytest -m cuda")
    p.add_argument(
        "--groups", default="image,tokens,grid,watch,graph", help="which groups (default: all)"
    )
    p.add_argument("--out", default=None, help="also write the table as markdown to OUT")
    return p.parse_args(argv)


# -- timing: warm-up (peak memory, outputs kept for the checks), then interleaved rounds ----------
def measure(variants: dict[str, Callable], tmp: Path, rounds: int) -> tuple[dict, dict, dict]:
    """({name: [timed runs]}, {name: peak device MiB of its warm-up}, {name: warm-up result})."""
    peaks, results = {}, {}
    for name, fn in variants.items():
        out = tmp / f"warm-{name}"
        out.mkdir(parents=True, exist_ok=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        results[name] = fn(out)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            peaks[name] = torch.cuda.max_memory_allocated() / 2**20
    return bc.rounds(variants, rounds, tmp), peaks, results


def rows_of(group, times, peaks, floor: str, checks: dict[str, tuple[bool, str]]) -> list[list]:
    rows = []
    for name, runs in times.items():
        ratio = statistics.median(bc.ratios(runs, times[floor]))
        ok, why = checks.get(name, (True, "-"))
        peak = peaks.get(name)
        rows.append([group, name, f"{bc.median(runs):.3f}", f"{ratio:.3f}", floor,
                     "-" if peak is None else f"{peak:.0f}", why, "pass" if ok else "FAIL"])  # fmt: skip
    return rows


def plain(model, batches, device, grad: bool = False, **kw) -> Callable:
    def case(out):
        with torch.inference_mode() if not grad else contextlib.nullcontext():
            for b in batches:
                x = b.inputs if hasattr(b, "inputs") else b[0]
                if isinstance(x, dict):
                    model(**{k: v.to(device, non_blocking=True) for k, v in x.items()}, **kw)
                else:
                    model(x.to(device, non_blocking=True))

    return case


def hooked_outputs(model, names, batches, device, rows: bool = False, grad: bool = False
                   ) -> dict[str, np.ndarray]:  # fmt: skip
    """What plain forward hooks see at `names` (token models: one row per token), on the host;
    `grad`: forwards with gradients enabled (a training's)."""
    seen = {n: [] for n in names}

    def keep(n):
        def hook(m, a, o):
            o = o[0] if isinstance(o, tuple) else o
            o = o.reshape(-1, o.shape[-1]) if rows else o
            seen[n].append(o.detach().float().cpu())

        return hook

    handles = [model.get_submodule(n).register_forward_hook(keep(n)) for n in names]
    try:
        with torch.enable_grad() if grad else contextlib.nullcontext():
            plain(model, batches, device, grad=grad)(None)
    finally:
        for h in handles:
            h.remove()
    return {n: torch.cat(v).numpy() for n, v in seen.items()}


def stored_equal(h5: Path, want: dict, rtol: float, atol: float) -> tuple[bool, str]:
    worst = 0.0
    with h5py.File(h5) as f:
        for n, ref in want.items():
            got = f[f"layers/{n}/output"][:]
            if got.shape != ref.shape:
                return False, f"{n}: shape {got.shape} != {ref.shape}"
            if not np.allclose(got, ref, rtol=rtol, atol=atol):
                return False, f"{n}: max |diff| {np.abs(got - ref).max():.2e}"
            worst = max(worst, float(np.abs(got.astype(np.float64) - ref).max()))
    return True, f"values equal (max |diff| {worst:.1e})"


def reference_reduction(case: Callable) -> Callable:
    """The case with the torch backend's reference path reducing every capture on the device."""
    from probe.stats import torch_backend

    def run_it(out):
        torch_backend.use_reduction("reference")
        try:
            return case(out)
        finally:
            torch_backend.use_reduction(None)

    return run_it


def stats_equal(a: Path, b: Path, what: str = "device stats = host stats") -> tuple[bool, str]:
    """The /stats of two runs over the same values: counts and extremes equal, moments to 1e-9."""
    with probe.open_run(a) as left, probe.open_run(b) as right:
        for key in left.keys:
            s, t = left.stats(*key), right.stats(*key)
            if (s.n, s.min, s.max, s.zeros) != (t.n, t.min, t.max, t.zeros):
                return False, f"{key}: counts or extremes differ"
            if not np.allclose([s.mean, s.m2], [t.mean, t.m2], rtol=1e-9, atol=0):
                return False, f"{key}: moments differ beyond 1e-9"
            if not np.array_equal(s.hist.counts, t.hist.counts):
                return False, f"{key}: histograms differ"
    return True, what


# -- the groups --------------------------------------------------------------------------------
def image_group(args, tmp: Path) -> list[list]:
    size, batch, n = (32, 4, 8) if args.quick else (112, 32, 512)
    setup = oracles.make_setup([
        "model=resnet18", f"dataset.image_size={size}", f"dataset.num_samples={n}",
        f"dataset.batch_size={batch}", "probes=all_convs", f"device={args.device}",
    ])  # fmt: skip
    host = "stats.backend=numba" if args.device != "cpu" else "stats.backend=torch"
    variants = {
        "plain": plain(setup.model, setup.base.batches, args.device),
        "full": oracles.probe_case(setup, "store=full"),
        "full_host_stats": oracles.probe_case(setup, "store=full", host),
        "stats": oracles.probe_case(setup, "store=stats"),
        "stats_host": oracles.probe_case(setup, "store=stats", host),
        "stats_reference": reference_reduction(oracles.probe_case(setup, "store=stats")),
    }
    times, peaks, out = measure(variants, tmp / "image", args.rounds)
    want = hooked_outputs(setup.model, setup.names, setup.base.batches, args.device)
    checks = {
        "full": stored_equal(out["full"], want, 1e-5, 1e-5),
        "full_host_stats": stats_equal(out["full"].parent, out["full_host_stats"].parent),
        "stats_host": stats_equal(out["stats"].parent, out["stats_host"].parent),
        "stats_reference": stats_equal(
            out["stats"].parent, out["stats_reference"].parent, "fused stats = reference stats"
        ),
    }
    return rows_of("image", times, peaks, "plain", checks)


def token_setup(args, tmp: Path, *extra: str):
    n, t = (16, 16) if args.quick else (256, 128)
    model_dir, ids = tmp / "gpt2", tmp / "ids.pt"
    if not model_dir.exists():
        bc.save_gpt2(model_dir, t, 0)
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, bc.VOCAB, (n, t), generator=g)
        torch.save({"input_ids": x, "attention_mask": torch.ones_like(x)}, ids)
    return oracles.make_setup([
        "model=hf", f"model.name={model_dir}", "model.task=causal_lm", "dataset=tokens",
        f"dataset.path={ids}", "dataset.batch_size=32" if not args.quick else "dataset.batch_size=8",
        "probes=residual", f"device={args.device}", *extra,
    ])  # fmt: skip


def hidden_states(setup, device) -> Callable:
    import bench_tokens

    def case(out):
        sink = bench_tokens.RowSink(out / "hidden.h5")
        try:
            with torch.inference_mode():
                for b in setup.base.batches:
                    x = {k: v.to(device, non_blocking=True) for k, v in b.inputs.items()}
                    for i, h in enumerate(
                        setup.model(**x, output_hidden_states=True).hidden_states[1:]
                    ):
                        sink.append(f"hidden_states.{i + 1}", h)
        finally:
            sink.close()

    return case


def token_group(args, tmp: Path) -> list[list]:
    root = tmp / "tokens"
    root.mkdir(parents=True, exist_ok=True)
    setup = token_setup(args, root)
    names = setup.names
    variants = {
        "plain": plain(setup.model, setup.base.batches, args.device),
        "hidden_states+h5py": hidden_states(setup, args.device),
        "full": oracles.probe_case(setup, "store=full"),
        "stats": oracles.probe_case(setup, "store=stats"),
        "stats_reference": reference_reduction(oracles.probe_case(setup, "store=stats")),
    }
    times, peaks, out = measure(variants, root / "runs", args.rounds)
    want = hooked_outputs(setup.model, names, setup.base.batches, args.device, rows=True)
    checks = {
        "full": stored_equal(out["full"], want, 1e-5, 1e-5),
        "stats_reference": stats_equal(
            out["stats"].parent, out["stats_reference"].parent, "fused stats = reference stats"
        ),
    }
    rows = rows_of("tokens", times, peaks, "plain", checks)
    # the same model in bfloat16, and split by a device map (blocks 3-5 kept in CPU memory)
    half = token_setup(args, root, "model.dtype=bfloat16")
    gpu, away = (0, "cpu") if args.device == "cuda" else ("cpu", "disk")  # (a CPU: disk)
    blocks = {f"transformer.h.{i}": (gpu if i < 3 else away) for i in range(bc.LAYERS)}
    top = {k: gpu for k in ("transformer.wte", "transformer.wpe", "transformer.drop",
                            "transformer.ln_f", "lm_head")}  # fmt: skip
    mapping = "{" + ",".join(f"{k}:{v}" for k, v in {**top, **blocks}.items()) + "}"
    variants = {
        "plain_bf16": plain(half.model, half.base.batches, args.device),
        "full_bf16": oracles.probe_case(half, "store=full"),
    }
    split = token_setup(
        args, root, f"model.device_map={mapping}", f"model.offload_folder={root / 'offload'}"
    )
    variants["full_whole"] = oracles.probe_case(setup, "store=full")
    variants["full_split"] = oracles.probe_case(split, "store=full")
    times, peaks, out = measure(variants, root / "half", args.rounds)
    want_half = hooked_outputs(half.model, names, half.base.batches, args.device, rows=True)
    checks = {"full_bf16": stored_equal(out["full_bf16"], want_half, 0, 0)}
    pick = {k: times[k] for k in ("plain_bf16", "full_bf16")}
    rows += rows_of("tokens", pick, peaks, "plain_bf16", checks)
    checks["full_split"] = stored_equal(out["full_split"], want, 1e-5, 1e-5)
    pick = {k: times[k] for k in ("full_whole", "full_split")}
    rows += rows_of("tokens", pick, peaks, "full_whole", checks)
    return rows


def grid_group(args, tmp: Path) -> list[list]:
    from probe.launch.run import build_run, run
    from probe.testing.compose import make_cfg

    root = tmp / "grid"
    root.mkdir(parents=True, exist_ok=True)
    pairs_n, seq = (8, 8) if args.quick else (64, 32)
    ns = argparse.Namespace(pairs=pairs_n, seq_len=seq, seed=0)
    model_dir, pairs_path, pairs = bench_patching.write_assets(root, ns)
    common = ["model=hf", f"model.name={model_dir}", "model.task=causal_lm", "dataset=pairs",
              f"dataset.path={pairs_path}", f"dataset.batch_size={pairs_n}", "probes=none",
              "intervene=patch_grid", "intervene.metrics=[logit_diff]", f"device={args.device}"]  # fmt: skip
    cfgs = {k: make_cfg(*common, f"intervene.grid.stack={k}") for k in (1, 8)}
    prepared = build_run(cfgs[1])
    model = prepared.model.to(args.device).eval()
    ids = {k: pairs[k].to(args.device) for k in ("clean_ids", "corrupt_ids")}

    def hand(out):  # (the logits come back to the host, where the answer ids are)
        return bench_patching.hand_loop(_HostLogits(model), {**pairs, **ids})

    variants = {
        "hand_loop": hand,
        "stack_1": lambda out: run(cfgs[1], run_dir=out, prepared=prepared).run_dir,
        "stack_8": lambda out: run(cfgs[8], run_dir=out, prepared=prepared).run_dir,
    }
    times, peaks, out = measure(variants, root / "runs", args.rounds)
    ref = out["hand_loop"]
    checks = {}
    for name in ("stack_1", "stack_8"):
        with h5py.File(out[name] / "probe.h5") as f:
            got = f["patching/logit_diff"][:]
            cells = json.loads(f.attrs["patching_cells"])
        order = [int(c["layer"].rsplit(".", 1)[1]) * seq + c["position"] for c in cells]
        want = ref["cells"][order].T
        ok = got.shape == want.shape and np.allclose(got, want, rtol=1e-4, atol=1e-5)
        err = float(np.abs(got - want).max()) if got.shape == want.shape else float("nan")
        checks[name] = (ok, f"cells = hand loop (max |diff| {err:.1e})")
    rows = rows_of("grid", times, peaks, "hand_loop", checks)
    work = bc.LAYERS * seq * pairs_n
    for r in rows:
        r[1] += f" ({work / float(r[2]):,.0f} cells x pairs/s)"
    return rows


def watch_group(args, tmp: Path) -> list[list]:
    """bench_watch.py's training (resnet18; the tests' small CNN with --quick) watched at
    every=1 against the same training unwatched. Both run deterministic kernels (cuDNN's), so the
    watched one must end with bitwise the unwatched one's weights, buffers and optimizer state;
    train.csv's step-0 values of the first convolution's output equal a plain forward hook's on
    the first batch of a fresh model of the same seed."""
    import bench_watch
    import torch.nn.functional as F

    from probe.testing.trainings import one_thread, state_of, train

    name, steps = ("cnn", 4) if args.quick else ("resnet18", 30)
    make, optimizer, batches, _, probes = bench_watch.setup(name, steps)
    batches = [(x.to(args.device), y.to(args.device)) for x, y in batches]
    first = next(n for n, m in make().named_modules() if isinstance(m, torch.nn.Conv2d))

    def loss(model, batch):
        return F.cross_entropy(model(batch[0]), batch[1])

    def training(watched: bool) -> Callable:
        def case(out):
            torch.manual_seed(0)
            model = make().to(args.device)
            opt = optimizer(model)
            watch = {"probes": probes, "out": out / "run", "every": 1} if watched else None
            train(model, opt, batches, loss, watch)
            return out / "run", state_of(model, opt)

        return case

    variants = {"unwatched": training(False), "watched_every_1": training(True)}
    deterministic = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        with one_thread() if args.device == "cpu" else contextlib.nullcontext():
            times, peaks, out = measure(variants, tmp / "watch", args.rounds)
            torch.manual_seed(0)
            hooked = hooked_outputs(make().to(args.device).train(), [first], batches[:1],
                                    args.device, grad=True)[first]  # fmt: skip
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = deterministic
    (_, plain_state), (run, watched_state) = out["unwatched"], out["watched_every_1"]
    same = plain_state.keys() == watched_state.keys() and all(
        torch.equal(plain_state[k], watched_state[k]) for k in plain_state
    )
    with probe.open_run(run) as r:
        rows = r.train()
    row = rows[(rows.step == 0) & (rows.layer == first) & (rows.site == "output")].iloc[0]
    want = {"max": float(hooked.max()), "mean": float(hooked.astype(np.float64).mean())}
    csv_ok = (
        row["max"] == want["max"]
        and np.isclose(row["mean"], want["mean"], rtol=1e-6, atol=0)
        and len(rows[rows.step == steps - 1]) > 0
    )
    checks = {
        "watched_every_1": (
            same and csv_ok,
            ("weights bitwise = unwatched" if same else "weights differ from unwatched")
            + f"; train.csv {first} output max {row['max']:.6g} "
            + ("= hook's" if csv_ok else f"!= hook's {want['max']:.6g} (or mean differs)"),
        )
    }
    return rows_of("watch", times, peaks, "unwatched", checks)


class _HostLogits:
    """The model with its logits handed back on the host (the hand loop reads them with numpy)."""

    def __init__(self, model):
        self.model, self.transformer = model, model.transformer

    def __call__(self, **kw):
        out = self.model(**kw)
        out.logits = out.logits.cpu()
        return out


def cuda_tests() -> list[list]:
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-m", "cuda", "-p", "no:cacheprovider", "tests"],
        cwd=bc.ROOT, capture_output=True, text=True,
    )  # fmt: skip
    tail = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-300:]
    print(done.stdout[-4000:], flush=True)
    passed = int(m.group(1)) if (m := re.search(r"(\d+) passed", tail)) else 0
    # a module that needs a comparison library absent here is skipped whole, and with it no CUDA
    # test (those live apart from the library comparisons); any other skip is a CUDA test not run
    skips = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED")]
    ok = done.returncode == 0 and passed > 0 and all("could not import" in s for s in skips)
    return [["tests", "pytest -m cuda", f"{time.perf_counter() - t0:.1f}", "-", "-", "-",
             tail.strip("= "), "pass" if ok else "FAIL"]]  # fmt: skip


def graph_group(args, tmp: Path) -> list[list]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from probe.graphs.attribution import GraphOptions, attribute
    from probe.testing.random_transcoders import random_transcoders

    layers, width, length = (2, 64, 16) if args.quick else (4, 256, 64)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=2048, hidden_size=width, intermediate_size=4 * width,
                         num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=2048)  # fmt: skip
    config._attn_implementation = "eager"
    models = {"cpu": LlamaForCausalLM(config).eval()}
    models[args.device] = LlamaForCausalLM(config).to(args.device).eval()
    models[args.device].load_state_dict(models["cpu"].state_dict())
    sets = {}
    for where in models:
        ts = random_transcoders(width, layers, activation="topk", skip=True, expansion=8)
        for t in ts.transcoders.values():
            t.k = 4
        sets[where] = ts.to(where)
    tokens = torch.randint(0, 2048, (length,), generator=torch.Generator().manual_seed(1))
    options = GraphOptions(batch_size=64, floor=0.0)
    variants = {where: (lambda out, where=where: attribute(models[where], tokens, sets[where],
                                                           options))  # fmt: skip
                for where in models}  # fmt: skip
    times, peaks, graphs = measure(variants, tmp / "graph", min(args.rounds, 2))
    ref, got = graphs["cpu"], graphs[args.device]
    same = torch.equal(ref.features.cpu(), got.features.cpu()) and torch.equal(
        ref.logit_tokens.cpu(), got.logit_tokens.cpu()
    )
    checks = {}
    if same:
        a, b = ref.adjacency.to_dense().cpu(), got.adjacency.to_dense().cpu()
        err = float((a - b).abs().max() / a.abs().max())
        checks[args.device] = (err <= 1e-4, f"graph = CPU graph ({ref.n_nodes} nodes, {err:.1e})")
    else:
        checks[args.device] = (False, "other features or logit nodes than the CPU graph")
    return rows_of("graph", times, peaks, "cpu", checks)


GROUPS = {"image": image_group, "tokens": token_group, "grid": grid_group, "watch": watch_group,
          "graph": graph_group}  # fmt: skip


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("device_check: no CUDA device here; --device cpu runs the script on the CPU")
        return 2
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    head = f"device check on {name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"
    print(head, flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="probe-device-check-"))
    rows = [] if args.skip_tests else cuda_tests()
    try:
        chosen = args.groups.split(",")
        for group in [GROUPS[g] for g in chosen]:
            t0 = time.perf_counter()
            rows += group(args, tmp)
            print(f"{group.__name__}: {time.perf_counter() - t0:.1f} s", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    lines = bc.table_lines(COLS, rows)
    notes = [
        "ratio: median over rounds of the case's seconds over its `to` case's in the same round",
        "peak_gpu_mib: torch.cuda.max_memory_allocated over the case's warm-up run",
    ]
    print("\n".join([head, *lines, *notes]))
    if args.out:
        Path(args.out).write_text(
            "\n".join([f"# {head}", "", *lines, "", *(f"- {n}" for n in notes)]) + "\n"
        )
    return 0 if all(r[-1] == "pass" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
