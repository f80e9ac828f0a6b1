"""Triton's statistics extension as Triton reports it: its fields, beside real Triton's, and compute counts that agree.

`inference_stats` count requests and `batch_stats` executions, each with `compute_input`,
`compute_infer` and `compute_output` recorded together (core/stats.py says what each
measures); checked in-process on the core's Instance and scheduler timing, then on the real
KServe server under concurrent load, over REST and gRPC.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from google.protobuf import json_format
from tritonclient.grpc import service_pb2 as pb

from conftest import REPOSITORY, copy_model, scrape, start_server, statistics, stop_server
from kserve_ascend.core.config import read_config
from kserve_ascend.core.execution.instance import Instance
from kserve_ascend.core.execution.runtimes.sim import SimRuntime
from kserve_ascend.core.signature import Signature
from kserve_ascend.core.stats import Execution, now_ns

#: sim's config.pbtxt: an execution of b rows sleeps 20 + 1·b ms.
SIM_FIXED_MS, SIM_PER_ROW_MS = 20, 1
COMPUTE = ("compute_input", "compute_infer", "compute_output")


# ---- the core, in-process ----------------------------------------------------------------------


def timed(runner, requests) -> tuple[list, Execution]:
    """`runner(requests, execution)` as the scheduler runs it: its results and the execution's phases."""
    execution = Execution(now_ns())
    results = runner(requests, execution)
    return results, execution.ran(now_ns())


def test_an_instance_notes_its_input_and_output_phases_apart_from_the_run():
    config = read_config(REPOSITORY / "sim")
    instance = Instance(SimRuntime(Path("model.sim"), 0, config), Signature(config))
    batch = [{"INPUT0": np.full((rows, 4), rows, np.float32)} for rows in (1, 2)]
    results, execution = timed(instance.run_batch, batch)
    for request, result in zip(batch, results, strict=True):
        np.testing.assert_array_equal(result["OUTPUT0"], request["INPUT0"])
    # The run holds the simulated device's sleep (a lower bound it guarantees); gathering and splitting are apart.
    assert execution.infer_ns >= (SIM_FIXED_MS + 3 * SIM_PER_ROW_MS) * 1_000_000
    assert execution.input_ns > 0 and execution.output_ns > 0


def test_a_runner_that_notes_no_phases_is_all_infer():
    """Phases belong to their execution: what an earlier run on the same thread noted is not the next one's."""
    config = read_config(REPOSITORY / "sim")
    instance = Instance(SimRuntime(Path("model.sim"), 0, config), Signature(config))
    timed(instance.run_batch, [{"INPUT0": np.ones((1, 4), np.float32)}])
    results, execution = timed(lambda requests, execution: list(requests), [{"x": 1}])
    assert results == [{"x": 1}]
    assert (execution.input_ns, execution.output_ns) == (0, 0) and execution.infer_ns > 0


# ---- the servers -------------------------------------------------------------------------------


def keys(value):
    """The shape of a JSON value: its keys all the way down (lists by their first element)."""
    if isinstance(value, dict):
        return {key: keys(item) for key, item in value.items()}
    if isinstance(value, list):
        return [keys(value[0])] if value else []
    return None


def simple_body(**extra) -> dict:
    data = list(range(16))
    return {"inputs": [{"name": n, "shape": [1, 16], "datatype": "INT32", "data": data} for n in ("INPUT0", "INPUT1")], **extra}


def test_fields_are_tritons(server, triton):
    """Every field real Triton 2.51 reports (response_stats, memory_usage, cache_hit/miss...), over REST and gRPC."""
    shapes = []
    for target in (server, triton):
        assert requests.post(f"{target.url}/v2/models/simple/infer", json=simple_body()).status_code == 200
        [rest] = requests.get(f"{target.url}/v2/models/simple/stats").json()["model_stats"]
        with grpcclient.InferenceServerClient(target.grpc) as client:
            [grpc] = client.get_inference_statistics("simple").model_stats
        # Every field, zeros too: which counters are zero depends on the tests run before.
        grpc = json_format.MessageToDict(grpc, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
        shapes.append((keys(rest), keys(grpc)))
    (ours_rest, ours_grpc), (triton_rest, triton_grpc) = shapes
    assert ours_rest.pop("batch_padding_rows") is None  # ours alone: REST only
    assert ours_rest == triton_rest
    assert ours_grpc == triton_grpc
    assert triton_rest["response_stats"] == {} and triton_rest["memory_usage"] == []


# sim batches (dynamic_batching, 5 ms delay); simple does not, and answers in shared memory too.
@pytest.fixture(scope="module")
def stats_server(tmp_path_factory):
    repository = tmp_path_factory.mktemp("stats_repo")
    copy_model("sim", repository)
    copy_model("simple", repository)
    srv = start_server(repository, repository.parent / "stats.log")
    yield srv
    stop_server(srv)


def test_compute_counts_agree_per_request_and_per_batch_size(stats_server):
    """perf_analyzer's check (equal compute counts), and Triton's accounting: each request is
    charged with its whole execution, each execution counted once under its batch size."""
    def call(index):
        protocol = (httpclient, stats_server.http) if index % 2 else (grpcclient, stats_server.grpc)
        with protocol[0].InferenceServerClient(protocol[1]) as client:
            tensor = protocol[0].InferInput("INPUT0", [1, 4], "FP32")
            tensor.set_data_from_numpy(np.full((1, 4), index, np.float32))
            np.testing.assert_array_equal(client.infer("sim", [tensor]).as_numpy("OUTPUT0"), np.full((1, 4), index))

    with ThreadPoolExecutor(12) as pool:
        list(pool.map(call, range(24)))
    stats = statistics(stats_server, "sim")
    inference, batches = stats["inference_stats"], stats["batch_stats"]
    assert [inference[key]["count"] for key in ("success", "queue", *COMPUTE)] == [24] * 5
    assert all(len({batch[key]["count"] for key in COMPUTE}) == 1 for batch in batches)
    assert sum(b["compute_infer"]["count"] for b in batches) == stats["execution_count"] < 24  # requests shared executions
    assert sum(b["batch_size"] * b["compute_infer"]["count"] for b in batches) == stats["inference_count"] == 24
    # One-row requests: an execution of b rows served b requests, each charged its whole run.
    assert inference["compute_infer"]["ns"] == sum(b["batch_size"] * b["compute_infer"]["ns"] for b in batches)
    for key in ("compute_input", "compute_output"):  # plus each request's own decoding / encoding
        assert inference[key]["ns"] > sum(b["batch_size"] * b[key]["ns"] for b in batches)
    for batch in batches:  # the run holds the simulated device's sleep
        assert batch["compute_infer"]["ns"] >= batch["compute_infer"]["count"] * (SIM_FIXED_MS + batch["batch_size"]) * 1_000_000
    for key in ("success", "queue", *COMPUTE):
        assert inference[key]["ns"] > 0
    assert inference["success"]["ns"] > inference["queue"]["ns"] + sum(inference[key]["ns"] for key in COMPUTE)

    with grpcclient.InferenceServerClient(stats_server.grpc) as client:
        over_grpc = client.get_inference_statistics("sim")
    del stats["batch_padding_rows"]  # REST only
    assert over_grpc == json_format.ParseDict({"model_stats": [stats]}, pb.ModelStatisticsResponse())


def test_an_answer_that_cannot_be_written_fails_the_request(stats_server):
    """An output larger than its shared memory region: 400, and counted as one failed request
    (its execution still counted); compute counts stay equal. (Triton 2.51 answers 500 and
    counts it a success, though its client saw it fail.)"""
    before = statistics(stats_server, "simple")
    key = f"/kserve_ascend_test_stats_{os.getpid()}"
    handle = shm.create_shared_memory_region("stats_out", key, 64, create_only=True)
    try:
        requests.post(f"{stats_server.url}/v2/systemsharedmemory/region/stats_out/register", json={"key": key, "byte_size": 64}).raise_for_status()
        small = {"name": "OUTPUT0", "parameters": {"shared_memory_region": "stats_out", "shared_memory_byte_size": 8}}
        response = requests.post(f"{stats_server.url}/v2/models/simple/infer", json=simple_body(outputs=[small]))
        requests.post(f"{stats_server.url}/v2/systemsharedmemory/region/stats_out/unregister").raise_for_status()
    finally:
        shm.destroy_shared_memory_region(handle)
    assert response.status_code == 400 and "OUTPUT0" in response.json()["error"]
    after = statistics(stats_server, "simple")
    counts = {key: after["inference_stats"][key]["count"] - before["inference_stats"][key]["count"] for key in ("success", "fail", *COMPUTE)}
    assert counts == {"success": 0, "fail": 1, "compute_input": 0, "compute_infer": 0, "compute_output": 0}
    assert after["execution_count"] == before["execution_count"] + 1
    failures = scrape(stats_server, stats_server.http_port).by("reason", "nv_inference_request_failure", model="simple")
    assert failures == {"REJECTED": 0, "CANCELED": 0, "BACKEND": 0, "OTHER": 1}
