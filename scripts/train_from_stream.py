"""Train on a run's captures with plain torch: a linear probe of a token label, then a sparse
autoencoder, both fed by `run.dataset(...)` (docs/training_data.md).

    python scripts/train_from_stream.py RUN LAYER                 # the SAE only
    python scripts/train_from_stream.py RUN LAYER --probe         # and a probe of /tokens/label
    python scripts/train_from_stream.py RUN LAYER --latents 2048 --epochs 2 --workers 2

RUN is a run directory (or its probe.h5) that stored LAYER's output; --probe needs labels in it
(/tokens/label or /samples/target). The probe is a logistic regression; the SAE a ReLU one with an
L1 penalty on its latents (decoder columns kept at unit norm), reporting the fraction of variance
it explains. Neither is a library trainer: copy what you need.
"""

from __future__ import annotations

import argparse
import math

import torch
from torch.utils.data import DataLoader

import probe


def loader(run, layer: str, args, seed: int) -> tuple:
    stream = run.dataset(layer, batch_size=args.batch_size, seed=seed, dtype=torch.float32,
                         device=args.device)  # fmt: skip
    return stream, DataLoader(stream, batch_size=None, num_workers=args.workers)


def train_probe(run, layer: str, args) -> None:
    stream, batches = loader(run, layer, args, seed=1)
    width = math.prod(run.array(layer, "output").shape[1:])
    classes = (
        int(run.file["tokens/label" if "tokens/label" in run.file else "samples/target"][:].max())
        + 1
    )
    model = torch.nn.Linear(width, classes).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for epoch in range(args.epochs):
        stream.set_epoch(epoch)
        correct = seen = 0
        for rows, labels in batches:
            keep = labels >= 0  # (-1: a token without a label)
            x, y = rows.reshape(len(rows), -1)[keep], labels[keep]
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            correct, seen = correct + int((logits.argmax(1) == y).sum()), seen + len(y)
        print(
            f"probe epoch {epoch}: training accuracy {correct / max(seen, 1):.3f} over {seen} rows"
        )


def train_sae(run, layer: str, args) -> None:
    stream, batches = loader(run, layer, args, seed=2)
    width = math.prod(run.array(layer, "output").shape[1:])
    first = next(iter(stream))[0].reshape(-1, width)
    scale = first.norm(dim=1).mean() / width**0.5  # rows to unit RMS
    encoder = torch.nn.Linear(width, args.latents).to(args.device)
    decoder = torch.nn.Linear(args.latents, width).to(args.device)
    with torch.no_grad():
        decoder.weight.copy_(encoder.weight.T / encoder.weight.T.norm(dim=0, keepdim=True))
    opt = torch.optim.Adam([*encoder.parameters(), *decoder.parameters()], lr=args.lr)
    for epoch in range(args.epochs):
        stream.set_epoch(epoch)
        residual = total = 0.0
        for rows, _ in batches:
            x = rows.reshape(len(rows), -1) / scale
            latents = torch.relu(encoder(x - decoder.bias))
            rebuilt = decoder(latents)
            loss = (rebuilt - x).pow(2).sum(1).mean() + args.l1 * latents.sum(1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                decoder.weight /= decoder.weight.norm(dim=0, keepdim=True)
                residual += float((rebuilt - x).pow(2).sum())
                total += float((x - x.mean(0)).pow(2).sum())
        l0 = float((latents > 0).float().sum(1).mean())
        print(f"sae epoch {epoch}: explained variance {1 - residual / total:.3f}, L0 {l0:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run")
    parser.add_argument("layer")
    parser.add_argument("--probe", action="store_true", help="also a probe of the run's labels")
    parser.add_argument("--latents", type=int, default=1024)
    parser.add_argument("--l1", type=float, default=1e-3)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    with probe.open_run(args.run) as run:
        if args.probe:
            train_probe(run, args.layer, args)
        train_sae(run, args.layer, args)


if __name__ == "__main__":
    main()
