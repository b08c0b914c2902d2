"""`python -m probe.fit`'s defaults on a small real language model, trained here on English text.

No pretrained weights can be downloaded on this machine, so the script makes the model it measures:

1. Text: the docstrings of the Python standard library and of every package installed beside
   probe (the interpreter's `stdlib` and `purelib` folders; test folders skipped), cut into
   paragraphs, kept where they read as prose (at least 12 words, at least 97% letters, spaces and
   common punctuation, no doctest, field list or argument list), deduplicated, then shuffled with
   `--seed`. A share (`--held-share`) of the paragraphs is held out of the tokenizer's and the
   LM's training: the LM's held-out loss and every capture are over those.
2. A byte-level BPE tokenizer (the `tokenizers` library, `--vocab` ids, one special token
   `<|endoftext|>`: BOS, EOS and padding) saved by transformers' `PreTrainedTokenizerFast`.
3. A GPT-2-shaped LM (`GPT2LMHeadModel`, `--blocks` x `--d-model`, context `--context`) trained
   for `--lm-steps` AdamW steps on windows of the training paragraphs joined by EOS, saved with
   `save_pretrained` beside the tokenizer; its held-out loss is printed next to the unigram
   cross-entropy of the same held-out tokens (unigram counts from the training tokens).
4. `python -m probe model=hf model.name=<the LM's folder> dataset=text dataset.pack=true
   probes=mlp_io` over the held-out paragraphs: each block's MLP input and output per token.
5. `python -m probe.fit RUN --width W --epochs E --activation A` for relu, jumprelu, topk and
   batchtopk, and `--kind clt` (the defaults otherwise), reading each fit.csv; each per-layer set
   is then measured with position 0 and EOS rows put back (`--evaluate SET RUN --keep-special
   --no-losses`), and the share of each block's MLP-output variance that sits in position-0 and
   EOS rows is read from the capture.

Everything is deterministic given `--seed` and the files installed on the machine (the corpus's
sha256 is printed). Figures in docs/bench/fit_real_lm.md.

    OMP_NUM_THREADS=1 python scripts/bench_fit_real_lm.py [--dir DIR] [--threads 2] [--markdown FILE]
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import random
import re
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import h5py
import numpy as np
import pandas as pd
import torch

from probe.analysis.fit.options import FitOptions

SPECIAL = "<|endoftext|>"
_PROSE_CHAR = re.compile(r"[A-Za-z ,.;:'\"()\-]")
_FIELD_LIST = re.compile(
    r"\b(Args|Arguments|Returns|Raises|Parameters|Yields|Attributes|Examples?)\s*:"
)
_SKIPPED_DIRS = {"site-packages", "test", "tests", "__pycache__", "idlelib", "lib2to3"}


def prose_paragraphs(docstring: str) -> list[str]:
    """The paragraphs of a docstring that read as English prose, each unwrapped to one line."""
    kept = []
    for para in re.split(r"\n\s*\n", docstring):
        lines = [line.strip() for line in para.splitlines()]
        if any(line.startswith((">>>", "...", "..", ":", "-", "*", "|", "=")) for line in lines):
            continue
        text = " ".join(lines)
        if len(text.split()) < 12 or _FIELD_LIST.search(text):
            continue
        if sum(bool(_PROSE_CHAR.match(c)) for c in text) / len(text) < 0.97:
            continue
        kept.append(text)
    return kept


def python_files(root: Path) -> list[Path]:
    """Every .py file under `root`, in sorted order, outside test folders and (for the standard
    library) the site-packages inside it."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
        found += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
    return found


def gather_text(seed: int) -> tuple[list[str], dict]:
    """The prose paragraphs of the docstrings of the standard library and the installed packages:
    deduplicated in file order, then shuffled with `seed`. Returns (paragraphs, provenance)."""
    roots = [Path(sysconfig.get_paths()["stdlib"]), Path(sysconfig.get_paths()["purelib"])]
    paragraphs: list[str] = []
    files = 0
    for root in roots:
        for path in python_files(root):
            try:
                tree = ast.parse(path.read_bytes())
            except (SyntaxError, ValueError):
                continue
            files += 1
            for node in ast.walk(tree):
                if isinstance(
                    node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
                ):
                    doc = ast.get_docstring(node)
                    if doc:
                        paragraphs += prose_paragraphs(doc)
    unique = list(dict.fromkeys(paragraphs))
    random.Random(seed).shuffle(unique)
    corpus = "\n".join(unique).encode()
    return unique, {
        "roots": [str(r) for r in roots],
        "files": files,
        "paragraphs": len(unique),
        "bytes": len(corpus),
        "sha256": hashlib.sha256(corpus).hexdigest(),
    }


def train_tokenizer(paragraphs: list[str], vocab: int, folder: Path):
    """A byte-level BPE tokenizer of `vocab` ids with one special token, saved to `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[SPECIAL],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(paragraphs, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=SPECIAL, eos_token=SPECIAL, pad_token=SPECIAL
    )
    fast.save_pretrained(folder)
    return fast


def token_stream(fast, paragraphs: list[str]) -> torch.Tensor:
    """The paragraphs' ids joined by EOS (EOS after each), as one int64 tensor."""
    eos = fast.eos_token_id
    ids: list[int] = []
    for encoded in fast.backend_tokenizer.encode_batch(paragraphs):
        ids += encoded.ids
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int64)


def unigram_cross_entropy(train: torch.Tensor, held: torch.Tensor, vocab: int) -> float:
    """Cross-entropy (nats) of the held-out tokens under the training tokens' unigram
    distribution (add-one smoothed)."""
    counts = torch.bincount(train, minlength=vocab).double() + 1
    logp = (counts / counts.sum()).log()
    return float(-logp[held].mean())


@torch.no_grad()
def lm_loss(model, stream: torch.Tensor, context: int, batch: int = 64) -> float:
    """Mean next-token cross-entropy (nats) of `model` over `stream` cut into windows."""
    n = len(stream) // context
    windows = stream[: n * context].view(n, context)
    total, count = 0.0, 0
    for i in range(0, n, batch):
        ids = windows[i : i + batch]
        logits = model(ids).logits[:, :-1].double()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
        )
        total += float(loss)
        count += ids[:, 1:].numel()
    return total / count


def train_lm(train: torch.Tensor, held: torch.Tensor, vocab: int, args) -> tuple[object, dict]:
    """A GPT-2-shaped LM trained for args.lm_steps AdamW steps on windows of `train` (each
    epoch a seeded permutation of the non-overlapping windows); returns (model, figures)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(args.seed)
    config = GPT2Config(
        vocab_size=vocab,
        n_positions=args.context,
        n_embd=args.d_model,
        n_layer=args.blocks,
        n_head=args.heads,
        n_inner=4 * args.d_model,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    n_windows = len(train) // args.context
    windows = train[: n_windows * args.context].view(n_windows, args.context)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lm_lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.lm_steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (
            1 + math.cos(math.pi * (step - warmup) / (args.lm_steps - warmup))
        )

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    gen = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(n_windows, generator=gen)
    cursor, epoch_losses, start = 0, [], time.perf_counter()
    model.train()
    for step in range(args.lm_steps):
        if cursor + args.lm_batch > n_windows:
            order, cursor = torch.randperm(n_windows, generator=gen), 0
        ids = windows[order[cursor : cursor + args.lm_batch]]
        cursor += args.lm_batch
        loss = model(ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        epoch_losses.append(float(loss))
        if (step + 1) % max(1, args.lm_steps // 10) == 0:
            recent = sum(epoch_losses[-50:]) / len(epoch_losses[-50:])
            print(
                f"  LM step {step + 1}/{args.lm_steps}: train loss {recent:.3f} "
                f"({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
    model.eval()
    seconds = time.perf_counter() - start
    figures = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_tokens_seen": args.lm_steps * args.lm_batch * args.context,
        "train_loss_last50": sum(epoch_losses[-50:]) / len(epoch_losses[-50:]),
        "held_out_loss": lm_loss(model, held, args.context),
        "train_window_loss": lm_loss(model, train[: len(held)], args.context),
        "unigram_ce": unigram_cross_entropy(train, held, vocab),
        "seconds": seconds,
    }
    return model, figures


def run_module(argv: list[str], log: Path, threads: int) -> float:
    """`python -m ...` in a child process with `threads` threads; output to `log`; seconds."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    t = time.perf_counter()
    with open(log, "w") as out:
        done = subprocess.run(
            [sys.executable, *argv], stdout=out, stderr=subprocess.STDOUT, env=env
        )
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}); see {log}")
    return time.perf_counter() - t


def variance_shares(h5_path: Path, eos: int) -> pd.DataFrame:
    """Per block: the share of the MLP output's variance (sum of squares about the mean over every
    captured row) that sits in position-0 rows and in EOS rows, next to their share of the rows."""
    rows = []
    with h5py.File(h5_path, "r") as f:
        position = f["tokens/position"][:]
        token = f["tokens/id"][:]
        blocks = sorted(
            (k for k in f["layers"] if k.endswith(".mlp")), key=lambda k: int(k.split(".")[-2])
        )
        for name in blocks:
            out = f[f"layers/{name}/output"][:].astype(np.float64)
            sq = ((out - out.mean(0)) ** 2).sum(1)
            first, special = position == 0, token == eos
            rows.append(
                {
                    "layer": int(name.split(".")[-2]),
                    "pos0_rows": first.mean(),
                    "pos0_var": sq[first].sum() / sq.sum(),
                    "eos_rows": special.mean(),
                    "eos_var": sq[special].sum() / sq.sum(),
                    "pos0_norm_ratio": np.sqrt(sq[first].mean() / sq[~first & ~special].mean()),
                }
            )
    return pd.DataFrame(rows)


def activation_structure(h5_path: Path, eos: int) -> pd.DataFrame:
    """Per block, on the rows a fit keeps (not position 0, not EOS): the share of the MLP input's
    and output's variance in their top 16 principal directions, the output's participation ratio
    (sum of eigenvalues squared over the sum of their squares: the directions it uses), and the
    share of the output's variance that the current token's own mean output explains."""
    rows = []
    with h5py.File(h5_path, "r") as f:
        token = f["tokens/id"][:]
        keep = (f["tokens/position"][:] != 0) & (token != eos)
        for layer in range(sum(1 for k in f["layers"] if k.endswith(".mlp"))):
            row: dict = {"layer": layer}
            for site in ("input", "output"):
                x = f[f"layers/transformer.h.{layer}.mlp/{site}"][:][keep].astype(np.float64)
                x -= x.mean(0)
                eig = np.linalg.svd(x, compute_uv=False) ** 2
                eig /= eig.sum()
                row[f"{site}_top16"] = eig[:16].sum()
                if site == "output":
                    row["output_participation"] = 1 / (eig**2).sum()
                    means = pd.DataFrame(x).groupby(token[keep]).transform("mean").to_numpy()
                    row["output_token_mean_share"] = 1 - ((x - means) ** 2).sum() / (x**2).sum()
            rows.append(row)
    return pd.DataFrame(rows)


def never_fired(set_dir: Path, h5_path: Path, eos: int) -> list[float]:
    """Per block: the share of a per-layer set's features active on none of the run's kept rows
    (every sample, training rows included; position 0 and EOS left out)."""
    from probe.models.transcoder_files import load_transcoders

    transcoders = load_transcoders(set_dir)
    shares = []
    with h5py.File(h5_path, "r") as f:
        keep = (f["tokens/position"][:] != 0) & (f["tokens/id"][:] != eos)
        for layer in range(len(transcoders)):
            x = torch.from_numpy(f[f"layers/transformer.h.{layer}.mlp/input"][:][keep]).float()
            with torch.no_grad():
                fired = (transcoders[layer].encode(x) > 0).any(0)
            shares.append(float((~fired).double().mean()))
    return shares


def threshold_checks(set_dir: Path, h5_path: Path, eos: int, k: int) -> list[str]:
    """Per block of a saved jumprelu set (a jumprelu or batchtopk fit), on the run's kept rows:
    its thresholds' median and the positive pre-activations' median; and the share of features
    that the batch top-k a batchtopk fit trains with (k x rows of each 1,024 rows, in file order)
    ever chooses, next to the share that ever pass the saved threshold."""
    from probe.models.transcoder_files import load_transcoders

    transcoders = load_transcoders(set_dir)
    lines = []
    with h5py.File(h5_path, "r") as f:
        keep = (f["tokens/position"][:] != 0) & (f["tokens/id"][:] != eos)
        for layer in range(len(transcoders)):
            tc = transcoders[layer]
            x = torch.from_numpy(f[f"layers/transformer.h.{layer}.mlp/input"][:][keep]).float()
            with torch.no_grad():
                pre = x @ tc.W_enc + tc.b_enc
                chosen = torch.zeros(pre.shape[1], dtype=torch.bool)
                for i in range(0, len(pre), 1024):
                    batch = pre[i : i + 1024]
                    chosen[batch.flatten().topk(k * len(batch)).indices % pre.shape[1]] = True
                passing = (pre > tc.threshold).any(0)
                median = float(tc.threshold.median())
            lines.append(
                f"block {layer}: threshold median {median:.4f}, positive "
                f"pre-activations' median {float(pre[pre > 0].median()):.3f}; batch top-k "
                f"chooses {float(chosen.double().mean()):.3f} of the features, "
                f"{float(passing.double().mean()):.3f} ever pass the threshold"
            )
    return lines


def markdown(table: pd.DataFrame) -> str:
    """`table` as a markdown table, floats to 4 significant figures."""
    cols = list(table.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for _, r in table.iterrows():
        cells = [f"{v:.4g}" if isinstance(v, float) else str(v) for v in r]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=Path("/tmp/fit_real_lm"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--held-share", type=float, default=0.05)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--lm-steps", type=int, default=600)
    p.add_argument("--lm-batch", type=int, default=16)
    p.add_argument("--lm-lr", type=float, default=3e-3)
    p.add_argument("--capture-sequences", type=int, default=1024)
    p.add_argument("--width", type=int, default=None, help="probe.fit --width (8 x d_model)")
    p.add_argument("--epochs", type=float, default=2)
    p.add_argument(
        "--activations", nargs="*", default=["relu", "jumprelu", "topk", "batchtopk", "clt"]
    )
    p.add_argument("--markdown", type=Path, default=None, help="write the tables here too")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    width = args.width or 8 * args.d_model
    work = args.dir
    work.mkdir(parents=True, exist_ok=True)
    model_dir, run_dir = work / "lm", work / "run"
    report: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        report.append(line)

    import tokenizers
    import transformers

    say(
        f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, tokenizers {tokenizers.__version__}, "
        f"{args.threads} threads"
    )
    t = time.perf_counter()
    cached = work / f"text_seed{args.seed}.json"
    if cached.is_file():  # a rerun in the same folder reads the gathered text back
        paragraphs, source = json.loads(cached.read_text())
    else:
        paragraphs, source = gather_text(args.seed)
        cached.write_text(json.dumps([paragraphs, source]))
    n_held = int(len(paragraphs) * args.held_share)
    held_paras, train_paras = paragraphs[:n_held], paragraphs[n_held:]
    say(
        f"text: {source['paragraphs']} prose paragraphs ({source['bytes'] / 1e6:.2f} MB) from the "
        f"docstrings of {source['files']} .py files under {', '.join(source['roots'])}; sha256 "
        f"{source['sha256'][:16]}; {len(held_paras)} paragraphs held out "
        f"({time.perf_counter() - t:.0f} s)"
    )
    t = time.perf_counter()
    fast = train_tokenizer(train_paras, args.vocab, model_dir)
    train_ids, held_ids = token_stream(fast, train_paras), token_stream(fast, held_paras)
    vocab_hash = hashlib.sha256(json.dumps(fast.get_vocab(), sort_keys=True).encode()).hexdigest()
    say(
        f"tokenizer: byte-level BPE, {len(fast)} ids (special {SPECIAL} = {fast.eos_token_id}), "
        f"vocab sha256 {vocab_hash[:16]}; training tokens {len(train_ids):,}, held-out tokens "
        f"{len(held_ids):,} ({time.perf_counter() - t:.0f} s)"
    )
    model, lm = train_lm(train_ids, held_ids, len(fast), args)
    model.save_pretrained(model_dir)
    say(
        f"LM: GPT2LMHeadModel, {args.blocks} blocks, d_model {args.d_model}, {args.heads} heads, "
        f"n_inner {4 * args.d_model}, context {args.context}, {lm['parameters']:,} parameters; "
        f"{args.lm_steps} AdamW steps of {args.lm_batch} x {args.context} tokens "
        f"({lm['train_tokens_seen']:,} tokens, {lm['train_tokens_seen'] / len(train_ids):.2f} "
        f"epochs) in {lm['seconds']:.0f} s; loss (nats/token): train (last 50 steps) "
        f"{lm['train_loss_last50']:.3f}, train windows {lm['train_window_loss']:.3f}, held-out "
        f"{lm['held_out_loss']:.3f}; unigram cross-entropy of the held-out tokens "
        f"{lm['unigram_ce']:.3f}"
    )
    del model

    held_jsonl = work / "held.jsonl"
    held_jsonl.write_text("".join(json.dumps({"text": s}) + "\n" for s in held_paras))
    capture = ["-m", "probe", "model=hf", f"model.name={model_dir}", "model.task=causal_lm",
               "dataset=text", f"dataset.path={held_jsonl}", "dataset.pack=true",
               f"dataset.seq_len={args.context}", f"dataset.num_samples={args.capture_sequences}",
               "dataset.batch_size=64", "probes=mlp_io", f"seed={args.seed}",
               f"hydra.run.dir={run_dir}", "overwrite=true"]  # fmt: skip
    seconds = run_module(capture, work / "capture.log", args.threads)
    say(
        f"capture: python {' '.join(capture)} ({args.capture_sequences} sequences, "
        f"{args.capture_sequences * args.context:,} token rows, {seconds:.0f} s)"
    )
    shares = variance_shares(run_dir / "probe.h5", fast.eos_token_id)
    say("\nwhere the MLP output's variance sits (every captured row):\n")
    say(markdown(shares))
    say("\nthe MLPs' activations (rows a fit keeps):\n")
    say(markdown(activation_structure(run_dir / "probe.h5", fast.eos_token_id)))

    fits = []
    for name in args.activations:
        out = work / f"fit_{name}"
        kind = ["--kind", "clt"] if name == "clt" else ["--activation", name]
        argv = ["-m", "probe.fit", str(run_dir), *kind, "--width", str(width),
                "--epochs", str(args.epochs), "--out", str(out)]  # fmt: skip
        if out.exists():
            import shutil

            shutil.rmtree(out)
        seconds = run_module(argv, work / f"fit_{name}.log", args.threads)
        say(f"\nfit: python {' '.join(argv)} ({seconds:.0f} s)")
        fit = pd.read_csv(out / "fit.csv")
        fit.insert(0, "fit", name)
        if name != "clt":
            evaluated = work / f"eval_{name}_keep_special.csv"
            argv = ["-m", "probe.fit", "--evaluate", str(out), str(run_dir), "--keep-special",
                    "--no-losses", "--out", str(evaluated)]  # fmt: skip
            run_module(argv, work / f"eval_{name}.log", args.threads)
            kept = pd.read_csv(evaluated).set_index("layer")["fvu"]
            fit["fvu_with_pos0_eos"] = [
                float(kept.get(str(layer), np.nan)) if str(layer) != "all" else np.nan
                for layer in fit["layer"].astype(str)
            ]
            silent = never_fired(out, run_dir / "probe.h5", fast.eos_token_id)
            if name in ("jumprelu", "batchtopk"):
                for line in threshold_checks(
                    out, run_dir / "probe.h5", fast.eos_token_id, FitOptions().k
                ):
                    say(f"  {name} {line}")
            fit["never_fired_all_rows"] = silent + [np.nan] * (len(fit) - len(silent))
        fits.append(fit)
    table = pd.concat(fits, ignore_index=True)
    columns = ["fit", "layer", "fvu", "l0", "dead", "ce_recovered", "kl", "rows",
               "held_out_rows", "left_out_rows", "fvu_with_pos0_eos", "never_fired_all_rows"]  # fmt: skip
    table = table[[c for c in columns if c in table.columns]]
    say(f"\nprobe.fit defaults, --width {width} --epochs {args.epochs}:\n")
    say(markdown(table))
    over = table[(table.layer.astype(str) != "all") & (table.dead > 0.10)]
    say(
        "\nlayers with more than 10% dead latents: "
        + (
            "none"
            if over.empty
            else ", ".join(f"{r.fit} layer {r.layer}" for r in over.itertuples())
        )
    )
    if args.markdown:
        args.markdown.write_text("\n".join(report) + "\n")


if __name__ == "__main__":
    main()
