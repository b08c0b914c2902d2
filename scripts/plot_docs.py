"""Draw the figures the docs embed from real runs of probe, into docs/images/.

    python scripts/plot_docs.py [OUT]

- circuit.png and faithfulness.png (docs/circuits.md): a circuit run from the command line
  (`circuit.method=[eap,exact]`, every other key at its default) on the planted circuit of
  tests/circuits/test_planted.py, a 3-layer, 4-head model whose weights carry the answer through
  a0.h1, a1.h2 and a2.h0, over that test's 6 pairs; the figures are the ones the run draws.
  Scripts take nothing from the test package, so the model and its pairs are built here again
  (`planted`, `planted_pairs`); test_planted.py holds them equal to its own.
- tutorial_units.png (docs/tutorials/your_model.md), tutorial_circuit.png and
  tutorial_faithfulness.png (docs/tutorials/circuit.md): the tutorials' own blocks run in order
  in a fresh folder (`script_of`: the program tests/test_tutorials.py runs, which holds the two
  equal), and the figures they write.

OUT (default: a temporary folder) keeps the runs. Each figure is copied in 256 colours (a third of
the bytes, no difference to the eye).
"""

from __future__ import annotations

import argparse
import os
import re
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

IMAGES = ROOT / "docs" / "images"
PLANTED_ANATOMY = (
    "+model.anatomy={attn_norm:ln_1,mlp_norm:ln_2,qkv:[attn.q,attn.k,attn.v],qkv_layout:split,"
    "attn_out:attn.o,mlp_out:mlp,final_norm:ln_f,unembed:head,heads:4}"
)  # tests/circuits/toy.py's OVERRIDES with the planted model's 4 heads
TUTORIALS = {  # a tutorial: {the figure its code writes: its name in docs/images/}
    "your_model": {"outputs/mlp/units.png": "tutorial_units.png"},
    "circuit": {
        "outputs/ioi_circuit/circuit.png": "tutorial_circuit.png",
        "outputs/ioi_circuit/my_faithfulness.png": "tutorial_faithfulness.png",
    },
}


def environment(folder: Path) -> dict:
    """This interpreter as `python` (the tutorials' bash blocks call it), the repository
    importable, figures drawn off-screen."""
    bin_dir = folder / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    wrapper = bin_dir / "python"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    paths = [str(ROOT), str(ROOT / "scripts"), os.environ.get("PYTHONPATH")]  # (plot_docs.planted)
    path = os.pathsep.join(filter(None, paths))
    return {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": path,
        "MPLBACKEND": "Agg",
    }


VOCAB, WIDTH, HEADS, DH = 12, 32, 4, 8
S1, S2, S3, JUNK = slice(12, 16), slice(16, 20), slice(20, 24), slice(24, 32)
ROUTE = [(0, 1), (1, 2), (2, 0)]  # (layer, head): a0.h1 -> a1.h2 -> a2.h0


class Attention(nn.Module):
    """Causal softmax attention over HEADS heads of width DH, projections q, k, v, o."""

    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(WIDTH, WIDTH, bias=False), nn.Linear(WIDTH, WIDTH, bias=False)
        self.v, self.o = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, h):
        n, t, d = h.shape
        split = lambda x: x.view(n, t, HEADS, -1).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q(h)), split(self.k(h)), split(self.v(h))
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        causal = torch.ones(t, t, dtype=torch.bool, device=h.device).tril()
        pattern = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        return self.o((pattern @ v).transpose(1, 2).reshape(n, t, d))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.Identity(), Attention(), nn.Identity()
        self.mlp = nn.Sequential(
            nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH)
        )

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Planted(nn.Module):
    """Token and position embeddings, 3 blocks without norms, an unembedding."""

    def __init__(self):
        super().__init__()
        self.embed, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(16, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.ln_f, self.head = nn.Identity(), nn.Linear(WIDTH, VOCAB)
        self.eval()

    def forward(self, input_ids):
        x = self.embed(input_ids) + self.pos(torch.arange(input_ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def planted() -> Planted:
    """The planted model: the answer (the token at position 0) moved by each route head's value
    into the next one's subspace, every other head and MLP reading and writing a subspace the
    answer never touches."""
    model = Planted()
    g = torch.Generator().manual_seed(5)
    junk = lambda *shape: torch.randn(*shape, generator=g) * 0.5  # noqa: E731
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.embed.weight[:, :VOCAB] = torch.eye(VOCAB)
        model.pos.weight[:, JUNK] = junk(16, 8)
        sources = {0: slice(0, 4), 1: S1, 2: S2}
        targets = {0: S1, 1: S2, 2: S3}
        for layer, block in enumerate(model.blocks):
            attn = block.attn
            for h in range(HEADS):
                cols = slice(h * DH, (h + 1) * DH)
                attn.q.weight[cols, JUNK], attn.k.weight[cols, JUNK] = junk(8, 8), junk(8, 8)
                if (layer, h) in ROUTE:
                    attn.v.weight[cols.start : cols.start + 4, sources[layer]] = torch.eye(4)
                    attn.o.weight[targets[layer], cols.start : cols.start + 4] = torch.eye(4)
                else:
                    attn.v.weight[cols, JUNK], attn.o.weight[JUNK, cols] = junk(8, 8), junk(8, 8)
            block.mlp[0].weight[:, JUNK], block.mlp[2].weight[JUNK] = junk(64, 8), junk(8, 64)
        model.head.weight[:4, S3] = torch.eye(4)
    return model


def planted_pairs() -> dict:
    """6 pairs of 5 tokens: the answer at position 0 of the clean half, a wrong one there in the
    corrupt half."""
    g = torch.Generator().manual_seed(2)
    clean = torch.randint(4, VOCAB, (6, 5), generator=g)
    answer = torch.randint(0, 4, (6,), generator=g)
    wrong = (answer + torch.randint(1, 4, (6,), generator=g)) % 4
    clean[:, 0] = answer
    corrupt = clean.clone()
    corrupt[:, 0] = wrong
    return {"input_ids": clean, "corrupt_ids": corrupt, "answer": answer[:, None],
            "wrong": wrong[:, None]}  # fmt: skip


def planted_run(out: Path, env: dict) -> Path:
    """The circuit run on the planted model; returns its run directory."""
    pairs = planted_pairs()
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"clean_ids": pairs["input_ids"], "corrupt_ids": pairs["corrupt_ids"],
                "answer": pairs["answer"][:, 0], "wrong": pairs["wrong"][:, 0]},
               out / "planted_pairs.pt")  # fmt: skip
    run_dir = out / "planted"
    command = [
        sys.executable, "-m", "probe", "model=custom",
        "model._target_=plot_docs.planted", PLANTED_ANATOMY,
        "dataset=pairs", f"dataset.path={out / 'planted_pairs.pt'}", "probes=none",
        "circuit.method=[eap,exact]", f"hydra.run.dir={run_dir}", "overwrite=true",
    ]  # fmt: skip
    subprocess.run(command, cwd=ROOT, env=env, check=True)
    return run_dir


BLOCK = re.compile(r"^```(python|bash)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def script_of(text: str) -> str:
    """One Python script running a tutorial's blocks in order: python blocks as they are, each
    bash block of `python -m probe` commands through bash (`python` being this interpreter)."""
    parts = []
    for lang, body in BLOCK.findall(text):
        if lang == "python":
            parts.append(body)
        elif re.search(r"^python -m probe", body, re.MULTILINE):
            parts.append(
                f"import subprocess\nsubprocess.run(['bash', '-euc', {body!r}], check=True)\n"
            )
    return "\n".join(parts)


def tutorial_run(name: str, out: Path, env: dict) -> Path:
    """The tutorial's blocks, in order, in a fresh folder; returns the folder."""
    work = out / f"tutorial_{name}"
    work.mkdir(parents=True, exist_ok=True)
    text = (ROOT / "docs" / "tutorials" / f"{name}.md").read_text()
    (work / "tutorial.py").write_text(script_of(text))
    subprocess.run([sys.executable, "tutorial.py"], cwd=work, env=env, check=True)
    return work


def small(source: Path, name: str) -> None:
    """The figure in 256 colours, into docs/images/NAME."""
    from PIL import Image

    target = IMAGES / name
    Image.open(source).convert("RGB").quantize(256).save(target, optimize=True)
    print(f"wrote {target.relative_to(ROOT)} ({target.stat().st_size // 1024} KiB)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, nargs="?", default=None, help="where the runs go")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="plot_docs_"))
    out = out.resolve()
    env = environment(out)
    run_dir = planted_run(out, env)
    for figure in ("circuit.png", "faithfulness.png"):
        small(run_dir / figure, figure)
    for name, figures in TUTORIALS.items():
        work = tutorial_run(name, out, env)
        for written, docs_name in figures.items():
            small(work / written, docs_name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
