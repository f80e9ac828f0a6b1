"""`--serve NAME`: a server of this project started for one run of the suite, and stopped after it.

It serves conformance/models with explicit model control and every model loaded at start-up
(the repository cases unload and load models), on free ports, reached over loopback.
Only this path needs the project's servers; the suite itself never imports them.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "conformance" / "models"
SERVERS = ("kserve-ascend", "triton")
#: Loading conformance/models takes seconds; Triton starts a Python stub per model instance first.
READY_TIMEOUT_S = 120
#: Above kserve-ascend's default --shutdown_timeout_s (20 s), which drains in-flight requests.
STOP_TIMEOUT_S = 30


class NotReady(RuntimeError):
    """The server exited or did not become ready; the message ends with its log's tail."""


def command(name: str, http: int, grpc: int, metrics: int, workdir: Path) -> list[str]:
    if name == "kserve-ascend":
        return [
            sys.executable, "-m", "kserve_ascend", "--model_dir", str(MODELS),
            "--http_port", str(http), "--grpc_port", str(grpc), "--metrics_port", str(metrics),
            "--model_control_mode", "explicit", "--load_model", "*",
        ]
    return [
        sys.executable, str(ROOT / "tools" / "run_triton.py"), "--model-repository", str(MODELS),
        "--backend-directory", str(workdir / "triton_backends"),
        "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
        "--", "--model-control-mode=explicit", "--load-model=*",
        # Loopback only (metrics follows the HTTP address); kserve-ascend, like KServe, binds every interface.
        "--http-address=127.0.0.1", "--grpc-address=127.0.0.1",
    ]


def free_ports(count: int) -> list[int]:
    """`count` different ports free now: bound at the same time, the kernel cannot hand one out twice."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


@contextlib.contextmanager
def served(name: str, workdir: Path) -> Iterator[tuple[str, str]]:
    """Starts server `name` (its log: workdir/NAME.log), yields its (HTTP, gRPC) HOST:PORT once ready, then stops it."""
    http, grpc, metrics = free_ports(3)
    log = workdir / f"{name}.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            command(name, http, grpc, metrics, workdir), stdout=out, stderr=subprocess.STDOUT, cwd=ROOT
        )
    try:
        wait_ready(name, process, f"http://127.0.0.1:{http}/v2/health/ready", log)
        yield f"127.0.0.1:{http}", f"127.0.0.1:{grpc}"
    finally:
        stop(process)


def wait_ready(name: str, process: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise NotReady(f"{name} exited with {process.returncode} before it was ready; the end of {log}:\n{tail(log)}")
        with contextlib.suppress(requests.RequestException):
            if requests.get(url, timeout=1).status_code == 200:
                return
        time.sleep(0.2)
    raise NotReady(f"{name} was not ready after {READY_TIMEOUT_S} s; the end of {log}:\n{tail(log)}")


def stop(process: subprocess.Popen) -> None:
    """SIGTERM, as Kubernetes stops a pod: both servers drain and exit; SIGKILL only if one hangs."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        print(f"the server did not stop within {STOP_TIMEOUT_S} s of SIGTERM: killed", file=sys.stderr)
        process.kill()
        process.wait()


def tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
