"""A user's training with a checkpoint, watched: the program the SIGKILL trials kill and resume.

    python -m tests.train.watched_training OUT CHECKPOINT STEPS [DELAY]

Trains probe.testing.trainings' small CNN with SGD over seeded batches, one per step, on one torch
thread (bitwise repeatable). After every 3rd step it saves a checkpoint (model, optimizer and
the watch's state_dict, written aside then renamed into place); a run that finds the
checkpoint resumes from it. Prints `step N` after each step.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

import probe
from probe.testing.trainings import cnn, image_batches, image_loss

PROBES = {
    "net": {"layers": ["conv1", "layer1", "fc"],
            "capture": ["output", "grad_output", "param_grad", "param_update"]},
}  # fmt: skip
CHECKPOINT_EVERY = 3


def main(out: Path, checkpoint: Path, steps: int, delay: float = 0.0) -> None:
    torch.set_num_threads(1)
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    w = probe.watch(model, PROBES, out=out, optimizer=opt, every=1, flush_every=2,
                    overwrite=not checkpoint.exists())  # fmt: skip
    first = 0
    if checkpoint.exists():
        state = torch.load(checkpoint, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        w.load_state_dict(state["watch"])
        first = state["watch"]["step"]
    batches = image_batches(steps)
    with w:
        for step in range(first, steps):
            opt.zero_grad()
            loss = image_loss(model, batches[step])
            loss.backward()
            w.loss(loss)
            opt.step()
            if (step + 1) % CHECKPOINT_EVERY == 0:
                aside = checkpoint.with_suffix(".tmp")
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                            "watch": w.state_dict()}, aside)  # fmt: skip
                os.replace(aside, checkpoint)
            print(f"step {step}", flush=True)
            time.sleep(delay)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4] or 0))
