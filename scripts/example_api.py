"""Probing from Python: a torchvision model and a HuggingFace model, read back, one plot.

    python scripts/example_api.py [OUT]        # default OUT: outputs/example_api

Nothing is downloaded: both models start from a seeded random init (pass weights or
from_pretrained(...) models the same way). Needs the `hf` and `plot` extras.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import matplotlib
import torch
import torchvision
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

import probe

if set(sys.argv[1:]) & {"-h", "--help"}:
    print(__doc__)
    sys.exit(0)
matplotlib.use("Agg")
logging.basicConfig(level=logging.WARNING)  # probe logs through the "probe" logger
torch.manual_seed(0)
out = Path(sys.argv[1] if len(sys.argv) > 1 else "outputs/example_api")

# 1. A torchvision model over a DataLoader of (images, targets): statistics only.
resnet = torchvision.models.resnet18(num_classes=10).eval()
print(probe.sites(resnet, torch.randn(1, 3, 64, 64)).query("type == 'Conv2d'").head(4))
images = TensorDataset(torch.randn(32, 3, 64, 64), torch.randint(0, 10, (32,)))
run = probe.run(resnet, DataLoader(images, batch_size=8), "all_convs", out=out / "resnet18",
                store="stats", progress=False)  # fmt: skip
print(run.summary[["layer", "mean", "std", "dead_frac"]].head())

# 2. A HuggingFace GPT-2 over token batches (dicts of keyword arguments): the residual stream.
config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500, bos_token_id=0, eos_token_id=0)
lm = GPT2LMHeadModel(config).eval()
ids = torch.randint(0, 500, (8, 16))
mask = torch.ones_like(ids)
batches = [{"input_ids": ids[i : i + 4], "attention_mask": mask[i : i + 4]} for i in (0, 4)]
lm_run = probe.run(lm, batches, "residual", out=out / "gpt2", progress=False)
block = lm_run.layers[-1]
print(lm_run, block, lm_run.array(block).shape)

# 3. The same block in memory for one small forward (no file): equal to what the run stored.
with torch.no_grad(), probe.capture(lm, "residual") as cap:
    lm(**batches[0])
held = cap[block]  # residual's rows are tokens: the first batch's are the run's first rows
print(
    "capture equals the run's rows:",
    torch.equal(held, torch.from_numpy(lm_run.array(block)[: len(held)])),
)

# 4. One statistic per layer, plotted.
ax = run.summary.plot(x="layer", y="std", rot=90, legend=False, title="resnet18 conv outputs: std")
ax.figure.tight_layout()
ax.figure.savefig(out / "std_by_layer.png")
print("wrote", out / "std_by_layer.png")
run.close()
lm_run.close()
