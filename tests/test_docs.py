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


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")  # not images: figures a page promises


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub makes of a page's headings: lower case, punctuation dropped, spaces to -."""
    anchors = set()
    in_code = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_every_relative_link_in_the_docs_reaches_its_file_and_heading():
    """Links between pages (the moves of docs/bench/ and docs/engineering/ among them) resolve."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        for target in LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif (
                anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest.read_text())
            ):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert len(pages) > 20  # the docs, not a glob that stopped matching
    assert broken == []
