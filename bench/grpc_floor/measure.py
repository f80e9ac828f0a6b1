"""perf_analyzer (gRPC, c=16 and c=64) against each mode of floor.py, or kserve-ascend itself (`server`):
requests/s, p99 and server CPU ms per request (the server's CPU over the measured perf_analyzer run ÷ the
requests of its windows: the same small overcount for every mode).

    python bench/grpc_floor/measure.py aio aiohop uvloop sync:4 synchop:4 syncloop:4 server
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(BENCH.parent), str(BENCH)]
import pa_load
import servers
from cpu import CpuMeter
from tritonclient.grpc import InferenceServerClient
from tritonclient.utils import InferenceServerException

from conformance.harness import Server, free_port, start, start_server, stop_server

FLOOR = Path(__file__).with_name("floor.py")


def grpc_ready(server: Server) -> bool:
    try:
        return InferenceServerClient(server.grpc).is_server_ready()
    except InferenceServerException:  # not listening yet
        return False


def start_mode(mode: str, workdir: Path) -> Server:
    if mode == "server":
        return start_server(workdir / "repository-batch", workdir / "server.log", "--model_control_mode", "explicit",
                            "--load_model", "simple", workers=1)  # fmt: skip
    name, _, threads = mode.partition(":")
    grpc_port = free_port()
    command = [sys.executable, str(FLOOR), name, str(grpc_port), *(("--threads", threads) if threads else ())]
    return start(command, workdir / f"{name}.log", free_port(), grpc_port, name=mode, ready=grpc_ready)


def main(modes: list[str]) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="grpc-floor-"))
    servers.make_repositories(workdir)
    for mode in modes:
        for concurrency in (16, 64):
            server = start_mode(mode, workdir)
            try:
                pa_load.load(server, "simple", "grpc", concurrency, 1, 0, workdir)  # warm-up
                with CpuMeter(server.process.pid) as meter:
                    point = pa_load.load(server, "simple", "grpc", concurrency, 12, 0, workdir)
            finally:
                stop_server(server, check=False)
            cpu_ms = meter.cores()["server_cpu_s"] * 1000 / point["count"]
            print(f"{mode:11s} c={concurrency:3d} {point['qps']:8.0f}/s p99 {point['p99_ms']:6.1f} ms cpu {cpu_ms:.3f} ms/req", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
