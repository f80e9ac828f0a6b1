"""Faults of the ports, with one process and with --workers 2: fault -> answer.

- the HTTP, gRPC or metrics port held by another process -> the server exits non-zero before it starts,
  with one line naming the port ("kserve-ascend: the gRPC port 8081 is in use: ..."), no traceback.
- one port given to two of the server's flags (--grpc_port and --metrics_port 9000) -> the server exits
  non-zero before it starts, with one line naming both flags (--metrics_port 0, metrics
  on the HTTP port only, is no port of its own: test_metrics.py serves so).
- a second server started on a running server's gRPC port (grpcio would share it by SO_REUSEPORT, and the
  kernel split the connections between them) -> the second exits so; the first serves on.
"""

from __future__ import annotations

import socket
import subprocess
import sys

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from conftest import ROOT, copy_model, free_port, start_server, stop_server

WORKERS = pytest.mark.parametrize("workers", [1, 2], ids=["workers1", "workers2"])
FLAGS = {"HTTP": "--http_port", "gRPC": "--grpc_port", "metrics": "--metrics_port"}


def run_server(model_dir, ports: dict[str, int], workers: int) -> subprocess.CompletedProcess:
    """`kserve-ascend` on these ports (the others free), run to its exit; one that starts serving is a failure."""
    ports = {name: ports.get(name) or free_port() for name in FLAGS}
    command = [sys.executable, "-m", "kserve_ascend", "--model_dir", str(model_dir), "--workers", str(workers)]
    for name, flag in FLAGS.items():
        command += [flag, str(ports[name])]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=60)


def refused_port(result: subprocess.CompletedProcess, name: str, port: int) -> None:
    """The server exited non-zero with one line naming the port, and no traceback."""
    assert result.returncode != 0
    assert f"kserve-ascend: the {name} port {port} is in use: Address already in use" in result.stderr.splitlines()
    assert "Traceback" not in result.stdout + result.stderr


@WORKERS
@pytest.mark.parametrize("name", FLAGS)
def test_a_port_another_process_holds_stops_the_server_with_one_line_naming_it(tmp_path, name, workers):
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = run_server(tmp_path, {name: port}, workers)
    refused_port(result, name, port)


@pytest.mark.parametrize("same", [("HTTP", "gRPC"), ("gRPC", "metrics"), ("HTTP", "metrics")])
def test_one_port_given_twice_stops_the_server_with_one_line_naming_both_flags(tmp_path, same):
    port = free_port()
    result = run_server(tmp_path, dict.fromkeys(same, port), workers=1)
    assert result.returncode != 0
    first, second = (FLAGS[name] for name in same)
    assert result.stderr.splitlines() == [f"kserve-ascend: {first} and {second} are both {port}: give each its own port"]


@WORKERS
def test_a_second_server_on_a_running_servers_grpc_port_exits_and_the_first_serves_on(tmp_path, workers):
    repository = tmp_path / "repository"
    repository.mkdir()
    copy_model("simple", repository)
    first = start_server(repository, tmp_path / "first.log", workers=workers)
    try:
        refused_port(run_server(repository, {"gRPC": first.grpc_port}, workers), "gRPC", first.grpc_port)
        client = grpcclient.InferenceServerClient(first.grpc)  # the first serves on
        try:
            inputs = [grpcclient.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
            for tensor in inputs:
                tensor.set_data_from_numpy(np.arange(16, dtype=np.int32).reshape(1, 16))
            assert (client.infer("simple", inputs).as_numpy("OUTPUT0") == 2 * np.arange(16)).all()
        finally:
            client.close()
    finally:
        stop_server(first)
    assert first.process.returncode == 0
