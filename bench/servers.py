"""The servers under test: their model repositories, start and stop, and their memory.

Processes are started with the tests' own helpers (tests/conftest.py): free loopback
ports, a log per server, readiness polled over HTTP, SIGTERM then SIGKILL.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from conftest import Server, free_port, start_server, start_triton, stop_server, wait_until  # noqa: E402

REPOSITORY = ROOT / "model_repository"
_DYNAMIC_BATCHING = re.compile(r"^dynamic_batching\s*\{[^}]*\}\s*\n", re.MULTILINE)

#: The committed `simple` does not batch. A 16-int add costs microseconds, so what a batch
#: saves is per-request server work (one executor hop per batch instead of per request);
#: with no delay it never waits for company, it only takes what queued while the model ran.
SIMPLE_DYNAMIC_BATCHING = "dynamic_batching { }\n"

SCENARIOS = {
    "raw": "raw executor (in-process, max batch)",
    "nobatch": "kserve_ascend, no batching",
    "batch": "kserve_ascend, dynamic batching",
    "triton": "Triton + ascend backend",
    "stock": "stock KServe custom model",
}


def make_repositories(workdir: Path) -> None:
    """`repository-nobatch`: every dynamic_batching removed; `repository-batch`: as committed, plus batching for `simple`."""
    for kind in ("nobatch", "batch"):
        target = workdir / f"repository-{kind}"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(REPOSITORY, target)
        for config in target.glob("*/config.pbtxt"):
            text = config.read_text()
            if kind == "nobatch":
                text = _DYNAMIC_BATCHING.sub("", text)
            elif config.parent.name == "simple" and not _DYNAMIC_BATCHING.search(text):
                text += SIMPLE_DYNAMIC_BATCHING
            config.write_text(text)


def start_stock(log: Path) -> Server:
    http_port, grpc_port = free_port(), free_port()
    command = [sys.executable, str(ROOT / "bench" / "stock_kserve.py"), "--http_port", str(http_port), "--grpc_port", str(grpc_port)]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    server = Server(process, http_port, grpc_port, log)
    return wait_until(server, lambda: requests.get(f"{server.url}/v2/health/ready", timeout=1).status_code == 200, timeout=60)


@contextlib.contextmanager
def running(scenario: str, workdir: Path, logs: Path):
    """The server of `scenario` on the repositories in `workdir`, serving all three models, stopped on the way out."""
    logs.mkdir(parents=True, exist_ok=True)
    if scenario in ("nobatch", "batch"):
        server = start_server(workdir / f"repository-{scenario}", logs / f"kserve_ascend-{scenario}.log")
    elif scenario == "triton":
        (workdir / "triton").mkdir(exist_ok=True)  # its backend directory and triton.log
        server = start_triton(workdir / "repository-batch", workdir / "triton")
    elif scenario == "stock":
        server = start_stock(logs / "stock_kserve.log")
    else:
        raise ValueError(scenario)
    try:
        yield server
    finally:
        stop_server(server)
        if scenario == "triton":
            shutil.copy(server.log, logs / "triton.log")


def rss_mb(server: Server) -> float:
    """Resident memory of the server and its children (Triton's python stubs), in MiB."""
    process = psutil.Process(server.process.pid)
    tree = [process, *process.children(recursive=True)]
    total = 0
    for member in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += member.memory_info().rss
    return total / 2**20
