"""Every tutorial under docs/tutorials/ runs as written: its ```python blocks, and its ```bash
blocks of `python -m probe...` commands, in order, in a fresh directory, one subprocess per
tutorial. Each must write every figure its text promises, and pass its own checks (the `assert`
lines the reader sees, comparing what probe wrote with the same value computed another way)."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from probe.testing.tutorials import script_of
from tests.helpers import ROOT

TUTORIALS = sorted((ROOT / "docs" / "tutorials").glob("*.md"))
FIGURE = re.compile(r"`(outputs/[\w./-]+\.png)`")  # a figure the text promises
TIMEOUT_S = 300  # each takes well under a minute of one core; this is a guard against hangs


def interpreter_dir(tmp_path: Path) -> Path:
    """A folder whose `python` runs this test's interpreter, for the bash blocks' commands."""
    folder = tmp_path / "bin"
    folder.mkdir()
    wrapper = folder / "python"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return folder


def test_the_tutorials_are_there_each_with_a_figure_and_a_check():
    assert {"circuit", "watch_training", "your_model"} <= {p.stem for p in TUTORIALS}
    for path in TUTORIALS:
        text = path.read_text()
        assert FIGURE.findall(text), path.name
        assert re.search(r"^assert ", script_of(text), re.MULTILINE), path.name


@pytest.mark.parametrize("path", TUTORIALS, ids=lambda p: p.stem)
def test_the_tutorial_runs_as_written_and_draws_its_figures(path, tmp_path):
    text = path.read_text()
    work = tmp_path / "work"
    work.mkdir()
    (work / "tutorial.py").write_text(script_of(text))
    env = {
        **os.environ,
        "PATH": f"{interpreter_dir(tmp_path)}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "MPLBACKEND": "Agg",
    }
    done = subprocess.run(
        [sys.executable, "tutorial.py"], cwd=work, env=env, capture_output=True, text=True,
        timeout=TIMEOUT_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = FIGURE.findall(text)
    missing = [f for f in figures if not (work / f).is_file()]
    assert missing == []
    assert all((work / f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for f in figures)
