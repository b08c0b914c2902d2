"""Every test docs/errors.md names exists: the catalogue's rows point at what checks them."""

from __future__ import annotations

import ast
import re

from tests.helpers import ROOT

NAMED = re.compile(r"`((?:[\w/]+\.py::)?(test_\w+))(?:\[[^\]]*\])?`")


def defined_tests() -> set[tuple[str, str]]:
    """(file name, test function) of every test under tests/."""
    found = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                found.add((path.name, node.name))
    return found


def test_every_test_the_error_catalogue_names_exists():
    text = (ROOT / "docs" / "errors.md").read_text()
    named = NAMED.findall(text)
    assert len(named) > 100  # the catalogue's rows, not a pattern that stopped matching
    defined = defined_tests()
    functions = {name for _, name in defined}
    missing = [
        full
        for full, name in named
        if ("::" in full and (full.split("::")[0].rsplit("/", 1)[-1], name) not in defined)
        or ("::" not in full and name not in functions)
    ]
    assert missing == []
