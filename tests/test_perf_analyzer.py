"""perf_analyzer 2.51, Triton's load generator (tools/perf_analyzer.py), against the KServe server and real Triton.

Briefly, in the modes Triton users run it in: each run must finish (exit 0) and report the
server-side queue and compute figures, which perf_analyzer reads from the statistics
extension at both ends of every measurement window (and refuses when their compute counts
differ). Three 200 ms windows per run, taken as they come: this checks that it runs, it
measures nothing.
"""

from __future__ import annotations

import base64
import csv
import io
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from PIL import Image

from conftest import ROOT

PERF_ANALYZER = ROOT / "tools" / "perf_analyzer.py"
BRIEFLY = ["--measurement-interval", "200", "--max-trials", "3", "--stability-percentage", "10000"]

MODES = {
    "http-binary": ["--input-tensor-format", "binary", "--output-tensor-format", "binary"],
    "http-json-async": ["--async", "--concurrency-range", "2", "--input-tensor-format", "json", "--output-tensor-format", "json"],
    "http-batch-4": ["-b", "4"],
    "http-shared-memory": ["--shared-memory", "system"],
    "http-request-rate": ["--request-rate-range", "200"],
    "grpc": ["-i", "grpc"],
    "grpc-async-batch-4": ["-i", "grpc", "--async", "--concurrency-range", "2", "-b", "4"],
    "grpc-streaming": ["-i", "grpc", "--streaming"],
    "grpc-shared-memory": ["-i", "grpc", "--shared-memory", "system"],
    "grpc-collect-metrics": ["-i", "grpc", "--collect-metrics"],
}

#: perf_analyzer's CSV (`-f`) columns of the server side, microseconds per request.
SERVER_COLUMNS = ("Server Queue", "Server Compute Input", "Server Compute Infer", "Server Compute Output")


def perf_analyzer(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(PERF_ANALYZER), *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module", params=["kserve", "triton"])
def target(request):
    """Each server on the project's model_repository/ (the session's, shared with other modules)."""
    return request.getfixturevalue("server" if request.param == "kserve" else "triton")


@pytest.mark.parametrize("mode", MODES)
def test_runs_to_completion_with_server_side_figures(target, mode, tmp_path):
    url = target.grpc if "-i" in MODES[mode] else target.http
    args = ["-m", "simple", "-u", url, *MODES[mode], *BRIEFLY, "-f", str(tmp_path / "run.csv")]
    if "--collect-metrics" in args:
        args += ["--metrics-url", f"127.0.0.1:{target.metrics_port}/metrics"]
    run = perf_analyzer(*args)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    with open(tmp_path / "run.csv") as file:
        [row] = list(csv.DictReader(file))
    assert float(row["Inferences/Second"]) > 0
    for column in SERVER_COLUMNS:
        assert int(row[column]) > 0, (column, row)
    if "--collect-metrics" in args:
        assert "Server Prometheus Metrics" in run.stdout


def test_runs_by_name_from_the_virtualenv(server, tmp_path):
    """As Triton's Model Analyzer and users run it: `perf_analyzer`, found first on PATH in .venv/bin (the
    virtualenv active), with no LD_LIBRARY_PATH set."""
    env = {"PATH": os.pathsep.join([str(ROOT / ".venv" / "bin"), "/usr/bin", "/bin"]), "HOME": str(tmp_path)}
    run = subprocess.run(
        ["perf_analyzer", "-m", "simple", "-u", server.http, *BRIEFLY, "-f", str(tmp_path / "run.csv")],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    with open(tmp_path / "run.csv") as file:
        [row] = list(csv.DictReader(file))
    assert float(row["Inferences/Second"]) > 0


def test_refuses_a_server_it_cannot_scrape(server):
    """--collect-metrics above is checked: with a metrics URL nothing answers at, the run fails."""
    run = perf_analyzer("-m", "simple", "-u", server.http, *BRIEFLY, "--collect-metrics", "--metrics-url", "127.0.0.1:1/metrics")
    assert run.returncode != 0 and "Unable to connect to Metrics endpoint" in run.stdout + run.stderr


def test_shared_memory_outputs_answered_as_triton_does(server, triton):
    """An output written to shared memory is named with its datatype and shape only, over HTTP and gRPC.

    What perf_analyzer's C++ HTTP client needs: `parameters` on an output there are read as
    binary data, whose `binary_data_size` it then misses.
    """
    key = f"/kserve_ascend_test_pa_{os.getpid()}"
    handle = shm.create_shared_memory_region("pa_out", key, 128, create_only=True)
    try:
        answers = []
        data = np.arange(16, dtype=np.int32).reshape(1, 16)
        for target in (server, triton):
            requests.post(f"{target.url}/v2/systemsharedmemory/region/pa_out/register", json={"key": key, "byte_size": 128}).raise_for_status()
            placed = [{"name": f"OUTPUT{i}", "parameters": {"shared_memory_region": "pa_out", "shared_memory_byte_size": 64,
                                                            "shared_memory_offset": 64 * i}} for i in (0, 1)]
            body = {"inputs": [{"name": n, "shape": [1, 16], "datatype": "INT32", "data": data.ravel().tolist()}
                               for n in ("INPUT0", "INPUT1")], "outputs": placed}
            http = requests.post(f"{target.url}/v2/models/simple/infer", json=body)
            assert http.status_code == 200, http.text
            np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.int32, [1, 16], offset=0), data + data)

            inputs = [grpcclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
            for tensor in inputs:
                tensor.set_data_from_numpy(data)
            outputs = [grpcclient.InferRequestedOutput(f"OUTPUT{i}") for i in (0, 1)]
            for i, output in enumerate(outputs):
                output.set_shared_memory("pa_out", 64, offset=64 * i)
            with grpcclient.InferenceServerClient(target.grpc) as client:
                grpc = client.infer("simple", inputs, outputs=outputs).get_response()
            requests.post(f"{target.url}/v2/systemsharedmemory/region/pa_out/unregister").raise_for_status()
            by_name = sorted(range(len(grpc.outputs)), key=lambda i: grpc.outputs[i].name)  # in either order
            answers.append((
                sorted(http.json()["outputs"], key=lambda output: output["name"]),
                [grpc.outputs[i] for i in by_name],
                [grpc.raw_output_contents[i] for i in by_name],
            ))
    finally:
        shm.destroy_shared_memory_region(handle)
    ours, triton_answer = answers
    assert ours == triton_answer
    http_outputs, grpc_outputs, raw = ours
    assert [set(output) for output in http_outputs] == [{"name", "datatype", "shape"}] * 2
    assert [len(output.parameters) for output in grpc_outputs] == [0, 0] and raw == [b"", b""]


def test_measures_the_detection_ensemble_and_its_composing_models(target, tmp_path):
    """A Triton user's detection pipeline: perf_analyzer reads the ensemble's config and reports each
    composing model (from their statistics), the detector batching the concurrent images."""
    picture = io.BytesIO()
    Image.new("RGB", (320, 240), (90, 140, 200)).save(picture, "PNG")
    encoded = picture.getvalue()
    # perf_analyzer sends a "b64" value as it is: a BYTES tensor's serialization, each element length-prefixed.
    data = {"data": [{"image": {"b64": base64.b64encode(struct.pack("<I", len(encoded)) + encoded).decode(), "shape": [1]}}]}
    (tmp_path / "input.json").write_text(json.dumps(data))
    run = perf_analyzer(
        "-m", "yolov8n_detect", "-u", target.http, "--input-data", str(tmp_path / "input.json"), "--concurrency-range", "4",
        "--measurement-interval", "1500", "--max-trials", "3", "--stability-percentage", "10000",
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    composing = run.stdout.split("Composing models:")[1]
    for model in ("yolov8_preprocess", "yolov8n", "yolov8_postprocess"):
        assert f"{model}, version: 1" in composing
