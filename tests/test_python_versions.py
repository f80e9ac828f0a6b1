"""The Pythons kserve-ascend runs on: 3.10 to 3.12 (issue 26, item 4).

pyproject.toml's requires-python and the Makefile's choice of interpreter say the same versions;
the code needs no newer Python than the oldest of them, as vermin (a tool that finds the minimum
version from the code: its syntax, and the standard library's modules, members and arguments it
uses) reads it; what it cannot resolve (a keyword argument of a method of an object, such as 3.11's
`loop.create_task(..., context=)`, which the suite run on 3.10 found) only running on 3.10 shows.
The `ascend` extra is narrower (onnxruntime-cann 1.22.1 has wheels for 3.10 and
3.11 only), and so is the Makefile's interpreter for its virtualenv.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from conftest import ROOT

#: Every directory of Python the project runs (the packages, the tools, the suites).
SOURCES = ["kserve_ascend", "triton_backend", "tools", "tests", "conformance", "bench"]
VERMIN = Path(sys.executable).parent / "vermin"


def vermin(*paths: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """vermin's verdict on `paths` against Python 3.10 (and nothing older is asked of them)."""
    return subprocess.run([str(VERMIN), "--target=3.10-", "--violations", "--eval-annotations", "--no-tips", *paths],
                          capture_output=True, text=True, cwd=cwd, timeout=120)


def test_the_code_runs_on_python_3_10():
    done = vermin(*SOURCES)
    assert done.returncode == 0, done.stdout + done.stderr


# Modules and members, not syntax: vermin parses with the running Python, which on 3.10 cannot read
# 3.11's (it then reports "not enough evidence" and passes).
@pytest.mark.parametrize("code, needs", [
    ("import tomllib\n", "'tomllib' module requires !2, 3.11"),
    ("from typing import Self\n", "'typing.Self' member requires !2, 3.11"),
])
def test_vermin_refuses_what_3_10_lacks(tmp_path, code, needs):
    (tmp_path / "newer.py").write_text(code)
    done = vermin("newer.py", cwd=tmp_path)
    assert done.returncode != 0 and needs in done.stdout, done.stdout


def make_variables(*names: str, path: str = os.environ["PATH"]) -> list[str]:
    """The Makefile's values of `names`, with `path` as PATH."""
    show = "show: ; $(info " + "|".join(f"$({name})" for name in names) + ")"
    done = subprocess.run([shutil.which("make"), "-s", "--no-print-directory", "--eval", show, "show"], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PATH": path}, check=True)
    return done.stdout.strip().split("|")


def test_pyproject_and_the_makefile_allow_the_same_pythons():
    requires = next(line for line in (ROOT / "pyproject.toml").read_text().splitlines() if line.startswith("requires-python"))
    allowed = SpecifierSet(requires.split("=", 1)[1].strip().strip('"'))
    versions, cann_versions = (value.split() for value in make_variables("PYTHON_VERSIONS", "CANN_PYTHON_VERSIONS"))
    assert versions == ["3.10", "3.11", "3.12"]
    assert [v for v in ("3.9", *versions, "3.13") if v in allowed] == versions
    assert set(cann_versions) < set(versions)


@pytest.mark.parametrize("pythons, chosen, cann", [
    ({"python3": "3.9", "python3.12": "3.12"}, "python3.12", ""),
    ({"python3": "3.12", "python3.10": "3.10"}, "python3.10", "python3.10"),
    ({"python3": "3.11"}, "python3", "python3"),
    ({"python3": "3.13", "python": "3.8"}, "", ""),
], ids=["3.12 beside an old python3", "3.10", "python3 3.11", "none"])
def test_the_makefile_finds_a_supported_python(tmp_path, pythons, chosen, cann):
    """Stand-ins on an otherwise empty PATH, each answering the version question with its version."""
    for name, version in pythons.items():
        (tmp_path / name).write_text(f"#!/bin/sh\necho {version}\n")
        (tmp_path / name).chmod(0o755)
    assert make_variables("PYTHON", "CANN_PYTHON", path=str(tmp_path)) == [chosen, cann]
