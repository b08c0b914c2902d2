"""Every test docs/errors.md names exists: the catalogue's rows point at what checks them."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

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


IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)|<img\s[^>]*?src=[\"']([^\"']+)[\"']", re.IGNORECASE)
SIGNATURES = {".png": b"\x89PNG\r\n\x1a\n", ".jpg": b"\xff\xd8\xff", ".jpeg": b"\xff\xd8\xff"}


def embedded_images() -> list[tuple[Path, str]]:
    """(page, target) of every image README.md and docs/**/*.md embed: markdown's ![...](...) and
    HTML's <img src=...>, outside code blocks."""
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        prose = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
        found += [(page, a or b) for a, b in IMAGE.findall(prose)]
    return found


def test_every_image_a_page_embeds_is_a_picture_there():
    """docs/circuits.md embedded circuit.png and faithfulness.png, which were not there."""
    images = embedded_images()
    assert len(images) >= 8  # the pages' figures, not a pattern that stopped matching
    bad = []
    for page, target in images:
        if "://" in target:
            bad.append(f"{page.relative_to(ROOT)}: {target} (not in the repository)")
            continue
        path = (page.parent / target).resolve()
        where = f"{page.relative_to(ROOT)}: {target}"
        if not path.is_file():
            bad.append(f"{where} (no such file)")
        elif path.suffix.lower() not in SIGNATURES:
            bad.append(f"{where} (not a .png or .jpg)")
        elif not path.read_bytes().startswith(SIGNATURES[path.suffix.lower()]):
            bad.append(f"{where} (not a {path.suffix} file)")
        elif path.stat().st_size < 2000:
            bad.append(f"{where} ({path.stat().st_size} bytes: no figure)")
    assert bad == []


def test_every_embedded_image_decodes_to_a_figure():
    """Each embedded image decodes whole (not a truncated or corrupt file) to a figure of some
    size with more than one colour in it, and stays small enough for a page."""
    image = pytest.importorskip("PIL.Image")
    for page, target in embedded_images():
        path = (page.parent / target).resolve()
        with image.open(path) as picture:
            picture.load()
            width, height = picture.size
            colours = picture.convert("RGB").getcolors(maxcolors=1 << 24)
        assert width >= 200 and height >= 100, (target, picture.size)
        assert len(colours) > 1, target
        assert path.stat().st_size < 400_000, (target, path.stat().st_size)


ENTRY = re.compile(r"^\*\*(.+?)\.\*\* ", re.MULTILINE)
FIELD_WORDS = [
    "EAP", "EAP-IG", "CPR", "CMD", "transcoder", "cross-layer transcoder", "attribution graph",
    "replacement model", "node", "error node", "objective", "CAM", "SAE", "top-k", "shard",
    "resume", "SWMR", "run part", "component graph", "feature", "unit", "edge", "circuit",
]  # fmt: skip


def test_the_glossary_defines_the_fields_words_in_order_each_with_its_page():
    text = (ROOT / "docs" / "glossary.md").read_text()
    terms = ENTRY.findall(text)
    assert len(terms) > 30  # the entries, not a pattern that stopped matching
    assert [t for t in FIELD_WORDS if t not in terms] == []
    assert terms == sorted(terms, key=str.casefold)
    entries = re.split(r"^\*\*", text, flags=re.MULTILINE)[1:]
    assert len(entries) == len(terms)
    unlinked = [t for t, e in zip(terms, entries, strict=True) if not LINK.search(e)]
    assert unlinked == ["layer"]  # a module's name; every other entry says where it is told


FIRST_SCREEN_TERMS = [
    "probing", "glob patterns", "probes", "Hydra", "captures", "hooks", "HDF5", "statistics",
    "ablations", "activation patching", "steering", "timm", "sweeps", "torchrun", "linear probes",
    "CKA", "glossary", "SLURM",
]  # fmt: skip
GLOSS = re.compile(r"\s*(\(|:|,\s+(a|an|the)\s)")  # what explains a word where it first comes


def test_the_readmes_first_screen_explains_or_links_each_word_of_the_field():
    """Up to the short tour (the introduction and the set-up), the first use of each term of art
    is a link's text, or is followed by its explanation: "(...)", ": ..." or ", a ..."."""
    text = (ROOT / "README.md").read_text()
    screen = text[text.index("\n") : text.index("## A short tour")]  # after the title
    screen = re.sub(r"^```.*?^```", "", screen, flags=re.MULTILINE | re.DOTALL)
    screen = re.sub(r"`[^`]*`", "``", screen)  # names in code are not uses of a word
    screen = re.sub(r"\]\([^)\s]+\)", "]()", screen)  # a link's target is not prose
    links = [m.span(1) for m in re.finditer(r"\[([^\]]*)\]\(\)", screen)]
    bare = []
    for term in FIRST_SCREEN_TERMS:
        first = re.search(rf"\b{re.escape(term)}\b", screen, re.IGNORECASE)
        assert first, term
        linked = any(a <= first.start() and first.end() <= b for a, b in links)
        if not linked and not GLOSS.match(screen, first.end()):
            bare.append(f"{term}: ...{screen[first.start() : first.end() + 30]!r}")
    assert bare == []
