"""The package's shape: every module installs, no two modules need each other (an import circle), and the
bench's scripts start."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
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


BENCH_SCRIPTS = sorted(path.name for path in (ROOT / "bench").glob("*.py") if "argparse" in path.read_text())


@pytest.mark.parametrize("script", BENCH_SCRIPTS)
def test_bench_scripts_start(script):
    """`make bench` is not part of `make test`, so its scripts' imports are checked here: each answers --help."""
    done = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout
