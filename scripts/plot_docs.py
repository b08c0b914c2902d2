"""Draw the figures the docs embed from real runs of probe, into docs/images/.

    python scripts/plot_docs.py [OUT]

- circuit.png and faithfulness.png (docs/circuits.md): a circuit run from the command line
  (`circuit.method=[eap,exact]`, every other key at its default) on the planted circuit of
  tests/circuits/test_planted.py, a 3-layer, 4-head model whose weights carry the answer through
  a0.h1, a1.h2 and a2.h0, over that test's 6 pairs; the figures are the ones the run draws.
  The model and its pairs are probe.testing.toy_circuits' `planted` and `planted_pairs`, which
  test_planted.py checks.
- tutorial_units.png (docs/tutorials/your_model.md), tutorial_circuit.png and
  tutorial_faithfulness.png (docs/tutorials/circuit.md): the tutorials' own blocks run in order
  in a fresh folder (probe.testing.tutorials' `script_of`: the program tests/test_tutorials.py
  runs), and the figures they write.

OUT (default: a temporary folder) keeps the runs. Each figure is copied in 256 colours (a third of
the bytes, no difference to the eye).
"""

from __future__ import annotations

import argparse
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from probe.testing.toy_circuits import HEADS, overrides, planted_pairs  # noqa: E402
from probe.testing.tutorials import script_of  # noqa: E402

IMAGES = ROOT / "docs" / "images"
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
    paths = [str(ROOT), os.environ.get("PYTHONPATH")]
    path = os.pathsep.join(filter(None, paths))
    return {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": path,
        "MPLBACKEND": "Agg",
    }


def planted_anatomy() -> str:
    """probe.testing.toy_circuits' anatomy keys of the planted model, as a command-line key."""
    keys = overrides(HEADS)
    qkv = ",".join(keys["qkv"])
    rest = ",".join(f"{k}:{v}" for k, v in keys.items() if k != "qkv")
    return f"+model.anatomy={{qkv:[{qkv}],{rest}}}"


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
        "model._target_=probe.testing.toy_circuits.planted", planted_anatomy(),
        "dataset=pairs", f"dataset.path={out / 'planted_pairs.pt'}", "probes=none",
        "circuit.method=[eap,exact]", f"hydra.run.dir={run_dir}", "overwrite=true",
    ]  # fmt: skip
    subprocess.run(command, cwd=ROOT, env=env, check=True)
    return run_dir


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
