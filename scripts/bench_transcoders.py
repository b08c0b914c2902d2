"""Benchmark: probe's transcoder fit against EleutherAI's sparsify (and SAELens, where it can) at
one budget, every trained set measured by one evaluation.

    PYTHONPATH=. bench-venv/bin/python scripts/bench_transcoders.py --out docs/bench/transcoders.md
    ... --samples 2048 --epochs 10 --width 256 --k 8 --probe topk,batchtopk

It runs in an environment holding the peers too (probe itself, `eai-sparsify`, `sae-lens`: see
docs/bench/transcoders.md for the setup). Steps, all into `--work`:

1. The model: probe.testing.planted's tiny GPT-2 whose MLPs are ReLU dictionaries of known
   directions when that module exists (`--model planted`), else a stand-in (`--model tiny`: the
   random 2-block GPT-2 of probe.testing.tiny_lms). Its tokens are sampled from the model itself.
2. One capture of every block's MLP input and output (`python -m probe ... probes=mlp_io`): the
   cached rows. The held-out samples are probe.fit's (`held_out`, test fraction 0.1, seed 0).
3. The trainers, one after the other in fresh processes, at the same budget: the same training
   samples, the same number of passes over them (`--epochs`), width, k and rows per step.
   - probe: `python -m probe.fit RUN --activation A --k K --width W --epochs E` over the cached rows.
   - sparsify: its own `Trainer` (TopK `SparseCoder` with `transcode=True`, its default optimizer
     and learning rate) on the same model and the same training samples, `--epochs` passes of
     them shuffled per pass; its API takes token ids and computes the rows with the model's
     forward pass, so it cannot be fed cached rows. Its rows per second include that forward.
   - SAELens: the script asks its registry which architectures it trains; it has no training
     class for a transcoder (its Transcoder classes load and run trained ones only), so nothing is
     trained and the table says so.
4. One evaluation of every set, exported to probe's transcoder files: held-out FVU, L0 and dead
   share (probe.analysis.fit.measures.evaluate) per layer, and the next-token loss with each
   layer's MLP output replaced by the transcoder's (forward hooks on the held-out samples):
   ce_clean, ce_spliced, ce_zero (the MLP's output zeroed), ce_recovered = (ce_zero - ce_spliced)
   / (ce_zero - ce_clean), kl = mean per-token KL(clean || spliced), and a row `all` with every
   layer replaced at once.

Rows per second: training rows of every layer over the trainer command's wall seconds (process
start and import included, the same for each), and over its own training seconds.

Speed only (`--speed ROUNDS`): after the capture, ROUNDS interleaved rounds of each trainer's
command (probe's per activation of `--probe`, also with `--no-losses` given
`--speed-no-losses`, `--baseline DIR`'s probe.fit where given, sparsify's child), each at the
budget and at `--speed-floor` passes (its fixed cost: imports, the model, probe's held-out
measures; a step or two of training), one thread each (OMP_NUM_THREADS=1). A
command's CPU seconds are its process's (and its children's) user + system time, so other work on
the machine changes them little; rows per CPU second over the whole command, and over the budget's
CPU seconds less the floor's (the training's own cost); no evaluation. `--speed-reuse` times on
the model, ids.pt and run/ an earlier run of the script left in `--work` (no new capture).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import bench_common as bc  # first: it puts the repository root on sys.path

SEQ = 32
HEADER = "# Transcoders: probe's fit side by side with sparsify and SAELens"
SETUP = """The peers live in their own environment, beside probe (torch pinned: nothing else moves it):

```bash
python3.11 -m venv bench-venv
bench-venv/bin/pip install torch==2.14.1 torchvision==0.29.1 transformers==5.24.0 \\
    h5py pandas hydra-core safetensors
echo torch==2.14.1 > constraints.txt
bench-venv/bin/pip install -c constraints.txt eai-sparsify sae-lens
PYTHONPATH=. bench-venv/bin/python scripts/bench_transcoders.py --out docs/bench/transcoders.md
```

Every trainer trains on the same model's rows at the same budget; every trained set is exported
to probe's transcoder files and measured by the same evaluation, `python -m probe.fit --evaluate
SET RUN` (held-out FVU, L0, dead share, and the next-token loss with the transcoder spliced in).
The planted MLPs themselves, written as a transcoder set, are the reference row: a perfect
transcoder scores fvu 0, ce_recovered 1, kl 0 and finds every planted direction."""


# -- the model and its tokens ------------------------------------------------------------------
def build_model(kind: str, root: Path, samples: int, seed: int) -> dict:
    """The model in root/model and `samples` x SEQ token ids sampled from it in root/ids.pt; what
    was built (for the report) and, for the planted model, its planted encoder directions."""
    import torch

    if kind == "planted":
        from probe.testing.planted import PlantedSpec, make_planted

        spec = PlantedSpec(sequences=samples, length=SEQ, seed=seed)
        planted = make_planted(root, spec)
        rates = ", ".join(f"{float(r.sum()):.1f}" for r in planted.fire_rates.values())
        return {"model": f"the planted GPT-2 (probe.testing.planted, PlantedSpec(sequences="
                f"{samples}, seed={seed})): {spec.n_layer} blocks, d_model {spec.d_model}, "
                f"ReLU MLPs of {spec.n_inner} planted units, vocab {spec.vocab_size}; planted "
                f"L0 (mean active units a token) per block: {rates}; tokens sampled from it",
                "encoders": planted.encoders}  # fmt: skip
    from transformers import AutoModelForCausalLM

    from probe.testing.tiny_lms import make_tiny

    make_tiny("gpt2", root / "model", vocab_size=100)
    model = AutoModelForCausalLM.from_pretrained(root / "model").eval()
    ids = sample_tokens(model, samples, SEQ, seed)
    torch.save({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, root / "ids.pt")
    cfg = model.config
    return {"model": f"a stand-in: tiny random GPT-2 (probe.testing.tiny_lms.make_tiny): "
            f"{cfg.n_layer} blocks, d_model {cfg.n_embd}, MLP {4 * cfg.n_embd} "
            f"({cfg.activation_function}), vocab {cfg.vocab_size}; tokens sampled from it (its "
            "MLPs barely matter to the loss: ce_recovered is noise)", "encoders": None}  # fmt: skip


def sample_tokens(model, samples: int, seq: int, seed: int):
    """`samples` sequences of `seq` ids sampled from `model` (temperature 1), the first id
    uniform."""
    import torch

    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (samples, 1), generator=g)
    with torch.no_grad():
        for _ in range(seq - 1):
            probs = model(ids).logits[:, -1].double().softmax(-1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=g)], 1)
    return ids


# -- the trainers ------------------------------------------------------------------------------
def run_timed(argv: list[str], log: Path, env: dict | None = None) -> float:
    """Run `argv` with this interpreter, stdout and stderr into `log`; its wall seconds."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run([sys.executable, *argv], stdout=f, stderr=subprocess.STDOUT,
                              cwd=bc.ROOT, env={**os.environ, **(env or {})})  # fmt: skip
    wall = time.perf_counter() - t0
    if done.returncode:
        tail = log.read_text().strip().splitlines()[-15:]
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}):\n" + "\n".join(tail))
    return wall


def run_cpu(argv: list[str], log: Path, env: dict | None = None, cwd: Path | None = None) -> float:
    """Run `argv` as run_timed does (in `cwd`, else the repository); the CPU seconds (user +
    system) of its process and the processes it waited for."""
    import resource

    def spent() -> float:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    before = spent()
    t0 = time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run([sys.executable, *argv], stdout=f, stderr=subprocess.STDOUT,
                              cwd=cwd or bc.ROOT, env={**os.environ, **(env or {})})  # fmt: skip
    if done.returncode:
        tail = log.read_text().strip().splitlines()[-15:]
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}):\n" + "\n".join(tail))
    log.with_suffix(".wall").write_text(f"{time.perf_counter() - t0:.2f}")
    return spent() - before


def speed(args, work: Path, run_dir: Path, model_dir: Path, ids_path: Path) -> str:
    """`--speed`: the CPU seconds of every trainer's command at the budget and at the floor,
    in interleaved rounds; the report's markdown."""

    import pandas as pd

    one = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    trainers: dict[str, tuple] = {}  # name -> (argv for a budget, env, cwd, rows of a run)

    def probe_fit(act: str, root: Path | None, tag: str, extra: tuple[str, ...] = ()):
        def argv(epochs: float, out: Path) -> list[str]:
            return ["-m", "probe.fit", str(run_dir), "--activation", act, "--width",
                    str(args.width), "--k", str(args.k), "--epochs", str(epochs), "--batch-size",
                    str(args.batch_rows), "--workers", "1", *extra, "--out", str(out)]  # fmt: skip

        def rows(out: Path) -> int:
            return int(pd.read_csv(out / "fit.csv").rows.sum())

        env = {**one, "PYTHONPATH": str(root or bc.ROOT)}
        trainers[" ".join((tag, act, *extra))] = (argv, env, root, rows)

    for act in [a for a in args.probe.split(",") if a]:
        probe_fit(act, None, "probe")
        if args.speed_no_losses:
            probe_fit(act, None, "probe", ("--no-losses",))
        if args.baseline:
            probe_fit(act, Path(args.baseline).resolve(), "probe baseline")

    def sparsify_argv(epochs: float, out: Path) -> list[str]:
        return [str(Path(__file__).resolve()), "--sparsify-child", "--model-dir", str(model_dir),
                "--ids", str(ids_path), "--run", str(run_dir), "--set-out", str(out), "--epochs",
                str(epochs), "--width", str(args.width), "--k", str(args.k), "--batch-rows",
                str(args.batch_rows), "--seed", str(args.seed)]  # fmt: skip

    def sparsify_rows(out: Path) -> int:
        child = json.loads([ln for ln in (out.parent / f"{out.name}.log").read_text().splitlines()
                            if ln.startswith('{"seconds"')][-1])  # fmt: skip
        return child["rows_per_layer"] * child["layers"]

    trainers["sparsify topk"] = (sparsify_argv, {**one, "SPARSIFY_DISABLE_TRITON": "1"}, None,
                                 sparsify_rows)  # fmt: skip
    results: list[dict] = []
    for rnd in range(args.speed):
        for name, (argv, env, cwd, rows) in trainers.items():
            got = {"round": rnd + 1, "trainer": name}
            for part, epochs in (("budget", args.epochs), ("floor", args.speed_floor)):
                out = work / "speed" / f"{name.replace(' ', '_')}_{rnd}_{part}"
                shutil.rmtree(out, ignore_errors=True)
                out.parent.mkdir(parents=True, exist_ok=True)
                got[f"load_{part}"] = os.getloadavg()[0]
                got[f"cpu_{part}"] = run_cpu(argv(epochs, out), out.parent / f"{out.name}.log",
                                             env=env, cwd=cwd)  # fmt: skip
                got[f"rows_{part}"] = rows(out)
            print(json.dumps(got), flush=True)
            results.append(got)
            (work / "speed.json").write_text(json.dumps(results, indent=1))
    return speed_report(results, args)


def speed_report(results: list[dict], args) -> str:
    """The markdown of `--speed`'s rounds (`results`: one dict a trainer and round, as
    speed.json holds them; rounds without sparsify's run are left out)."""
    import statistics

    for r in results:
        r["rate"] = r["rows_budget"] / r["cpu_budget"]
        r["training_rate"] = (r["rows_budget"] - r["rows_floor"]) / (
            r["cpu_budget"] - r["cpu_floor"]
        )
    peer = {r["round"]: r for r in results if r["trainer"] == "sparsify topk"}
    results = [r for r in results if r["round"] in peer]
    names = list(dict.fromkeys(r["trainer"] for r in results))
    cols = ["round", "trainer", "rows", "CPU s", "rows / CPU s", "vs sparsify",
            "floor CPU s", "training CPU s", "training rows / CPU s", "vs sparsify (training)"]  # fmt: skip
    lines = []
    for r in results:
        p = peer[r["round"]]
        lines.append([r["round"], r["trainer"], f"{r['rows_budget']:,}", fmt(r["cpu_budget"], 2),
                      f"{r['rate']:,.0f}", fmt(r["rate"] / p["rate"], 2), fmt(r["cpu_floor"], 2),
                      fmt(r["cpu_budget"] - r["cpu_floor"], 2), f"{r['training_rate']:,.0f}",
                      fmt(r["training_rate"] / p["training_rate"], 2)])  # fmt: skip
    medians = []
    for name in names:
        mine = [r for r in results if r["trainer"] == name]
        whole = statistics.median(r["rate"] / peer[r["round"]]["rate"] for r in mine)
        train = statistics.median(r["training_rate"] / peer[r["round"]]["training_rate"]
                                  for r in mine)  # fmt: skip
        medians.append(f"{name}: median over rounds of its ratio to sparsify's in the same "
                       f"round: {whole:.2f} over the whole command, {train:.2f} over the "
                       "training")  # fmt: skip
    loads = [r[f"load_{part}"] for r in results for part in ("budget", "floor")]
    notes = [
        f"budget: width {args.width}, k {args.k}, {args.epochs:g} passes over the training "
        f"samples, {args.batch_rows} rows a step; floor: {args.speed_floor:g} passes",
        "CPU s: user + system seconds of the command's process (resource.getrusage of the "
        "children), one thread each; training CPU s: the budget's less the floor's (what the "
        "training's rows cost beyond the fixed part: imports, the model, probe's held-out "
        "measures and loss measures, sparsify's model load)",
        "probe's rows: training rows of fit.csv; sparsify's: its child's rows a layer x layers "
        "(position 0 included; its rows come from the model's forward pass, in its CPU s)",
        *medians,
        f"load average (1 min) before the commands: {min(loads):.1f} to {max(loads):.1f}",
    ]
    head = ["## Speed: CPU seconds side by side", "",
            f"Measured {datetime.date.today()}, {machine()}.",
            "Versions: " + ", ".join(f"{k} {v}" for k, v in versions().items())]  # fmt: skip
    return bc.markdown(head, cols, lines, notes)


def sparsify_child(args) -> None:
    """Train sparsify's TopK transcoders with its own Trainer on the model's training samples;
    export them as probe's transcoder set into args.set_out; print one JSON line."""
    import torch
    from sparsify import SparseCoderConfig, TrainConfig, Trainer
    from transformers import AutoModelForCausalLM

    import probe
    from probe.analysis.fit.fit_sites import held_out
    from probe.models.transcoder import Transcoder
    from probe.models.transcoder_files import write_set_config, write_transcoder

    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir).eval()
    ids = torch.load(args.ids)["input_ids"]
    with probe.open_run(args.run) as run:
        num_samples = run.num_samples
    train = ids[~held_out(torch.arange(len(ids)).numpy(), num_samples, 0.1, args.seed)]
    g = torch.Generator().manual_seed(args.seed)
    whole, part = int(args.epochs), args.epochs - int(args.epochs)
    order = [torch.randperm(len(train), generator=g) for _ in range(math.ceil(args.epochs))]
    if part:
        order[-1] = order[-1][: round(part * len(train))]
    rows = torch.cat([train[o] for o in order[: whole + (1 if part else 0)]])
    dataset = [{"input_ids": r} for r in rows]
    cfg = TrainConfig(
        SparseCoderConfig(activation="topk", num_latents=args.width, k=args.k, transcode=True),
        batch_size=args.batch_rows // SEQ, hookpoints=["h.*.mlp"], log_to_wandb=False,
        save_dir=str(Path(args.set_out) / "sparsify_checkpoints"), save_every=10**9,
        init_seeds=[args.seed],
    )  # fmt: skip
    trainer = Trainer(cfg, dataset, model)
    t0 = time.perf_counter()
    trainer.fit()
    seconds = time.perf_counter() - t0
    for opt in trainer.optimizers:  # schedule-free: the averaged weights, as its save() writes
        if hasattr(opt, "eval"):
            opt.eval()
    out = Path(args.set_out)
    transcoders = {}
    for name, sae in trainer.saes.items():
        layer = int(name.split(".")[1])
        t = Transcoder(sae.encoder.weight.detach().T.contiguous(), sae.encoder.bias.detach(),
                       sae.W_dec.detach().clone(), sae.b_dec.detach().clone(), layer=layer,
                       activation="topk", k=args.k,
                       W_skip=None if sae.W_skip is None else sae.W_skip.detach())  # fmt: skip
        write_transcoder(t, out / f"layer_{layer}.safetensors")
        transcoders[layer] = t
    write_set_config(out, transcoders, "mlp_in", None,
                     {i: f"sparsify-topk-{i}" for i in transcoders})  # fmt: skip
    print(json.dumps({"seconds": seconds, "rows_per_layer": len(rows) * SEQ,
                      "layers": len(transcoders), "optimizer": cfg.optimizer,
                      "lr": [pg["lr"] for pg in trainer.optimizers[0].param_groups],
                      "auxk_alpha": cfg.auxk_alpha}))  # fmt: skip


def saelens_trainable() -> dict:
    """What SAELens trains: its registered training architectures, and whether one of them is a
    transcoder (its `Transcoder` classes are SAE subclasses for inference)."""
    try:
        import sae_lens
        from sae_lens.registry import SAE_TRAINING_CLASS_REGISTRY
    except ImportError as e:
        return {"version": None, "error": str(e)}
    names = sorted(SAE_TRAINING_CLASS_REGISTRY)
    return {"version": sae_lens.__version__, "trains": names,
            "transcoder": any("transcoder" in n for n in names)}  # fmt: skip


# -- one evaluation ----------------------------------------------------------------------------
def evaluate_set(set_dir: Path, run_dir: Path, model_dir: Path, ids_path: Path, seed: int,
                 encoders: dict | None, work: Path) -> list[dict]:  # fmt: skip
    """Per layer and `all`: probe's evaluation of the set (`python -m probe.fit --evaluate SET
    RUN`: held-out fvu, l0, dead, ce_clean, ce_spliced, ce_zero, ce_recovered, kl), the share of
    planted directions found by an encoder row (planted model), and the same loss measures
    computed again here with plain forward hooks (`hooks_*`)."""
    import pandas as pd
    import torch
    from transformers import AutoModelForCausalLM

    import probe
    from probe.analysis.fit.fit_sites import held_out
    from probe.models.transcoder_files import load_transcoders
    from probe.testing.planted import directions_found

    csv = work / f"evaluate_{set_dir.name}.csv"
    argv = ["-m", "probe.fit", "--evaluate", str(set_dir), str(run_dir), "--seed", str(seed),
            "--out", str(csv)]  # fmt: skip
    run_timed(argv, work / f"evaluate_{set_dir.name}.log")
    rows = pd.read_csv(csv).to_dict("records")
    tset = load_transcoders(set_dir, dtype=torch.float32)
    with probe.open_run(run_dir) as run:
        tok = run.tokens()
        num_samples = run.num_samples
    ids = torch.load(ids_path)["input_ids"]
    if not bool((ids[tok["sample"].to_numpy(), tok["position"].to_numpy()]
                 == torch.as_tensor(tok["id"].to_numpy().copy())).all()):  # fmt: skip
        raise SystemExit(f"{run_dir}'s token rows are not {ids_path}'s ids: sample index")
    test_ids = ids[held_out(torch.arange(len(ids)).numpy(), num_samples, 0.1, seed)]
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    layers = sorted(tset.transcoders)
    for r in rows:
        chosen = layers if r["layer"] == "all" else [int(r["layer"])]
        hooks = spliced_losses(model, test_ids, tset, chosen)
        r.update({f"hooks_{k}": v for k, v in hooks.items()})
        if encoders is not None and r["layer"] != "all":
            t = tset[int(r["layer"])]
            r["found"] = directions_found(encoders[t.layer].double(), t.W_enc.detach().T.double())
    return rows


def planted_mlp_set(model_dir: Path, out: Path) -> Path:
    """The planted model's own MLPs written as a relu transcoder set (W_enc = c_fc, W_dec =
    c_proj): the reference every measure should score perfectly (fvu 0, ce_recovered 1)."""
    import torch
    from transformers import AutoModelForCausalLM

    from probe.models.transcoder import Transcoder
    from probe.models.transcoder_files import write_set_config, write_transcoder

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    transcoders = {}
    for i, block in enumerate(model.transformer.h):
        fc, proj = block.mlp.c_fc, block.mlp.c_proj  # Conv1D: x @ weight + bias
        t = Transcoder(fc.weight.detach().clone(), fc.bias.detach().clone(),
                       proj.weight.detach().clone(), proj.bias.detach().clone(), layer=i,
                       activation="relu")  # fmt: skip
        write_transcoder(t, out / f"layer_{i}.safetensors")
        transcoders[i] = t
    with torch.no_grad():
        write_set_config(out, transcoders, "mlp_in", None, {i: f"planted-{i}" for i in transcoders})
    return out


def spliced_losses(model, ids, tset, layers: list[int]) -> dict:
    """ce_clean, ce_spliced, ce_zero, ce_recovered and kl over every next-token prediction of
    `ids`, with the MLP output of each of `layers` replaced by its transcoder's (or zeroed)."""
    import torch

    mlps = {i: model.transformer.h[i].mlp for i in layers}

    def logits(mode: str) -> torch.Tensor:
        def hook(module, inputs, output):
            if mode == "zero":
                return torch.zeros_like(output)
            t = tset.transcoders[owner[module]]
            return t(inputs[0]).to(output.dtype)

        owner = {m: i for i, m in mlps.items()}
        handles = [m.register_forward_hook(hook) for m in mlps.values()] if mode != "clean" else []
        try:
            with torch.no_grad():
                return torch.cat([model(ids[i : i + 256]).logits.double()
                                  for i in range(0, len(ids), 256)])  # fmt: skip
        finally:
            for h in handles:
                h.remove()

    def ce(lg: torch.Tensor) -> float:
        return float(torch.nn.functional.cross_entropy(
            lg[:, :-1].reshape(-1, lg.shape[-1]), ids[:, 1:].reshape(-1)))  # fmt: skip

    clean, spliced, zero = logits("clean"), logits("spliced"), logits("zero")
    c, s, z = ce(clean), ce(spliced), ce(zero)
    lp, lq = clean[:, :-1].log_softmax(-1), spliced[:, :-1].log_softmax(-1)
    kl = float((lp.exp() * (lp - lq)).sum(-1).mean())
    rec = (z - s) / (z - c) if z != c else float("nan")
    return {"ce_clean": c, "ce_spliced": s, "ce_zero": z, "ce_recovered": rec, "kl": kl}


# -- the report --------------------------------------------------------------------------------
def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    got = {"python": platform.python_version()}
    for name in ("torch", "transformers", "eai-sparsify", "sae-lens", "schedulefree"):
        try:
            got[name] = version(name)
        except PackageNotFoundError:
            got[name] = None
    got["probe"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                  text=True, cwd=bc.ROOT).stdout.strip()  # fmt: skip
    return got


def machine() -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())  # fmt: skip
    return f"{os.cpu_count()} cores ({cpu}), CPU only, shared with other work"


def fmt(v, digits=3):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    return f"{v:.{digits}f}" if isinstance(v, float) else v


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=["planted", "tiny"], default="planted")
    p.add_argument("--samples", type=int, default=2048, help="sequences of 32 tokens (2048)")
    p.add_argument("--epochs", type=float, default=4.0, help="passes over the training rows")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--batch-rows", type=int, default=1024, help="rows per step (32 sequences)")
    p.add_argument("--probe", default="topk", help="probe.fit activations, comma-separated")
    p.add_argument("--probe-args", default="", help="more probe.fit options, e.g. '--lr 3e-3'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default="/tmp/bench-transcoders")
    p.add_argument("--out", default=None, help="also write the report as markdown to OUT")
    p.add_argument(
        "--speed",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="speed only: ROUNDS interleaved rounds of CPU seconds, no evaluation",
    )
    p.add_argument(
        "--speed-floor",
        type=float,
        default=0.02,
        help="passes of the fixed-cost runs of --speed (0.02)",
    )
    p.add_argument(
        "--baseline", default=None, help="--speed: also time probe.fit from this checkout of probe"
    )
    p.add_argument(
        "--speed-report", default=None, metavar="JSON",
        help="the --speed report of a speed.json written before (nothing run)",
    )  # fmt: skip
    p.add_argument(
        "--speed-no-losses", action="store_true",
        help="--speed: also time probe.fit --no-losses (no model: the training command alone)",
    )  # fmt: skip
    p.add_argument(
        "--speed-reuse", action="store_true",
        help="--speed: time on the model, ids.pt and run/ a run before left in --work (no capture)",
    )  # fmt: skip
    p.add_argument("--sparsify-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--ids", help=argparse.SUPPRESS)
    p.add_argument("--run", help=argparse.SUPPRESS)
    p.add_argument("--set-out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.sparsify_child:
        sparsify_child(args)
        return
    if args.speed_report:
        report = speed_report(json.loads(Path(args.speed_report).read_text()), args)
        print(report)
        if args.out:
            Path(args.out).write_text(report)
        return

    work = Path(args.work)
    model_dir, ids_path, run_dir = work / "model", work / "ids.pt", work / "run"
    if args.speed and args.speed_reuse:
        if not all(p.exists() for p in (model_dir, ids_path, run_dir / "probe.h5")):
            raise SystemExit(
                f"--speed-reuse: {work} holds no model, ids.pt and run/ of a run before"
            )
        report = speed(args, work, run_dir, model_dir, ids_path)
        print(report)
        if args.out:
            Path(args.out).write_text(report)
        return
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    built = build_model(args.model, work, args.samples, args.seed)
    capture = ["-m", "probe", "model=hf", f"model.name={model_dir}", "model.task=causal_lm",
               "dataset=tokens", f"dataset.path={ids_path}", "dataset.batch_size=64",
               "probes=mlp_io", f"hydra.run.dir={run_dir}"]  # fmt: skip
    capture_s = run_timed(capture, work / "capture.log")
    print(f"captured in {capture_s:.1f} s", flush=True)
    if args.speed:
        report = speed(args, work, run_dir, model_dir, ids_path)
        print(report)
        if args.out:
            Path(args.out).write_text(report)
        return

    budget = ["--width", str(args.width), "--k", str(args.k), "--epochs", str(args.epochs),
              "--batch-size", str(args.batch_rows)]  # fmt: skip
    trained, commands = {}, {}
    for act in [a for a in args.probe.split(",") if a]:
        out = work / f"probe_{act}"
        argv = ["-m", "probe.fit", str(run_dir), "--activation", act, *budget,
                *args.probe_args.split(), "--out", str(out)]  # fmt: skip
        load = os.getloadavg()[0]
        wall = run_timed(argv, work / f"probe_{act}.log")
        import pandas as pd

        fit = pd.read_csv(out / "fit.csv")
        trained[f"probe {act}"] = {"set": out, "wall": wall, "seconds": float(fit.seconds.sum()),
                                   "rows": int(fit.rows.sum()), "load": load}  # fmt: skip
        commands[f"probe {act}"] = "python " + " ".join(argv)
        print(f"probe {act}: {wall:.1f} s", flush=True)

    out = work / "sparsify_topk"
    argv = [str(Path(__file__).relative_to(bc.ROOT)), "--sparsify-child", "--model-dir",
            str(model_dir), "--ids", str(ids_path), "--run", str(run_dir), "--set-out", str(out), "--epochs",
            str(args.epochs), "--width", str(args.width), "--k", str(args.k), "--batch-rows",
            str(args.batch_rows), "--seed", str(args.seed)]  # fmt: skip
    load = os.getloadavg()[0]
    wall = run_timed(argv, work / "sparsify.log", env={"SPARSIFY_DISABLE_TRITON": "1"})
    child = json.loads([ln for ln in (work / "sparsify.log").read_text().splitlines()
                        if ln.startswith('{"seconds"')][-1])  # fmt: skip
    trained["sparsify topk"] = {"set": out, "wall": wall, "seconds": child["seconds"],
                                "rows": child["rows_per_layer"] * child["layers"], "load": load,
                                "child": child}  # fmt: skip
    commands["sparsify topk"] = "SPARSIFY_DISABLE_TRITON=1 python " + " ".join(argv)
    print(f"sparsify topk: {wall:.1f} s", flush=True)
    saelens = saelens_trainable()

    sets = {name: t["set"] for name, t in trained.items()}
    if args.model == "planted":
        sets["planted MLP (reference)"] = planted_mlp_set(model_dir, work / "planted_mlp")
    table = []
    for name, set_dir in sets.items():
        rows = evaluate_set(set_dir, run_dir, model_dir, ids_path, args.seed, built["encoders"],
                            work)  # fmt: skip
        for r in rows:
            r["trainer"], r["layer"] = name, str(r["layer"])
            t = trained.get(name)
            if t is not None and r["layer"] == "all":
                r.update(rows_trained=t["rows"], wall=t["wall"], rows_per_s=t["rows"] / t["wall"],
                         train_rows_per_s=t["rows"] / t["seconds"])  # fmt: skip
            table.append(r)
    cols = ["trainer", "layer", "fvu", "l0", "dead", "found", "ce_recovered", "kl",
            "ce_spliced", "rows", "wall s", "rows/s (wall)", "rows/s (training)"]  # fmt: skip
    lines = [[r["trainer"], r["layer"], fmt(r["fvu"], 4), fmt(r["l0"], 2), fmt(r["dead"]),
              fmt(r.get("found")), fmt(r["ce_recovered"]), fmt(r["kl"], 4),
              fmt(r["ce_spliced"], 4), r.get("rows_trained"),
              fmt(r.get("wall"), 1), fmt(r.get("rows_per_s"), 0),
              fmt(r.get("train_rows_per_s"), 0)] for r in table]  # fmt: skip
    lines.append(["SAELens " + str(saelens.get("version")), "cannot train a transcoder",
                  *[None] * (len(cols) - 2)])  # fmt: skip
    gap = {k: max(abs(r[k] - r[f"hooks_{k}"]) for r in table)
           for k in ("ce_clean", "ce_spliced", "ce_zero", "ce_recovered", "kl")}  # fmt: skip
    first = table[0]
    notes = [
        f"model: {built['model']}; {args.samples} x {SEQ} tokens, held out: probe.fit's split "
        f"(test fraction 0.1, seed {args.seed})",
        f"budget: width {args.width}, k {args.k}, {args.epochs:g} passes over the training "
        f"samples, {args.batch_rows} rows a step",
        f"clean next-token CE {first['ce_clean']:.4f}; per-layer ce_zero: "
        + ", ".join(
            f"{r['layer']}: {r['ce_zero']:.4f}" for r in table if r["trainer"] == first["trainer"]
        ),  # fmt: skip
        "rows: training rows of every layer together; rows/s (wall): over the trainer command's "
        "wall seconds (process start, imports, evaluation or saving included); rows/s "
        "(training): over its own training seconds (probe: fit.csv seconds, which include its "
        "held-out evaluation; sparsify: Trainer.fit(), the LM forward included)",
        f"capture of the rows (`probes=mlp_io`, once, shared by every probe fit): {capture_s:.1f} s",
        "found: share of the planted units' encoder directions that a learned encoder row "
        "matches at cosine >= 0.9 (probe.testing.planted.directions_found)",
        "sparsify: its Trainer on the same model and training samples (it takes token ids, not "
        f"cached rows), optimizer {trained['sparsify topk']['child']['optimizer']}, lr "
        f"{trained['sparsify topk']['child']['lr']}, auxk_alpha "
        f"{trained['sparsify topk']['child']['auxk_alpha']} (its defaults)",
        f"SAELens {saelens.get('version')}: trains {', '.join(saelens.get('trains', []))}; a "
        f"transcoder: {'yes' if saelens.get('transcoder') else 'no'} (nothing compared)",
        "one evaluation: `python -m probe.fit --evaluate SET RUN` of each set (its transcoder "
        "files; sparsify's exported to probe's format); its loss measures computed again in "
        "this script with plain forward hooks on the model: largest difference over every row "
        + ", ".join(f"{k} {v:.1e}" for k, v in gap.items()),
        "load average (1 min) before each trainer: "
        + ", ".join(f"{n} {t['load']:.1f}" for n, t in trained.items()),
    ]
    head = [HEADER, "", SETUP, "", f"Measured {datetime.date.today()}, {machine()}.",
            "Versions: " + ", ".join(f"{k} {v}" for k, v in versions().items())]  # fmt: skip
    report = bc.markdown(head, cols, lines, notes)
    report += "\nCommands:\n\n```bash\n" + "python " + " ".join(capture) + "\n"
    report += "\n".join(commands.values()) + "\n```\n"
    print(report)
    (work / "results.json").write_text(json.dumps(table, default=str, indent=1))
    if args.out:
        Path(args.out).write_text(report)


if __name__ == "__main__":
    main()
