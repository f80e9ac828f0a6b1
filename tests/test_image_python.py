"""kserve-ascend's Python packages inside a CANN image (issue 26, item 3).

Ascend's CANN images pip-install CANN's Python dependencies into the image's Python with
numpy==1.24.0 and protobuf==3.20 (tests/data/cann-8.2.rc1-python-packages.txt, from the images'
Dockerfiles). kserve-ascend's cannot meet them: the first test shows it with pip's resolver. So
docker/kserve.Dockerfile installs kserve-ascend into a virtual environment of its own, first on
PATH, that sees CANN's packages behind its own (--system-site-packages): CANN's Python keeps its
pins, and the server runs with the numpy and protobuf it needs. The second test checks the
Dockerfile does that, and runs its install command (a dry run) in such an environment with CANN's
pinned numpy and protobuf installed behind it: pip resolves, putting its own numpy and protobuf
first. What only a CANN image can show (docker build; CANN's operator compiler importing its
packages inside the server) is for a host with Docker and an NPU.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from conftest import ROOT
from test_manifests import DOCKER, instructions

CANN_PACKAGES = ROOT / "tests" / "data" / "cann-8.2.rc1-python-packages.txt"
#: pip's resolver may fetch metadata from the index: bounded.
PIP_TIMEOUT_S = 300


def cann_pins() -> list[str]:
    (line,) = [line for line in CANN_PACKAGES.read_text().splitlines() if line and not line.startswith("#")]
    return [word for word in line.split() if "==" in word]


def ascend_requirements() -> list[str]:
    """What `pip install '.[ascend]'` asks for: kserve-ascend's dependencies and its `ascend` extra."""
    wanted = []
    for text in importlib.metadata.requires("kserve-ascend"):
        requirement = Requirement(text)
        if requirement.marker is None or requirement.marker.evaluate({"extra": "ascend"}):
            requirement.marker = None
            wanted.append(str(requirement))
    return wanted


def pip(python: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-m", "pip", *args], capture_output=True, text=True, cwd=ROOT, timeout=PIP_TIMEOUT_S)


@pytest.mark.parametrize("pin", cann_pins())
def test_cann_pins_conflict_with_what_kserve_ascend_needs(tmp_path, pin):
    (tmp_path / "constraints.txt").write_text(pin + "\n")
    done = pip(Path(sys.executable), "install", "--dry-run", "--ignore-installed", *ascend_requirements(),
               "-c", str(tmp_path / "constraints.txt"))
    said = done.stdout + done.stderr
    assert done.returncode != 0 and "ResolutionImpossible" in said, said
    # pip names the constraint and what of ours it met (a requirement of ours, or of kserve, tritonclient...).
    name = pin.split("==")[0]
    assert f"The user requested (constraint) {pin}" in said
    assert re.search(rf"(The user requested|depends on) {name}[<>]", said), said


def test_the_image_installs_kserve_ascend_in_its_own_environment_beside_cann_pins(tmp_path):
    steps = instructions(DOCKER / "kserve.Dockerfile")
    environment = dict(arguments.split("=", 1) for instruction, arguments in steps if instruction == "ENV" and "=" in arguments)
    assert environment["VIRTUAL_ENV"].startswith("/")
    assert environment["PATH"] == "${VIRTUAL_ENV}/bin:${PATH}"  # its pip, python and kserve-ascend first
    path_set = steps.index(("ENV", "PATH=${VIRTUAL_ENV}/bin:${PATH}"))
    (install,) = [i for i, (instruction, arguments) in enumerate(steps) if instruction == "RUN" and "pip install" in arguments]
    assert install > path_set
    commands = [shlex.split(command) for command in steps[install][1].split("&&")]
    assert commands[0] == ["python3", "-m", "venv", "--system-site-packages", "${VIRTUAL_ENV}"], commands
    assert commands[-1] == ["pip", "check"]
    (arguments,) = [command[2:] for command in commands if command[:2] == ["pip", "install"]]
    assert arguments[-1] == ".[ascend]"
    # The Triton image, on this one, installs pytriton into the same environment: its PATH keeps the base's.
    assert all(a.endswith(":${PATH}") for i, a in instructions(DOCKER / "triton.Dockerfile") if i == "ENV" and a.startswith("PATH="))

    # An environment like the image's: CANN's pinned packages installed outside it, behind its own
    # site-packages on sys.path, as --system-site-packages puts the image's Python's.
    cann = tmp_path / "cann-site-packages"
    done = pip(Path(sys.executable), "install", "--quiet", "--no-deps", "--target", str(cann), *cann_pins())
    assert done.returncode == 0, done.stderr
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "venv")], check=True, timeout=PIP_TIMEOUT_S)
    python = tmp_path / "venv" / "bin" / "python"
    own = Path(sysconfig.get_path("purelib", vars={"base": str(tmp_path / "venv"), "platbase": str(tmp_path / "venv")}))
    (own / "cann-site-packages.pth").write_text(f"{cann}\n")
    seen = subprocess.run([str(python), "-c", "import numpy, google.protobuf as p; print(numpy.__version__, p.__version__)"],
                          capture_output=True, text=True, check=True).stdout.split()
    assert seen == ["1.24.0", "3.20.0"]  # CANN's, visible to the environment

    report = tmp_path / "report.json"
    done = pip(python, "install", "--dry-run", "--quiet", "--report", str(report), *arguments)
    assert done.returncode == 0, done.stderr
    planned = {item["metadata"]["name"].lower(): Version(item["metadata"]["version"]) for item in json.loads(report.read_text())["install"]}
    assert planned["numpy"] >= Version("1.26.4") and planned["protobuf"] >= Version("6.31")  # ours, into the environment
    assert planned["onnxruntime-cann"] == Version("1.22.1") and "onnxruntime" not in planned
