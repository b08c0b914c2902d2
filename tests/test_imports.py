"""The package's imports run one way: from launch down to models, never up, never in a circle.

Every `import` of every module counts, those inside functions too (a lazy import is still a
dependency) and those under `if TYPE_CHECKING:` (a type is a dependency too: a data type that
names its consumers' types, or calls them, closes a loop with them). The core modules (config, plan,
specs, choices, site_keys, errors, checks, model_checks, shared_checks, shipped, callable, layout,
watch_options) import no stage; the entry points at the top (`__main__`, the `python -m` modules,
a stage's own `__main__`) may import anything, and nothing imports them. `probe.testing` (what the tests and the benchmark scripts
share) comes last: nothing in the pipeline imports it. The scripts import nothing from the test
package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import probe

STAGES = [
    "models", "data", "hooks", "stats", "store", "attribute", "intervene", "circuits", "graphs", "read",
    "analysis", "report", "launch", "train", "integrations", "testing",
]  # fmt: skip
CORE = {
    "probe.config",
    "probe.plan",
    "probe.specs",
    "probe.errors",
    "probe.checks",
    "probe.shared_checks",
    "probe.callable",
    "probe.shipped",
    "probe.choices",
    "probe.model_checks",
    "probe.layout",
    "probe.watch_options",
    "probe.site_keys",
}
PACKAGE = Path(probe.__file__).parent


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    found = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if "conf" in parts:
            continue
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("probe"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("probe"):
            for a in node.names:
                name = f"{node.module}.{a.name}"
                found.add(name if name in known else node.module)
    return {name for name in found if name in known}


def unresolved(package: Path = PACKAGE) -> list[str]:
    """`probe.X` imports that name no module of the package (a module moved, its importer not)."""
    known = modules(package)
    bad = []
    for name, path in known.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("probe"):
                if node.module not in known and node.module != "probe.conf":
                    bad.append(f"{name} imports {node.module}")
            elif isinstance(node, ast.Import):
                bad += [
                    f"{name} imports {a.name}"
                    for a in node.names
                    if a.name.startswith("probe.") and a.name not in known
                ]
    return sorted(bad)


def graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    known = modules(package)
    return {name: imports(path, known) - {name} for name, path in known.items()}


def stage(name: str) -> str | None:
    parts = name.split(".")
    if parts[-1] == "__main__":  # a stage's `python -m` entry point
        return None
    return parts[1] if len(parts) > 2 and parts[1] in STAGES else None


def upward(edges: dict[str, set[str]]) -> list[str]:
    bad = []
    for name, deps in sorted(edges.items()):
        for dep in sorted(deps):
            if name in CORE and dep not in CORE:
                bad.append(f"core {name} imports {dep}")
            elif stage(name) and stage(dep):
                if STAGES.index(stage(dep)) > STAGES.index(stage(name)):
                    bad.append(f"{name} imports {dep}, a later stage")
            elif stage(name) and dep not in CORE and dep != "probe":
                bad.append(f"{name} imports the entry point {dep}")
    return bad


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(edges[node]):
            if state.get(dep) == "open":
                found.append(path[path.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    return found


def test_no_upward_import():
    assert upward(graph()) == []


def test_every_import_names_a_module_of_the_package():
    assert unresolved() == []


def test_no_cycle():
    assert cycles(graph()) == []


def test_every_module_has_a_place():
    """A module is a stage's, core, or an entry point at the top; no stray flat module."""
    entry = {
        "probe",
        "probe.__main__",
        "probe.summarize",
        "probe.analyze",
        "probe.plot",
        "probe.fit",
    }
    entry |= {"probe.sites", *(f"probe.{s}" for s in STAGES)}
    entry |= {m for m in modules() if m.endswith(".__main__")}
    assert [m for m in modules() if stage(m) is None and m not in CORE | entry] == []


def test_no_script_imports_the_test_package():
    """scripts/ takes what it shares with the tests from probe.testing: no `tests.*` import, and
    no model named by a `tests.` target."""
    found = []
    for path in sorted((PACKAGE.parent / "scripts").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = [node.value.partition("_target_=")[2]] if "_target_=" in node.value else []
            else:
                continue
            found += [f"{path.name}:{node.lineno} {n}" for n in names if n.split(".")[0] == "tests"]
    assert found == []


def test_the_walk_finds_a_cycle_and_an_upward_import(tmp_path):
    """The checks themselves: a lazy import up from models and one back down make both."""
    pkg = tmp_path / "probe"
    for sub in ("models", "launch"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "models" / "a.py").write_text("def f():\n    from probe.launch import b\n")
    (pkg / "launch" / "b.py").write_text("from probe.models.a import f\n")
    (pkg / "models" / "d.py").write_text("from probe.models.e import g\n")
    (pkg / "models" / "e.py").write_text(  # a type-only import closes a loop too
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from probe.models.d import D\n"
    )
    (pkg / "launch" / "c.py").write_text("from probe.gone import x\n")
    assert unresolved(pkg) == ["probe.launch.c imports probe.gone"]
    edges = graph(pkg)
    assert upward(edges) == ["probe.models.a imports probe.launch.b, a later stage"]
    assert cycles(edges) == [
        ["probe.launch.b", "probe.models.a", "probe.launch.b"],
        ["probe.models.d", "probe.models.e", "probe.models.d"],
    ]


def test_every_package_is_installed():
    """pyproject.toml lists each subpackage of probe/ (a package missing there imports from a
    checkout and is absent from an installed wheel)."""
    import tomllib

    listed = set(
        tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"][
            "packages"
        ]
    )
    found = {
        ".".join(p.parent.relative_to(PACKAGE.parent).parts)
        for p in PACKAGE.rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    assert sorted(found - listed) == []
