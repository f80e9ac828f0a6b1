"""The servers under test: their model repositories, start and stop, and what they answered.

Processes are started with the tests' own helpers (conformance/harness.py): free loopback
ports, a log per server, readiness polled over HTTP, SIGTERM then SIGKILL.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import sys
from pathlib import Path

import psutil
import requests
from payloads import BENCH_REPOSITORY, REPOSITORY, model_dir

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
sys.path.insert(0, str(ROOT))
from conformance.harness import Server, free_port, start, start_server, start_triton, stop_server  # noqa: I001

#: MLServer 1.7.1 in its own virtualenv (Makefile: MLSERVER_VENV); its runtimes are bench/mlserver/.
MLSERVER = ROOT / ".venv" / "mlserver" / "bin" / "mlserver"
_DYNAMIC_BATCHING = re.compile(r"^dynamic_batching\s*\{[^}]*\}\s*\n", re.MULTILINE)

#: The committed `simple` does not batch. A 16-int add costs microseconds, so what a batch
#: saves is per-request server work (one executor hop per batch instead of per request);
#: with no delay it never waits for company, it only takes what queued while the model ran.
SIMPLE_DYNAMIC_BATCHING = "dynamic_batching { }\n"

SCENARIOS = {
    "raw": "raw executor (in-process, max batch)",
    "nobatch": "kserve-ascend, no batching",
    "batch": "kserve-ascend, dynamic batching, --workers 1",
    "workers2": "kserve-ascend, dynamic batching, --workers 2",
    "triton": "Triton 2.51 + ascend backend",
    "mlserver": "MLServer 1.7.1, custom runtimes",
    "stock": "stock KServe custom model",
}
#: kserve-ascend's scenarios started with `--workers N` (N > 1); "batch" is the default, one process.
WORKERS = {"workers2": 2}
#: The models each peer serves (kserve-ascend and Triton: the whole repository).
PEER_MODELS = {"mlserver": ("sim", "simple", "fastsim"), "stock": ("sim", "simple", "fastsim", "yolov8n")}


def make_repositories(workdir: Path) -> None:
    """`repository-nobatch`: every dynamic_batching removed; `repository-batch`: as committed, plus batching
    for `simple`. Both hold model_repository/ and the bench's own models."""
    for kind in ("nobatch", "batch"):
        target = workdir / f"repository-{kind}"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(REPOSITORY, target)
        shutil.copytree(BENCH_REPOSITORY, target, dirs_exist_ok=True)
        for config in target.glob("*/config.pbtxt"):
            text = config.read_text()
            if kind == "nobatch":
                text = _DYNAMIC_BATCHING.sub("", text)
            elif config.parent.name == "simple" and not _DYNAMIC_BATCHING.search(text):
                text += SIMPLE_DYNAMIC_BATCHING
            config.write_text(text)


def start_stock(log: Path) -> Server:
    http_port, grpc_port = free_port(), free_port()
    command = [sys.executable, str(BENCH / "stock_kserve.py"), "--http_port", str(http_port), "--grpc_port", str(grpc_port)]
    return start(command, log, http_port, grpc_port, name="stock KServe", timeout=60)


def mlserver_settings(home: Path, http_port: int, grpc_port: int, metrics_port: int) -> None:
    """settings.json and one model-settings.json per model, mirroring each model's config.pbtxt:
    adaptive batching where the model batches dynamically (max_batch_size, max_queue_delay as
    max_batch_time), the sim device's costs as extra parameters."""
    from kserve_ascend.core.config import read_config

    home.mkdir(parents=True, exist_ok=True)
    # debug off: with MLServer's default (debug: true) it logs at DEBUG and writes an access-log line
    # per request, which a production deployment turns off (mlserver/rest/server.py: access_log=debug).
    settings = {"debug": False, "host": "127.0.0.1", "http_port": http_port, "grpc_port": grpc_port, "metrics_port": metrics_port}
    (home / "settings.json").write_text(json.dumps(settings))
    for model in PEER_MODELS["mlserver"]:
        config = read_config(model_dir(model))
        entry = {"name": model, "implementation": "runtimes.Simple" if model == "simple" else "runtimes.Sim"}
        if "sim_fixed_ms" in config.parameters:
            entry["parameters"] = {"extra": {key: config.parameters[key].string_value for key in ("sim_fixed_ms", "sim_per_item_ms")}}
        if config.HasField("dynamic_batching"):
            entry["max_batch_size"] = config.max_batch_size
            entry["max_batch_time"] = config.dynamic_batching.max_queue_delay_microseconds / 1e6
        (home / model).mkdir(exist_ok=True)
        (home / model / "model-settings.json").write_text(json.dumps(entry))


def start_mlserver(workdir: Path, log: Path) -> Server:
    if not MLSERVER.exists():
        raise RuntimeError(f"{MLSERVER} is missing: `make bench` installs MLServer 1.7.1 in its own virtualenv")
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    home = workdir / "mlserver"
    mlserver_settings(home, http_port, grpc_port, metrics_port)

    def ready(server: Server) -> bool:
        # Every model: the server-wide readiness does not wait for MLServer's parallel workers.
        return all(requests.get(f"{server.url}/v2/models/{m}/ready", timeout=1).status_code == 200 for m in PEER_MODELS["mlserver"])

    command = [str(MLSERVER), "start", str(home)]
    return start(command, log, http_port, grpc_port, metrics_port, name="MLServer", ready=ready, timeout=120,
                 env={"PYTHONPATH": str(BENCH / "mlserver")}, cwd=home)  # fmt: skip


@contextlib.contextmanager
def running(scenario: str, workdir: Path, logs: Path):
    """The server of `scenario` on the repositories in `workdir`, stopped on the way out."""
    logs.mkdir(parents=True, exist_ok=True)
    if scenario == "nobatch":
        server = start_server(workdir / "repository-nobatch", logs / "kserve_ascend-nobatch.log")
    elif scenario == "batch" or scenario in WORKERS:
        server = start_server(workdir / "repository-batch", logs / f"kserve_ascend-{scenario}.log", workers=WORKERS.get(scenario, 1))
    elif scenario == "triton":
        (workdir / "triton").mkdir(exist_ok=True)  # its backend directory and triton.log
        server = start_triton(workdir / "repository-batch", workdir / "triton")
    elif scenario == "mlserver":
        server = start_mlserver(workdir, logs / "mlserver.log")
    elif scenario == "stock":
        server = start_stock(logs / "stock_kserve.log")
    else:
        raise ValueError(scenario)
    try:
        yield server
    finally:
        members = tree(server)
        stop_server(server)
        _reap(members)
        if scenario == "triton":
            shutil.copy(server.log, logs / "triton.log")


def _reap(members: list[psutil.Process]) -> None:
    """Ends what the server left behind (a frontend, a stub, an inference worker whose parent was
    killed): the next scenario must have the cores and ports to itself."""
    alive = []
    for member in members:
        with contextlib.suppress(psutil.NoSuchProcess):
            if member.status() != psutil.STATUS_ZOMBIE:
                alive.append(member)
    for member in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.terminate()
    _, left = psutil.wait_procs(alive, timeout=10)
    for member in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.kill()


def tree(server: Server) -> list[psutil.Process]:
    """The server's process tree: Triton's python stubs, MLServer's inference workers, kserve-ascend's frontends."""
    try:
        process = psutil.Process(server.process.pid)
        return [process, *process.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def rss_mb(server: Server) -> float:
    """Resident memory of the server and its children, in MiB."""
    total = 0
    for member in tree(server):
        with contextlib.suppress(psutil.NoSuchProcess):
            total += member.memory_info().rss
    return total / 2**20


#: The scenarios whose server has Triton's statistics extension (kserve-ascend and Triton).
WITH_STATISTICS = frozenset({"nobatch", "batch", *WORKERS, "triton"})


def counters(server: Server, model: str) -> dict[str, int]:
    """What the statistics extension has counted for `model` so far, summed over its versions: requests
    answered successfully (`answered`), rows inferred (`rows`), executions, and the device's time in them
    (`device_ns`: each execution's compute_infer once, from `batch_stats`)."""
    stats = requests.get(f"{server.url}/v2/models/{model}/stats", timeout=10)
    stats.raise_for_status()
    versions = stats.json()["model_stats"]
    return {
        "answered": sum(v["inference_stats"]["success"]["count"] for v in versions),
        "rows": sum(v["inference_count"] for v in versions),
        "executions": sum(v["execution_count"] for v in versions),
        "device_ns": sum(int(b["compute_infer"]["ns"]) for v in versions for b in v.get("batch_stats", ())),
    }
