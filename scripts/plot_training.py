"""Draw the training figures of docs/training.md from a real-shaped model: a Llama of 30 blocks
(SmolLM2-135M's depth) at width 64, trained with AdamW and gradient clipping, watched at every
step over each block's output and output gradient, its attention and MLP outputs, the final norm
and three modules' parameters (probe.testing.trainings.DEEP_PROBES, 100 modules' sites), then
drawn by `python -m probe.plot`. With --tutorial, the run of docs/tutorials/watch_training.md
instead (its code run as written, in OUT), whose train_lines.png the tutorial shows.

python scripts/plot_training.py OUT [--steps 20] [--docs] [--suffix _before] [--tutorial]

OUT holds the run (probe.h5, train.csv) and its train_lines.png and train_heatmap.png; --docs
also writes the figures to docs/images/ at 90 dpi in 256 colours (train_lines{suffix}.png,
train_heatmap{suffix}.png; with --tutorial train_tutorial_lines.png alone).
docs/images/train_lines_before.png is this script's run drawn by the code before the figures
were split by kind (commit dcb04a5, with --suffix _before).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import probe  # noqa: E402
from probe.report.figures import main as plot  # noqa: E402
from probe.report.figures import train_run_figures  # noqa: E402
from probe.testing.trainings import DEEP_PROBES, deep_llama, token_batches  # noqa: E402


def train(out: Path, steps: int) -> None:
    """The run: a batch of 8 sequences of 16 tokens a step, the loss, clipping to norm 1, AdamW."""
    model = deep_llama(width=64)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    with probe.watch(model, DEEP_PROBES, out=out, optimizer=opt, overwrite=True) as w:
        for batch in token_batches(steps, size=8, length=16):
            opt.zero_grad()
            loss = model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
            loss.backward()
            w.loss(loss)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()


def tutorial(out: Path) -> Path:
    """Run the Python blocks of docs/tutorials/watch_training.md in `out`, as a reader runs
    them: its watched CNN lands in out/outputs/cnn (returned)."""
    text = (ROOT / "docs" / "tutorials" / "watch_training.md").read_text()
    code = "\n".join(re.findall(r"^```python\n(.*?)^```$", text, re.MULTILINE | re.DOTALL))
    out.mkdir(parents=True, exist_ok=True)
    here = os.getcwd()
    os.chdir(out)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(code, "watch_training.md", "exec"), {"__name__": "tutorial"})
    finally:
        os.chdir(here)
    return out / "outputs" / "cnn"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--docs", action="store_true", help="write the figures to docs/images/")
    parser.add_argument("--suffix", default="", help="after the docs figures' names")
    parser.add_argument("--tutorial", action="store_true", help="the tutorial's run instead")
    args = parser.parse_args()
    if args.tutorial:
        run_dir = tutorial(args.out)
        names = {"train_lines.png": "train_tutorial_lines.png"}
    else:
        train(args.out, args.steps)
        run_dir = args.out
        names = {n: n.replace(".png", f"{args.suffix}.png") for n in ("train_lines.png",
                                                                       "train_heatmap.png")}  # fmt: skip
    done = plot([str(run_dir)])
    if args.docs:
        with probe.open_run(run_dir) as run:
            for name, fig in train_run_figures(run).items():
                if name in names:
                    small(fig, ROOT / "docs" / "images" / names[name])
    return done


def small(fig, path: Path) -> None:
    """The figure at 90 dpi in 256 colours: a third of the bytes, no difference to the eye."""
    from PIL import Image

    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=90)
    Image.open(buffer).convert("RGB").quantize(256).save(path, optimize=True)


if __name__ == "__main__":
    sys.exit(main())
