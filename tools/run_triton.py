"""Runs real Triton Inference Server (the one the nvidia-pytriton wheel bundles) with the `ascend` backend.

    python tools/run_triton.py [--model-repository model_repository] [--backend-directory DIR]
                               [--http-port 8000] [--grpc-port 8001] [--metrics-port 8002] [-- TRITON_ARGS...]
    python tools/run_triton.py --install /opt/tritonserver
    /opt/tritonserver/bin/tritonserver TRITON_ARGS...

The first assembles a backend directory from the wheel's python backend (libtriton_python.so,
the stub for this Python, triton_python_backend_utils.py) and `triton_backend/ascend`, then
execs `tritonserver` with the library path and PATH the stub needs. Triton itself is used as
shipped: it is the reference implementation of the protocol.

The `ascend` backend is also laid out as `onnxruntime/model.py`, so that a model folder without
config.pbtxt serves as it does on the KServe server: Triton's auto-complete names the backend of
a folder holding `model.onnx` `onnxruntime` (core src/model_config_utils.cc,
AutoCompleteBackendFields), and finding no `libtriton_onnxruntime.so` it runs a Python-based
backend's `<backend-directory>/onnxruntime/model.py` (core src/backend_model.cc,
GetBackendRuntimeLibraryName). This shadows Triton's own ONNX Runtime backend, which the wheel
does not carry (where its library is present, it wins); `--no-onnxruntime-as-ascend` leaves it out.

`--install PREFIX` lays Triton out as NVIDIA's images do, for whatever starts `tritonserver`
itself (Seldon Core 2's triton ServerConfig): the backends in PREFIX/backends, Triton's default
--backend-directory when PREFIX is /opt/tritonserver, and PREFIX/bin/tritonserver, which execs
the wheel's tritonserver with its arguments unchanged, in the same environment.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BACKEND = ROOT / "triton_backend" / "ascend"


def pytriton_paths() -> tuple[Path, Path]:
    """(pytriton/tritonserver, nvidia_pytriton.libs) of the installed wheel."""
    import pytriton

    package = Path(pytriton.__file__).resolve().parent
    return package / "tritonserver", package.parent / "nvidia_pytriton.libs"


def assemble_backends(target: Path, onnxruntime_as_ascend: bool = True) -> Path:
    """`<target>/python` from the wheel, `<target>/ascend` from triton_backend/ascend, and (unless
    `onnxruntime_as_ascend` is false) the same backend as `<target>/onnxruntime` (see the module's doc).

    Copies, not symlinks: Triton refuses a backend library whose real path escapes the
    backend directory. The default mode copies afresh on every start, so edits to model.py take effect.
    """
    server, _ = pytriton_paths()
    python, ascend = target / "python", target / "ascend"
    python.mkdir(parents=True, exist_ok=True)
    ascend.mkdir(parents=True, exist_ok=True)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    files = {
        python / "libtriton_python.so": server / "backends/python/libtriton_python.so",
        # Without the utils module beside the library every model fails with "No module named 'model'".
        python / "triton_python_backend_utils.py": server / "backends/python/triton_python_backend_utils.py",
        python / "triton_python_backend_stub": server / f"python_backend_stubs/{version}/triton_python_backend_stub",
        ascend / "model.py": BACKEND / "model.py",
    }
    alias = target / "onnxruntime" / "model.py"
    alias.unlink(missing_ok=True)  # a previous start's, so that turning it off takes effect
    if onnxruntime_as_ascend:
        alias.parent.mkdir(exist_ok=True)
        files[alias] = BACKEND / "model.py"
    elif alias.parent.is_dir() and not any(alias.parent.iterdir()):
        alias.parent.rmdir()
    for copy, source in files.items():
        copy.unlink(missing_ok=True)
        shutil.copy2(source, copy)
    return target


def install(prefix: Path, onnxruntime_as_ascend: bool = True) -> Path:
    """PREFIX/backends, and PREFIX/bin/tritonserver: this script's pass-through mode, run by this Python."""
    backends = assemble_backends(prefix / "backends", onnxruntime_as_ascend)
    wrapper = prefix / "bin" / "tritonserver"
    wrapper.parent.mkdir(parents=True, exist_ok=True)
    run = [sys.executable, str(Path(__file__).resolve()), "--pass-through", f"--backend-directory={backends}", "--"]
    wrapper.write_text(f"#!/bin/sh\n# Written by tools/run_triton.py --install.\nexec {shlex.join(run)} \"$@\"\n")
    wrapper.chmod(0o755)
    return wrapper


def environment() -> dict[str, str]:
    """The stub runs the first Python on PATH (ours, with kserve_ascend installed) and needs libcudart from the wheel."""
    _, libs = pytriton_paths()
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(libs), env.get("LD_LIBRARY_PATH")]))
    return env


def command(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    server, _ = pytriton_paths()
    if args.pass_through:
        # The caller's flags after ours: Triton takes the last of a repeated flag
        # (triton-inference-server/server src/command_line_parser.cc), so theirs win.
        return [str(server / "bin" / "tritonserver"), f"--backend-directory={args.backend_directory}", *args.triton_args], environment()
    backends = assemble_backends(Path(args.backend_directory).resolve(), args.onnxruntime_as_ascend)
    argv = [
        str(server / "bin" / "tritonserver"),
        f"--model-repository={Path(args.model_repository).resolve()}",
        f"--backend-directory={backends}",
        f"--http-port={args.http_port}",
        f"--grpc-port={args.grpc_port}",
        f"--metrics-port={args.metrics_port}",
        # Where NVIDIA's images have theirs (/opt/tritonserver/caches): `--cache-config local,size=N` then works.
        f"--cache-directory={server / 'caches'}",
        *args.triton_args,
    ]
    return argv, environment()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-repository", default=str(ROOT / "model_repository"))
    parser.add_argument("--backend-directory", default=str(ROOT / "build" / "triton_backends"))
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--install", metavar="PREFIX", type=Path, help="lay out PREFIX/backends and PREFIX/bin/tritonserver, then exit")
    parser.add_argument("--pass-through", action="store_true",
                        help="run tritonserver with only --backend-directory and the flags after --, the backends as they are")
    parser.add_argument("--onnxruntime-as-ascend", action=argparse.BooleanOptionalAction, default=True,
                        help="serve models whose backend is 'onnxruntime' (a model.onnx folder without config.pbtxt)"
                        " with the ascend backend (default: yes)")
    parser.add_argument("triton_args", nargs="*", help="further tritonserver flags, after --")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.install:
        print(install(args.install.resolve(), args.onnxruntime_as_ascend))
        return
    argv, env = command(args)
    os.execve(argv[0], argv, env)


if __name__ == "__main__":
    main()
