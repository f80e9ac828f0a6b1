"""Fixtures that start real server processes on free loopback ports."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

ROOT = Path(__file__).resolve().parent.parent
REPOSITORY = ROOT / "model_repository"
#: The FAKE pyACL module: on a server's PYTHONPATH it is imported as `acl`.
FAKE_ACL = ROOT / "tests" / "fake_acl"


def core_request(inputs: dict, rows: int = 1, priority: int | None = None, timeout_us: int | None = None):
    """A request as the core's schedulers take it (`contracts.Request`), for tests that drive a scheduler directly."""
    from kserve_ascend.core.contracts import Request, RequestOptions
    from kserve_ascend.core.stats import RequestTiming

    return Request(inputs, rows, (), RequestOptions({}, priority, timeout_us), RequestTiming())


def load_fake_acl():
    """A fresh copy of the FAKE pyACL module, loaded from its file under its own name
    (so `import acl` stays unresolvable in the test process)."""
    spec = importlib.util.spec_from_file_location("tests_fake_acl", FAKE_ACL / "acl.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    assert module.FAKE
    return module


def fake_acl_env(faults: Path | None = None) -> dict[str, str]:
    """A server's environment additions that make it import the FAKE pyACL as `acl`, and (`faults`)
    read its fault-control file."""
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(FAKE_ACL), os.environ.get("PYTHONPATH")]))}
    if faults is not None:
        env["FAKE_ACL_FAULTS"] = str(faults)
    return env


def write_faults(path: Path, entries: list) -> None:
    """The FAKE pyACL's fault-control file (its env FAKE_ACL_FAULTS), written whole (a file renamed
    over it), as its docstring asks."""
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(entries))
    temporary.replace(path)


#: Every port `free_port` has handed out in this test run.
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port free now, and never one this run handed out before: the kernel may give the same free
    port to two calls in a row, and a server's HTTP, gRPC and metrics ports must differ."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


@dataclass
class Server:
    process: subprocess.Popen
    http_port: int
    grpc_port: int
    log: Path
    metrics_port: int = 0

    @property
    def http(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def url(self) -> str:
        return f"http://{self.http}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def pytest_addoption(parser):
    parser.addoption(
        "--workers", type=int, default=1, metavar="N",
        help="start every kserve-ascend server with N frontend processes (--workers N) unless its test names a number",
    )


#: `pytest --workers N`: what `start_server` starts by default.
WORKERS = 1


def pytest_configure(config):
    global WORKERS
    WORKERS = config.getoption("--workers")


def start_server(
    model_dir: Path, log: Path, *extra: str, env: dict | None = None, wait: str = "ready", workers: int | None = None
) -> Server:
    """Starts `python -m kserve_ascend` and waits until it is `wait`: "ready", "loaded" (the start-up load
    has ended, a broken model's reason is in the index) or "live".

    `workers` > 1: an engine process and that many frontend processes (`--workers`); by
    default, what `pytest --workers N` asks (1: one process).
    """
    workers = WORKERS if workers is None else workers
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    command = [
        sys.executable, "-m", "kserve_ascend",
        "--model_dir", str(model_dir),
        "--http_port", str(http_port),
        "--grpc_port", str(grpc_port),
        "--metrics_port", str(metrics_port),
        *(("--workers", str(workers)) if workers > 1 else ()),
        *extra,
    ]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, **(env or {})})
    server = Server(process, http_port, grpc_port, log, metrics_port)

    def reached() -> bool:
        if wait == "loaded":
            index = requests.post(f"{server.url}/v2/repository/index", timeout=1).json()
            return all(entry["state"] != "LOADING" for entry in index)
        return requests.get(f"{server.url}/v2/health/{wait}", timeout=1).status_code == 200

    return wait_until(server, reached, timeout=60)


def wait_until(server: "Server", condition, timeout: float) -> "Server":
    """Polls `condition` until it holds; stops the server and raises if it exits or times out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"{server.process.args[1]} exited with {server.process.returncode}:\n{server.output()[-5000:]}")
        try:
            if condition():
                return server
        except requests.ConnectionError:
            pass
        time.sleep(0.2)
    stop_server(server)
    raise RuntimeError(f"{server.process.args[1]} did not become ready:\n{server.output()[-5000:]}")


def stop_server(server: Server) -> None:
    """SIGTERM, as Kubernetes stops a pod; then every process the server started must be gone too
    (frontends of --workers, codec processes), or the test fails naming them."""
    started = descendants(server.process.pid)
    server.process.send_signal(signal.SIGTERM)
    try:
        server.process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()
    deadline = time.monotonic() + 10
    while (left := [pid for pid in started if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    named = [command_line(pid) for pid in left]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"the server left processes behind: {named}"


def descendants(pid: int) -> list[int]:
    """The processes `pid` started, and the ones they started (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return f"pid {pid} (gone)"


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, which only its new parent has yet to reap, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Server:
    """The KServe server on the project's own model_repository/."""
    srv = start_server(REPOSITORY, tmp_path_factory.mktemp("logs") / "server.log")
    yield srv
    stop_server(srv)


def copy_model(name: str, repository: Path, new_name: str | None = None) -> Path:
    """Copies a model of model_repository/ into another repository (renaming it if asked)."""
    target = repository / (new_name or name)
    shutil.copytree(REPOSITORY / name, target)
    if new_name:
        config = target / "config.pbtxt"
        config.write_text(config.read_text().replace(f'name: "{name}"', f'name: "{new_name}"'))
    return target



def start_triton(model_dir: Path, workdir: Path, *extra: str, wait_ready: bool = True) -> Server:
    """Starts real Triton (tools/run_triton.py) with the `ascend` backend on free ports."""
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    log = workdir / "triton.log"
    command = [
        sys.executable, str(ROOT / "tools" / "run_triton.py"),
        "--model-repository", str(model_dir),
        "--backend-directory", str(workdir / "backends"),
        "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port),
        "--", *extra,
    ]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    triton = Server(process, http_port, grpc_port, log, metrics_port)
    path = "/v2/health/ready" if wait_ready else "/v2/health/live"
    return wait_until(triton, lambda: requests.get(triton.url + path, timeout=1).status_code == 200, timeout=120)


def both_servers(repository: Path, tmp_path_factory, *triton_args: str, wait_ready: bool = True):
    """For a module fixture (`yield from`): {"kserve-ascend": ..., "triton": ...} on one repository."""
    ours = start_server(repository, tmp_path_factory.mktemp("logs") / "server.log", wait="ready" if wait_ready else "loaded")
    try:
        triton = start_triton(repository, tmp_path_factory.mktemp("triton"), *triton_args, wait_ready=wait_ready)
    except BaseException:
        stop_server(ours)
        raise
    try:
        yield {"kserve-ascend": ours, "triton": triton}
    finally:
        stop_server(triton)
        stop_server(ours)


@pytest.fixture(scope="session")
def triton(tmp_path_factory) -> Server:
    """Real Triton 2.51 on the project's own model_repository/."""
    srv = start_triton(REPOSITORY, tmp_path_factory.mktemp("triton"))
    yield srv
    stop_server(srv)
