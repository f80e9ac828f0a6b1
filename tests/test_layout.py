"""The package's shape: every module installs, and no two modules need each other (an import circle)."""

from __future__ import annotations

import ast
from pathlib import Path

import setuptools

from conftest import ROOT

PACKAGE = ROOT / "kserve_ascend"


def modules() -> dict[str, Path]:
    return {
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): path
        for path in PACKAGE.rglob("*.py")
    }


def test_every_module_is_in_a_package_a_plain_install_finds():
    """`pip install .` (the images) installs what setuptools finds: a folder without __init__.py would be left out."""
    found = set(setuptools.find_packages(str(ROOT), include=["kserve_ascend*"]))
    folders = {".".join(path.parent.relative_to(ROOT).parts) for path in PACKAGE.rglob("*.py")}
    assert folders <= found, sorted(folders - found)


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that `name` imports, anywhere in it (inside functions and TYPE_CHECKING too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]) if node.level else ""
            module = ".".join(filter(None, [base, node.module]))
            targets = [module] + [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(target for target in targets if target in known and target != name)
    return found


def test_no_module_imports_one_that_imports_it_back():
    graph = {name: imports(name, path, set(modules())) for name, path in modules().items()}
    circles, done = [], set()

    def visit(name: str, trail: list[str]) -> None:
        if name in trail:
            circles.append(trail[trail.index(name):] + [name])
            return
        if name in done:
            return
        for target in sorted(graph[name]):
            visit(target, [*trail, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
    assert not circles, "\n".join(" -> ".join(circle) for circle in circles)
