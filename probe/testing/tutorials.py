"""The tutorials under docs/tutorials/ as programs: their ```python blocks, and their ```bash
blocks of `python -m probe...` commands, in order (tests/test_tutorials.py runs them; so does
scripts/plot_docs.py, for the figures the docs show)."""

from __future__ import annotations

import re

BLOCK = re.compile(r"^```(python|bash)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def script_of(text: str) -> str:
    """One Python script running a tutorial's blocks in order: python blocks as they are, each
    bash block of `python -m probe` commands through bash (`python` being the interpreter the
    script's PATH names)."""
    parts = []
    for lang, body in BLOCK.findall(text):
        if lang == "python":
            parts.append(body)
        elif re.search(r"^python -m probe", body, re.MULTILINE):
            parts.append(
                f"import subprocess\nsubprocess.run(['bash', '-euc', {body!r}], check=True)\n"
            )
    return "\n".join(parts)
